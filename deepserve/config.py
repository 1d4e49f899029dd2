"""Engine configuration: a few frozen dataclasses, validated once.

`EngineArgs` is the flat, user-facing set of knobs (vLLM's names); `create_engine_config()` turns it
into the grouped configs the engine reads. Values known only at runtime (how many KV blocks fit) are
returned by the code that measures them, never written back here.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from deepserve import envs

DEFAULT_CHUNKED_TOKEN_BUDGET = 8192


@dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str | None  # None: token ids in and out (skip_tokenizer_init, or a preset)
    hf_config: Any  # transformers.PretrainedConfig
    dtype: str  # "float32" | "bfloat16" | "float16"
    max_model_len: int
    seed: int = 0
    load_format: str = "auto"  # "auto" | "dummy"
    device: str = "cpu"  # resolved: "cpu" | "cuda"
    enforce_eager: bool = False  # True: no CUDA graphs
    # "fp8", "awq", "gptq" or None, resolved from --quantization and the checkpoint (layers/quantization.py)
    quantization: str | None = None
    decryption_key_file: str | None = None  # key of a checkpoint encrypted at rest (loader/encryption.py)

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        return archs[0] if archs else ""


# --kv-cache-dtype (vLLM's names) -> the torch dtype name of the cache, None: the model's dtype. FP8 caches
# keep per-layer float32 scales (layers/attention.py, layers/mla.py). e5m2 is not built.
KV_CACHE_DTYPES: dict[str, str | None] = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # GiB of host memory (pinned on CUDA) for the KV blocks of preempted requests and, with prefix caching,
    # prefix blocks evicted from the GPU (engine/block_manager.py); 0: no host tier
    swap_space: float = 0.0
    kv_cache_dtype: str = "auto"
    cpu_kv_cache_gib: float = 1.0  # the cache budget on CPU, where there is no device to measure

    def __post_init__(self) -> None:
        # Each message names the LLM(...) argument and the CLI flag: the same check serves both.
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size (--block-size) must be a power of two >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization (--gpu-memory-utilization) must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override (--num-gpu-blocks-override) must be >= 1, got "
                             f"{self.num_gpu_blocks_override}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space (--swap-space) must be >= 0 GiB, got {self.swap_space}")
        if not self.cpu_kv_cache_gib > 0:  # also NaN; 0 or less used to leave a one-block (16-token) cache
            raise ValueError(f"cpu_kv_cache_gib (--cpu-kv-cache-gib) must be > 0 GiB (the KV cache's size on CPU), "
                             f"got {self.cpu_kv_cache_gib}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype (kv_cache_dtype) {self.kv_cache_dtype!r} is not supported; use one of "
                f"{', '.join(KV_CACHE_DTYPES)} (auto: the model's dtype; fp8 = fp8_e4m3: float8_e4m3fn)")

    @property
    def cache_dtype_name(self) -> str | None:
        """The torch dtype name the KV cache is allocated in, or None for the model's own (auto)."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = DEFAULT_CHUNKED_TOKEN_BUDGET
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    # Schedule and launch step n+1 before reading step n's tokens (EngineCore._step_async).
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill a whole prompt must fit one step: max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len}); "
                "raise --max-num-batched-tokens, lower --max-model-len or enable chunked prefill"
            )


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Multi-node (docs/parallel.md): the world (tensor_parallel_size x pipeline_parallel_size ranks,
    # stage-major) is split evenly, world / nnodes ranks per node, node k holding the k-th block; node 0
    # runs the engine and hosts torch.distributed's rendezvous (TCPStore) at master_addr:master_port.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (single node only)
    # The tensor-parallel ranks split the routed experts (whole experts per rank) instead of each
    # expert's intermediate size (docs/parallel.md).
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.nnodes < 1 or self.world_size % self.nnodes:
            raise ValueError(
                f"--nnodes {self.nnodes} must be >= 1 and divide the number of ranks, --tensor-parallel-size "
                f"{self.tensor_parallel_size} x --pipeline-parallel-size {self.pipeline_parallel_size} = "
                f"{self.world_size} (each node runs world / nnodes of them); fitting --nnodes values: "
                + ", ".join(str(n) for n in range(1, self.world_size + 1) if self.world_size % n == 0))
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be in [0, {self.nnodes - 1}] "
                             f"for --nnodes {self.nnodes}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("--nnodes > 1 needs --master-port (and --master-addr: node 0's address, reachable "
                             "from every node)")

    @property
    def world_size(self) -> int:
        """Every rank of the engine, on every node: rank = stage * tensor_parallel_size + tp_rank."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def node_ranks(self, node: int) -> range:
        """The global ranks node `node` runs: a contiguous block, so with tensor_parallel_size dividing
        ranks_per_node a stage's tensor-parallel group (and its all-reduces) never leaves a node."""
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)


