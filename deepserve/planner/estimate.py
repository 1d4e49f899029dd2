"""The planner's arithmetic: per-GPU memory, KV tokens that fit, sequences that fit, the serve flags.

Budget per GPU = total × gpu_memory_utilization, as in ModelRunner._profile_gpu_blocks; the KV cache gets
what the weights and the activations of the profiling step leave of it. The CUDA context and the decode CUDA
graphs are not taken from it: the engine does not count them either (see _graphs).
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass, field

from deepserve.planner.advice import nodes_needed
from deepserve.planner.gpus import gpu_capability, gpu_memory_bytes
from deepserve.planner.shapes import ModelShape, model_shape, resolve_model

_DTYPES = {"auto": "auto", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
           "half": "float16", "float32": "float32", "fp32": "float32"}
INT4_METHODS = ("awq", "gptq")  # layers.quantization.INT4_METHODS (that module imports torch)
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_KV_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
DEFAULT_BATCHED_TOKENS = 8192  # the engine's chunked-prefill budget (config.DEFAULT_CHUNKED_TOKEN_BUDGET)

FORMULAS = {
    "weights": "parameters and buffers of this rank's layers × their bytes (engine classes on the meta device; "
               "FP8 weights 1 byte plus float32 scales; int4 0.5 byte plus fp16 scales and zeros per group)",
    "kv_bytes_per_token": "Σ over this stage's layers of their KV-cache spec's elements per token × KV dtype bytes: "
                          "MLA = kv_lora_rank + qk_rope_head_dim (latent, replicated on every TP rank); "
                          "MHA/GQA = 2 × kv_heads/TP (at least 1) × head_dim",
    "activations": "T × (4·hidden + attn_width + 2·ffn_width) × dtype bytes + max_num_seqs × vocab × 4, "
                   "T = min(max_num_batched_tokens, max_model_len); ffn_width per rank (MoE: (top_k + shared) "
                   "× expert width), attn_width = q + k + v columns per rank (MLA: q, latent and expanded k/v)",
    "cuda_graphs": "0 with --enforce-eager or tensor parallelism (its ranks run eager by default), "
                   "else max_num_seqs × (vocab × 4 + 8·hidden × dtype bytes + 4·⌈max_model_len/block_size⌉); "
                   "outside the budget, like the CUDA context: the engine captures the graphs after sizing "
                   "the KV cache, in the GPU memory × (1 − gpu_memory_utilization) left over",
    "kv_cache": "GPU memory × gpu_memory_utilization − weights − activations",
}


@dataclass(frozen=True)
class PlanRequest:
    model: str
    gpu: str = "h200"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_model_len: int | None = None
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    block_size: int = 16
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    quantization: str | None = None  # as --quantization: None follows the checkpoint (FP8 stays FP8)
    enable_expert_parallel: bool = False  # routed experts whole, split across the tensor-parallel ranks


@dataclass
class Plan:
    request: PlanRequest
    model: str
    architecture: str
    num_params: int
    gpu: str
    gpu_memory_bytes: int
    num_gpus: int
    dtype: str
    quantization: str | None  # resolved: "fp8" or None (the model dtype)
    kv_cache_dtype: str
    max_model_len: int
    weights_bytes: int          # per GPU (the binding pipeline stage)
    kv_bytes_per_token: int     # per GPU
    activation_bytes: int
    cuda_graph_bytes: int
    budget_bytes: int
    kv_cache_bytes: int         # may be negative: then nothing fits
    num_blocks: int
    kv_tokens: int
    max_sequences: int          # sequences of max_model_len that fit at once
    fits: bool
    serve_command: list[str]
    warnings: list[str] = field(default_factory=list)
    # The memory fits but serve refuses a setting of the serve command (said in warnings): the CLI exits 1
    # as when it does not fit, so a script gating a rollout on it does not go ahead.
    engine_refuses: bool = False
    # serve's refusal of --quantization awq / gptq on a checkpoint on disk that is not that int4 format (the
    # memory is the int4 build's: an int4 checkpoint of the model would be served instead); None otherwise
    checkpoint_mismatch: str | None = None
    # Why an FP8 checkpoint is planned dequantized (a GPU without FP8 tensor cores, where serve takes it only with
    # --quantization none, which the plan's command lines then carry); None otherwise
    fp8_dequantized: str | None = None
    advice: list[dict] = field(default_factory=list)
    formulas: dict[str, str] = field(default_factory=lambda: dict(FORMULAS))

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["request"] = dataclasses.asdict(self.request)
        out["serve_command_line"] = shlex.join(self.serve_command)
        return out


def plan(req: PlanRequest, *, advise: bool = True) -> Plan:
    _check(req)
    name, hf_config, is_preset = resolve_model(req.model)
    from deepserve.distributed.layout import check_tp_divides

    # names the flag and the sizes that fit; with expert parallelism the expert count must divide instead
    check_tp_divides(hf_config, req.tensor_parallel_size, req.enable_expert_parallel)
    dtype = _resolve_dtype(req.dtype, hf_config)
    kv_elem = _DTYPE_BYTES[dtype] if req.kv_cache_dtype == "auto" else _KV_BYTES[req.kv_cache_dtype]
    req, quantization, no_fp8 = _engine_quantization(req, hf_config)
    shape = model_shape(req.model, dtype, req.tensor_parallel_size, quantization, req.enable_expert_parallel)
    max_len = _max_model_len(req.max_model_len, shape)
    gpu_name, total = gpu_memory_bytes(req.gpu)
    budget = int(total * req.gpu_memory_utilization)
    act = _activations(shape, req, max_len, _DTYPE_BYTES[dtype])
    graphs = _graphs(shape, req, max_len, _DTYPE_BYTES[dtype], hf_config)
    # Each pipeline stage sizes its own cache; the stage with the fewest KV tokens decides.
    best = None
    for weights, kv_elems in _stages(shape, req.pipeline_parallel_size):
        kv_per_token = kv_elems * kv_elem
        free = budget - weights - act  # no graphs: see _graphs
        blocks = max(0, free) // (kv_per_token * req.block_size)
        if best is None or blocks < best[3]:
            best = (weights, kv_per_token, free, blocks)
    weights, kv_per_token, free, blocks = best
    load_peak = _load_peak(req, dtype, quantization, shape)
    if load_peak > budget:  # --quantization fp8 holds the unquantized weights until they are converted
        blocks = 0
    tokens = blocks * req.block_size
    # The engine takes auto / fp8: a 16-bit KV dtype that is the model's own is its "auto".
    same = _DTYPES.get(req.kv_cache_dtype) == dtype
    engine_req = dataclasses.replace(req, kv_cache_dtype="auto") if same else req
    result = Plan(
        request=req, model=name, architecture=shape.architecture, num_params=shape.num_params, gpu=gpu_name,
        gpu_memory_bytes=total, num_gpus=req.tensor_parallel_size * req.pipeline_parallel_size, dtype=dtype,
        quantization=quantization,
        kv_cache_dtype=req.kv_cache_dtype, max_model_len=max_len, weights_bytes=weights,
        kv_bytes_per_token=kv_per_token, activation_bytes=act, cuda_graph_bytes=graphs, budget_bytes=budget,
        kv_cache_bytes=free, num_blocks=blocks, kv_tokens=tokens, max_sequences=tokens // max_len,
        fits=tokens // max_len >= 1, serve_command=_serve_command(engine_req, name, max_len, is_preset),
    )
    result.checkpoint_mismatch = _checkpoint_mismatch(req, hf_config, is_preset)
    result.warnings = _engine_warnings(engine_req, max_len) + _load_refusals(shape, result.checkpoint_mismatch,
                                                                             is_preset)
    result.engine_refuses = bool(result.warnings)
    result.fp8_dequantized = no_fp8
    if load_peak > budget:
        result.warnings.append(
            f"--quantization fp8 loads the {dtype} weights first ({load_peak / 2**30:.1f} GiB per GPU, over the "
            f"{budget / 2**30:.1f} GiB budget) and converts them after loading: it does not fit while loading")
    if advise and not result.fits:
        from deepserve.planner.advice import advise as make_advice

        result.advice = make_advice(result)
    return result


def _engine_quantization(req: PlanRequest, hf_config) -> tuple[PlanRequest, str | None, str | None]:
    """(request, the engine's quantization, why FP8 fell back). The planner reads no weights: --quantization
    awq / gptq plans the model's int4 build (whether serve takes it for this checkpoint is
    _checkpoint_mismatch's question). An FP8 checkpoint left to its own quantization on a GPU without FP8 tensor
    cores, which serve refuses unless told --quantization none, is planned as that: dequantized, the flag in the
    serve line. An explicit --quantization fp8 there is refused, as serve refuses it."""
    from deepserve.layers.quantization import Fp8Unsupported, resolve_quantization

    capability = gpu_capability(req.gpu)
    try:
        return req, resolve_quantization(hf_config, req.quantization, "cuda", capability, req.gpu,
                                         without_checkpoint=True), None
    except Fp8Unsupported:
        if req.quantization:
            raise
        why = (f"{req.gpu} has no FP8 tensor cores (compute capability {capability[0]}.{capability[1]}): deepserve "
               "serve takes this FP8 checkpoint there only with --quantization none, so the plan is for its "
               "dequantized weights and its command lines pass that flag")
        return dataclasses.replace(req, quantization="none"), None, why


def _load_peak(req: PlanRequest, dtype: str, quantization: str | None, shape: ModelShape) -> int:
    """Weight bytes per GPU while loading: per-channel FP8 made at load (an unquantized checkpoint with
    --quantization fp8) first holds the whole stage in the model dtype; otherwise the final weights."""
    from deepserve.layers.quantization import checkpoint_block

    _, hf_config, _ = resolve_model(req.model)
    if quantization != "fp8" or checkpoint_block(hf_config) is not None:
        return 0
    unquantized = model_shape(req.model, dtype, req.tensor_parallel_size, None)
    return max(w for w, _ in _stages(unquantized, req.pipeline_parallel_size))


def _check(req: PlanRequest) -> None:
    if req.tensor_parallel_size < 1 or req.pipeline_parallel_size < 1:
        raise ValueError("--tensor-parallel-size and --pipeline-parallel-size must be >= 1")
    if not 0.0 < req.gpu_memory_utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {req.gpu_memory_utilization}")
    if req.kv_cache_dtype != "auto" and req.kv_cache_dtype not in _KV_BYTES:
        raise ValueError(f"--kv-cache-dtype must be auto or fp8 (bf16 / fp16 plan as auto on a model of that "
                         f"dtype), got {req.kv_cache_dtype!r}")
    if req.dtype not in _DTYPES:
        raise ValueError(f"--dtype must be one of auto, bfloat16, float16, float32; got {req.dtype!r}")
    if req.max_num_seqs < 1 or req.block_size < 1:
        raise ValueError("--max-num-seqs and --block-size must be >= 1")


def _resolve_dtype(dtype: str, hf_config) -> str:
    from deepserve.loader.hf_config import resolve_dtype

    return resolve_dtype(_DTYPES[dtype], hf_config, "cuda")  # the planner plans for GPUs


def _max_model_len(requested: int | None, shape: ModelShape) -> int:
    if requested is None:
        return shape.max_position_embeddings
    if not 1 <= requested <= shape.max_position_embeddings:
        raise ValueError(f"--max-model-len must be in 1..{shape.max_position_embeddings} (the model's "
                         f"max_position_embeddings), got {requested}")
    return requested


def _stages(shape: ModelShape, pp: int) -> list[tuple[int, int]]:
    n = len(shape.layer_weight_bytes)
    if pp > n:
        raise ValueError(f"--pipeline-parallel-size {pp} is larger than the model's {n} layers")
    sizes = [n // pp + (i < n % pp) for i in range(pp)]
    out, start = [], 0
    for i, size in enumerate(sizes):
        weights = sum(shape.layer_weight_bytes[start:start + size])
        weights += shape.first_stage_bytes * (i == 0) + shape.last_stage_bytes * (i == pp - 1)
        out.append((weights, sum(shape.layer_kv_elems[start:start + size])))
        start += size
    return out


def _activations(shape: ModelShape, req: PlanRequest, max_len: int, dtype_bytes: int) -> int:
    tokens = min(req.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS, max_len)
    per_token = 4 * shape.hidden_size + shape.attn_width + 2 * shape.ffn_width
    return tokens * per_token * dtype_bytes + req.max_num_seqs * shape.vocab_size * 4


def _graphs(shape: ModelShape, req: PlanRequest, max_len: int, dtype_bytes: int, hf_config) -> int:
    """The decode CUDA graphs' memory, an estimate shown beside the budget but not taken from it, to match
    the engine: ModelRunner._profile_gpu_blocks gives the KV cache total × gpu_memory_utilization minus the
    peak torch allocated in the profile step (plus the caching allocator's stranded bytes), and captures the
    graphs only after allocating the cache (initialize_cache), so they and the CUDA context (outside torch's
    allocator) both live in the (1 − gpu_memory_utilization) share (bench/RESULTS.md: "the graph pool, which
    start-up's KV sizing does not count"). Neither is measured here, so no fixed size is added for them."""
    from deepserve.models.registry import get_model_class

    # The engine runs tensor-parallel ranks eager unless asked otherwise (EngineArgs.enforce_eager).
    eager = req.enforce_eager or req.tensor_parallel_size > 1
    if eager or not getattr(get_model_class(hf_config), "supports_cuda_graphs", True):
        return 0
    block_table = 4 * -(-max_len // req.block_size)
    per_seq = shape.vocab_size * 4 + 8 * shape.hidden_size * dtype_bytes + block_table
    return req.max_num_seqs * per_seq


def _serve_command(req: PlanRequest, model: str, max_len: int, is_preset: bool) -> list[str]:
    cmd = ["deepserve", "serve", model]
    if req.tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(req.tensor_parallel_size)]
    if req.pipeline_parallel_size > 1:
        cmd += ["--pipeline-parallel-size", str(req.pipeline_parallel_size)]
    if req.enable_expert_parallel:
        cmd += ["--enable-expert-parallel"]
    nodes = nodes_needed(req.tensor_parallel_size * req.pipeline_parallel_size)
    if nodes > 1:  # node 0's command; node k runs the same with --node-rank k (README, docs/parallel.md)
        cmd += ["--nnodes", str(nodes), "--node-rank", "0", "--master-addr", "NODE0_ADDRESS", "--master-port", "29500"]
    cmd += ["--max-model-len", str(max_len), "--gpu-memory-utilization", f"{req.gpu_memory_utilization:g}",
            "--max-num-seqs", str(req.max_num_seqs)]
    if req.kv_cache_dtype != "auto":
        cmd += ["--kv-cache-dtype", req.kv_cache_dtype]
    if req.quantization:
        cmd += ["--quantization", req.quantization]
    if req.dtype != "auto":
        cmd += ["--dtype", _DTYPES[req.dtype]]
    if req.block_size != 16:
        cmd += ["--block-size", str(req.block_size)]
    if req.enforce_eager:
        cmd += ["--enforce-eager"]
    if is_preset:
        cmd += ["--load-format", "dummy"]  # a preset is a shape without weights
    return cmd


def _engine_warnings(req: PlanRequest, max_len: int) -> list[str]:
    """What serve's own config checks (deepserve.config, as EngineArgs builds them) refuse of the serve line:
    the memory plan may be right, the engine would not start."""
    from deepserve.config import DEFAULT_CHUNKED_TOKEN_BUDGET, CacheConfig, ParallelConfig, SchedulerConfig

    batched = req.max_num_batched_tokens or DEFAULT_CHUNKED_TOKEN_BUDGET
    warnings = []
    for build in (lambda: ParallelConfig(req.tensor_parallel_size, req.pipeline_parallel_size),
                  lambda: CacheConfig(block_size=req.block_size, gpu_memory_utilization=req.gpu_memory_utilization,
                                      kv_cache_dtype=req.kv_cache_dtype),
                  lambda: SchedulerConfig(max_num_seqs=req.max_num_seqs, max_num_batched_tokens=batched,
                                          max_model_len=max_len)):
        try:
            build()
        except ValueError as exc:
            warnings.append(f"this deepserve version refuses it at startup: {exc}")
    return warnings


def _load_refusals(shape: ModelShape, mismatch: str | None, is_preset: bool) -> list[str]:
    """What serve refuses while loading the weights. A preset's serve line loads dummy weights, which no
    loader slices, but the plan is for the model it describes: its checkpoint would be refused the same."""
    out = [f"deepserve serve refuses it while loading: {mismatch}"] if mismatch else []
    if shape.fp8_shard_problem:
        who = "this model's FP8 checkpoint is refused" if is_preset else "deepserve serve refuses it"
        out.append(f"{who} while loading at this tensor-parallel size: {shape.fp8_shard_problem}")
    return out


def _checkpoint_mismatch(req: PlanRequest, hf_config, is_preset: bool) -> str | None:
    """serve's refusal of --quantization awq / gptq that the checkpoint on disk does not ship: the same
    resolve_quantization, now reading the checkpoint as serve does (a preset's serve line loads dummy
    weights, which take any int4 build). None where serve takes it."""
    if is_preset or req.quantization not in INT4_METHODS:
        return None
    from deepserve.layers.quantization import resolve_quantization

    try:
        resolve_quantization(hf_config, req.quantization, "cuda", gpu_capability(req.gpu), req.gpu)
    except ValueError as exc:
        return str(exc)
    return None