SPECULATIVE_METHODS = ("ngram", "mtp", "deepseek_mtp")
MAX_SPECULATIVE_TOKENS = 15


@dataclass(frozen=True)
class SpeculativeConfig:
    """speculative_config (vLLM's keys): a draft proposes num_speculative_tokens tokens per request and
    step, and the target model verifies them in one forward over the k + 1 positions.

    ngram (prompt lookup): the draft is what followed the earliest earlier occurrence of the sequence's
    last n tokens, n from prompt_lookup_max down to prompt_lookup_min. mtp / deepseek_mtp: the
    checkpoint's multi-token-prediction layer (DeepSeek-V3/R1)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method {self.method!r} is not supported; use one of "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        if not isinstance(self.num_speculative_tokens, int) or not (
                1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens!r}")
        if not isinstance(self.prompt_lookup_min, int) or self.prompt_lookup_min < 1:
            raise ValueError(f"speculative_config.prompt_lookup_min must be an integer >= 1, "
                             f"got {self.prompt_lookup_min!r}")
        if not isinstance(self.prompt_lookup_max, int) or self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"speculative_config.prompt_lookup_max must be an integer >= prompt_lookup_min "
                             f"({self.prompt_lookup_min}), got {self.prompt_lookup_max!r}")

    @property
    def is_mtp(self) -> bool:
        return self.method in ("mtp", "deepseek_mtp")

    @classmethod
    def from_user(cls, value: dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """The config from LLM(speculative_config=...) or --speculative-config: a dict or its JSON text."""
        value = json_object(value, "--speculative-config (speculative_config)")
        if not value:
            return None
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; known: {sorted(known)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"speculative_config needs {key!r} (e.g. "
                                 '{"method": "ngram", "num_speculative_tokens": 4})')
        return cls(**value)

    def check_model(self, hf_config: Any) -> None:
        """Refuse a draft the checkpoint cannot run, naming the field."""
        if self.is_mtp and not getattr(hf_config, "num_nextn_predict_layers", 0):
            raise ValueError(
                f"speculative_config.method {self.method!r} needs a checkpoint with an MTP layer, but this one's "
                f"config has num_nextn_predict_layers={getattr(hf_config, 'num_nextn_predict_layers', None)!r} "
                "(DeepSeek-V3/R1 ship 1); use method 'ngram' for other models")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding

    def __post_init__(self) -> None:
        # Refused here, before any process starts, rather than by a layer on some rank.
        from deepserve.distributed.layout import check_pp_fits, check_tp_divides

        if self.parallel.tensor_parallel_size > 1:
            check_tp_divides(self.model.hf_config, self.parallel.tensor_parallel_size,
                             self.parallel.enable_expert_parallel)
        if self.parallel.pipeline_parallel_size > 1:
            check_pp_fits(self.model.hf_config, self.parallel.pipeline_parallel_size)


@dataclass
class EngineArgs:
    """Every knob of `LLM(...)` and `deepserve serve`, with vLLM's names and defaults."""

    model: str | None = None  # None: the built-in demo model
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    swap_space: float = 0.0
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    enable_expert_parallel: bool = False
    load_format: str = "auto"
    # None: follow the checkpoint (FP8 checkpoints are served in FP8); "fp8": also quantize an unquantized
    # checkpoint at load (per-channel weights, per-token activations); "awq" / "gptq": int4 weights (the
    # checkpoint's method; with dummy weights any model); "none": dequantize a quantized checkpoint.
    quantization: str | None = None
    # A checkpoint encrypted at rest (deepserve encrypt-model): the file with its key, 64 hex characters.
    # Every rank reads it (each node needs it at this path); weights are decrypted in memory only.
    decryption_key_file: str | None = None
    device: str = "auto"
    cpu_kv_cache_gib: float = 1.0
    # None: decode CUDA graphs in one process, eager ranks under tensor parallelism (graphs there are
    # correct on tiny checkpoints but unmeasured at W1 size; False asks for them); True: no graphs at all.
    enforce_eager: bool | None = None
    skip_tokenizer_init: bool = False  # token ids in and out, no text (benchmarks on model-shape presets)
    # None: on where it pays, a CUDA device in one process (the host's work then overlaps the GPU's).
    async_scheduling: bool | None = None
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    # vLLM's speculative_config: a dict or its JSON text, e.g. {"method": "ngram", "num_speculative_tokens": 4}
    speculative_config: dict[str, Any] | str | None = None
    # vLLM's flag, which DeepSeek's own vLLM snippets pass. It has no effect here: deepserve never runs a
    # checkpoint's remote code (modeling_*.py); its models are its own implementations. True is accepted
    # so those snippets run, and said once in the log.
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        # Checked here, naming the field, rather than failing later inside int() or a dict method.
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an integer, got {self.seed!r} (deepserve always seeds: vLLM's None, "
                            "no fixed seed, is not supported; leave it out for the default 0)")
        self.hf_overrides = json_object(self.hf_overrides, "hf_overrides (--hf-overrides)")
        if self.trust_remote_code:
            note_trust_remote_code()

    def _async_scheduling(self, device: str, speculative: bool = False) -> bool:
        one_process = self.tensor_parallel_size * self.pipeline_parallel_size == 1
        if speculative:
            # How many drafts a step accepts is known only once its tokens are on the host, and the next
            # step's inputs depend on it; asked for, it is said once in the log.
            if self.async_scheduling:
                import logging

                logging.getLogger(__name__).info("async scheduling is off under speculative decoding; the engine "
                                                 "schedules step by step")
            return False
        if self.async_scheduling is None:
            # On where it has been measured: one CUDA GPU. Under tensor parallelism it is opt-in.
            return device == "cuda" and one_process
        if self.async_scheduling and self.pipeline_parallel_size > 1:
            # Stages run one after another within a step; asked for, it is said once in the log.
            import logging

            logging.getLogger(__name__).info("async scheduling is not supported with pipeline parallelism; "
                                             "the engine schedules step by step")
            return False
        return self.async_scheduling

    def model_path(self) -> str:
        """The checkpoint folder or preset name; without a model, the built-in demo model (written on first use)."""
        return self.model or _demo_model_path()

    def create_engine_config(self) -> EngineConfig:
        from deepserve.host_memory import check_swap_space
        from deepserve.loader.hf_config import resolve_dtype, resolve_max_model_len
        from deepserve.loader.presets import is_preset, resolve_hf_config

        if self.swap_space > 0 and self.pipeline_parallel_size > 1:
            # Stages hold different layers, so one host block count does not fit them all; not built yet.
            raise ValueError("--swap-space (swap_space) is not supported with pipeline_parallel_size > 1 yet; "
                             "use --swap-space 0 (preempted requests then recompute)")

        check_swap_space(self.swap_space, max(1, self.tensor_parallel_size // max(1, self.nnodes)))
        if self.decryption_key_file and self.load_format != "dummy":
            from deepserve.loader.encryption import read_key_file

            # Read here as well as where the weights load (every rank): the server's process runs this while
            # the engine process starts, so a missing or malformed key is refused at once, in one line, instead
            # of by the engine after its start. The key itself is not kept.
            read_key_file(self.decryption_key_file)
        speculative = SpeculativeConfig.from_user(self.speculative_config)
        if speculative is not None and self.pipeline_parallel_size > 1:
            raise ValueError("speculative_config is not supported with pipeline_parallel_size > 1 yet")
        model = self.model_path()
        hf_config = resolve_hf_config(model, self.hf_overrides, self.load_format)
        if speculative is not None:
            speculative.check_model(hf_config)
        device = _resolve_device(self.device)
        max_model_len = resolve_max_model_len(hf_config, self.max_model_len)
        if self.load_format not in ("auto", "dummy", "safetensors"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        model_config = ModelConfig(
            model=model,
            # A shape preset has no tokenizer: it runs on token ids unless one is given.
            tokenizer=None if self.skip_tokenizer_init else self.tokenizer or (None if is_preset(model) else model),
            hf_config=hf_config,
            dtype=resolve_dtype(self.dtype, hf_config, device),
            max_model_len=max_model_len,
            seed=self.seed,
            load_format=self.load_format,
            device=device,
            enforce_eager=self.tensor_parallel_size > 1 if self.enforce_eager is None else self.enforce_eager,
            quantization=_resolve_quantization(hf_config, self.quantization, device, self.load_format == "dummy"),
            decryption_key_file=self.decryption_key_file,
        )
        if self.enforce_eager is False and self.tensor_parallel_size > 1:
            import logging

            logging.getLogger(__name__).warning(
                "enforce_eager=False: decode CUDA graphs on tensor-parallel ranks are experimental (correct on tiny "
                "checkpoints; a W1-sized run on 2 H200s once did not finish); leave enforce_eager unset for eager "
                "ranks")
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = DEFAULT_CHUNKED_TOKEN_BUDGET
            if not self.enable_chunked_prefill:
                budget = max(budget, max_model_len)
        return EngineConfig(
            model=model_config,
            cache=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=self.enable_prefix_caching,
                swap_space=self.swap_space,
                kv_cache_dtype=self.kv_cache_dtype,
                cpu_kv_cache_gib=self.cpu_kv_cache_gib,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                async_scheduling=self._async_scheduling(device, speculative is not None),
            ),
            parallel=ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size, self.nnodes,
                                    self.node_rank, self.master_addr, self.master_port,
                                    self.enable_expert_parallel),
            speculative=speculative,
        )


def json_object(value: Any, name: str) -> dict[str, Any]:
    """A setting that takes a dict or, as vLLM's flags do, its JSON text (hf_overrides, speculative_config);
    None or empty text is {}. Anything else is refused naming the setting."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} must be a JSON object / dict: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object (a dict or its JSON text), got {type(value).__name__}")
    return value


@functools.cache
def note_trust_remote_code() -> None:
    """Once per process, however many EngineArgs ask (the server builds its own as well)."""
    logging.getLogger(__name__).info(
        "trust_remote_code has no effect: deepserve never runs a checkpoint's remote code (its models are its own "
        "implementations)")


def _resolve_quantization(hf_config: Any, requested: str | None, device: str, dummy: bool = False) -> str | None:
    from deepserve.layers.quantization import SUPPORTED, resolve_quantization

    if requested not in (None, "", "none", *SUPPORTED):
        # "none" is valid too (a quantized checkpoint dequantized at load); the layer's own message omits it.
        raise ValueError(f"quantization (--quantization) {requested!r} is not supported; use one of "
                         f"{', '.join(SUPPORTED)}, or none (dequantize a quantized checkpoint to the model dtype), "
                         "or leave it unset to follow the checkpoint's quantization_config")
    capability, name = None, ""
    if device == "cuda":
        import torch

        capability, name = torch.cuda.get_device_capability(0), torch.cuda.get_device_name(0)
    return resolve_quantization(hf_config, requested, device, capability, name, without_checkpoint=dummy)


def _resolve_device(device: str) -> str:
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {device!r}")
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but this torch sees no CUDA GPU; use --device cpu")
    return device


def _demo_model_path() -> str:
    from deepserve.demo import ensure_demo_model

    return ensure_demo_model(envs.DEEPSERVE_DEMO_MODEL_DIR)
