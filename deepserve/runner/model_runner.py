"""The model runner: the only owner of device tensors (DESIGN.md principle 4).

Each step: SchedulerOutput -> flat tensors -> model forward inside the forward context -> logits
of the sampling rows -> sampler -> token ids back on the host (the step's one device sync).
`launch` queues a step and `wait` collects its tokens, so the engine can schedule and launch the
next step while the device runs this one (async scheduling); `execute` is the two back to back.
"""

from __future__ import annotations

import functools
import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from deepserve import envs
from deepserve.compile_cache import configure_compile_caches, warn_if_imports_compile
from deepserve.compile_watch import WATCH as COMPILE_WATCH
from deepserve.config import EngineConfig
from deepserve.distributed import parallel_state as pdist
from deepserve.engine.request import Request, SchedulerOutput
from deepserve.forward_context import forward_context
from deepserve.layers.quantization import quantize_after_loading
from deepserve.layers.rejection_sampler import RejectionSampler
from deepserve.layers.sampler import Sampler, SamplingMetadata, compute_token_logprobs, warm_up_fused_sampler
from deepserve.layers.sampling_metadata import PenaltyHistory, bitmask_tensor
from deepserve.loader.checkpoint import init_dummy_weights
from deepserve.loader.model_loader import checkpoint_tensors, load_model
from deepserve.runner.cuda_graph import DecodeGraphs
from deepserve.runner.input_batch import StepInputs, prepare_inputs
from deepserve.runner.kv_swap import HostTier
from deepserve.runner.mtp_drafter import MtpDrafter

logger = logging.getLogger(__name__)
PROFILE_LOGPROBS = 20  # top logprobs per token the memory profile samples with (the server's limit)

LogprobEntry = list[tuple[int, float, int]]  # (token id, logprob, rank); the chosen token first


@dataclass
class RunnerOutput:
    # Aligned with SchedulerOutput.scheduled: each request's tokens in order (empty where the step only
    # prefilled), and their logprob entries (empty unless the request asked).
    sampled: list[list[int]]
    logprobs: list[list[LogprobEntry]] = field(default_factory=list)
    prompt_logprobs: dict[str, list[LogprobEntry]] = field(default_factory=dict)  # new prompt positions
    # Speculative decoding with the MTP draft: each request's drafts for its next step (None otherwise).
    draft_token_ids: list[list[int]] | None = None


@dataclass
class PendingStep:
    """A launched step: what it computes and where its results will be. The sampled tokens stay on
    the device (`sampled`, read by the next step's placeholders) and are copied to pinned host
    memory behind the step (`to_host`), so waiting for them does not wait for later steps."""

    out: SchedulerOutput
    sample_indices: list[int]
    requests: list[Request] = field(default_factory=list)  # of the sampling rows
    prompt_logprobs: list = field(default_factory=list)  # ModelRunner._prompt_logprob_tensors
    sampled: torch.Tensor | None = None  # [S] int64 on the device
    verify: bool = False  # speculative decoding: `sampled` holds each row's chosen token; _host[4] its acceptance
    hidden: torch.Tensor | None = None  # the main model's hidden states [T, E], kept for the MTP draft
    # DEEPSERVE_GRAMMAR_OVERLAP: (logits, metadata, the masks' future) of a sampling not queued yet
    # (ModelRunner.finish_launch queues it; `sampled` is None until then).
    sample_later: tuple[torch.Tensor, Any, Future] | None = None
    _host: list[torch.Tensor | None] = field(default_factory=list)
    _ready: torch.cuda.Event | None = None

    def to_host(self, tensors: list[torch.Tensor | None]) -> None:
        if not self.sampled.is_cuda:
            self._host = tensors
            return
        self._host = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(
            t, non_blocking=True) for t in tensors]
        self._ready = torch.cuda.Event()
        self._ready.record()

    def host_values(self) -> list[torch.Tensor | None]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host


def fill_placeholders(input_ids: torch.Tensor, previous_sampled: torch.Tensor) -> torch.Tensor:
    """input_ids [T] with each placeholder -(row + 1) replaced by previous_sampled[row], on the device: one
    Triton launch on CUDA (kernels/sampling.fill_placeholders), fill_placeholders_torch's six ops elsewhere."""
    if input_ids.is_cuda and input_ids.dtype == previous_sampled.dtype == torch.int64 and input_ids.dim() == 1 \
            and previous_sampled.dim() == 1 and previous_sampled.numel() and input_ids.is_contiguous():
        return _gpu_fill()(input_ids, previous_sampled.contiguous())
    return fill_placeholders_torch(input_ids, previous_sampled)


@functools.cache
def _gpu_fill():
    from deepserve.kernels.sampling import fill_placeholders as fill_on_gpu  # Triton: imported on first GPU use

    return fill_on_gpu


def fill_placeholders_torch(input_ids: torch.Tensor, previous_sampled: torch.Tensor) -> torch.Tensor:
    """fill_placeholders in torch ops (any device): the CPU path and the reference the GPU kernel is tested on."""
    rows = (-input_ids - 1).clamp_(0, previous_sampled.shape[0] - 1)
    return torch.where(input_ids < 0, previous_sampled[rows], input_ids)


def prefill_warmup_lengths(max_tokens: int, smallest: int = 16) -> list[int]:
    """Prefill lengths whose forwards compile what serving's prefill steps can meet besides the KV-sizing
    step's max_tokens (which that step runs): each power of two from `smallest` below max_tokens (the
    thresholds kernels choose tiles by are powers of two or fall between them), one less than each of
    those and than max_tokens, and 1. Triton compiles separate variants for integer arguments equal to 1
    and divisible by 16; an odd length keeps the token count and its multiples by an even top_k (the MoE's
    assignments) off that divisibility, which a power of two minus 8 would not."""
    lengths = [1] if max_tokens > 1 else []
    power = smallest
    while power < max_tokens:
        lengths += [power - 1, power]
        power *= 2
    if max_tokens > smallest:
        lengths.append(max_tokens - 1)
    return sorted(set(lengths))


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        if config.model.device == "cuda":  # before the first kernel compiles (every rank builds a runner)
            configure_compile_caches()
            warn_if_imports_compile()
            COMPILE_WATCH.install()  # counts compiles once the engine arms it (after start-up)
        self.config = config
        self.device = torch.device(config.model.device)
        self.dtype = getattr(torch, config.model.dtype)
        self.block_size = config.cache.block_size
        torch.manual_seed(config.model.seed)
        self.model = load_model(config.model, self.device, self.dtype, config.parallel.enable_expert_parallel)
        self.drafter: MtpDrafter | None = None
        if config.speculative is not None and config.speculative.is_mtp:
            self.drafter = self._load_mtp(config)
        self.vocab_size = config.model.hf_config.vocab_size
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()  # speculative decoding's verify steps
        # Penalties' token counts, kept between steps; a step samples at most max_num_seqs rows.
        self.penalty_history = PenaltyHistory(self.vocab_size, self.device, config.scheduler.max_num_seqs + 1)
        self.attention_layers = [m for m in self.model.modules() if hasattr(m, "kv_cache_spec")]
        # The cache keeps the model's dtype ("auto") or FP8 (each layer then reads its own scales).
        name = config.cache.cache_dtype_name
        self.kv_specs = [layer.kv_cache_spec(getattr(torch, name) if name else self.dtype)
                         for layer in self.attention_layers]
        self.host_tier: HostTier | None = None  # the host tier (--swap-space > 0)
        self.graphs: DecodeGraphs | None = None
        self._shared_sampled: torch.Tensor | None = None  # a TP worker's copy of rank 0's last sampled tokens

    def _load_mtp(self, config: EngineConfig) -> MtpDrafter:
        """Build the model's MTP module (before the KV cache specs are read: its layer gets a cache too)
        and fill its weights from the checkpoint (model.layers.{num_hidden_layers}.*), or dummy ones."""
        if not hasattr(self.model, "enable_mtp"):
            raise ValueError(f"speculative_config.method {config.speculative.method!r} needs a DeepSeek-V3/R1 "
                             f"checkpoint; {config.model.architecture} has no MTP layer")
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                mtp = self.model.enable_mtp()
        finally:
            torch.set_default_dtype(previous)
        if config.model.load_format == "dummy":
            init_dummy_weights(mtp, config.model.seed)
        else:
            loaded = self.model.load_mtp_weights(checkpoint_tensors(config.model))
            missing = sorted(set(dict(mtp.named_parameters())) - loaded)
            if missing:
                # The names a user can look for in the files when the layer is absent; deepserve's own
                # parameter names only when some of it is there.
                what = (f"holds no tensor named model.layers.{config.model.hf_config.num_hidden_layers}.*"
                        if not loaded else f"holds an incomplete MTP layer model.layers."
                        f"{config.model.hf_config.num_hidden_layers}.* (missing {len(missing)} of deepserve's "
                        f"parameters, e.g. {missing[:3]})")
                raise ValueError(
                    f"speculative_config.method {config.speculative.method!r}: the checkpoint {what} although "
                    f"its config says num_nextn_predict_layers={config.model.hf_config.num_nextn_predict_layers}"
                    "; use method 'ngram'")
        # As load_model does for the main model: `--quantization fp8` turns the module's linears to FP8 now,
        # int4 linears take the Hopper GEMV's tiled layout (without it the draft ran in the checkpoint's form).
        quantize_after_loading(mtp)
        mtp.eval()
        return MtpDrafter(self.model, config.speculative.num_speculative_tokens, self.block_size,
                          config.model.max_model_len, self.device)

    def kv_cache_bytes_per_block(self) -> int:
        return self.block_size * sum(spec.bytes_per_token for spec in self.kv_specs)

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        per_block = self.kv_cache_bytes_per_block()
        if self.device.type == "cpu":
            return max(1, int(cache.cpu_kv_cache_gib * 2**30) // per_block)
        return self._profile_gpu_blocks(per_block)

    def _profile_gpu_blocks(self, per_block: int) -> int:
        # Memory the cache may take = utilisation share of the card - what the model and the
        # largest step's activations took (measured by running that step on dummy blocks), and what the
        # caching allocator holds that no new segment can use (_stranded_bytes).
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        peak = torch.cuda.max_memory_allocated(self.device) + _stranded_bytes(self.device)
        _, total = torch.cuda.mem_get_info(self.device)
        available = total * self.config.cache.gpu_memory_utilization - peak
        num_blocks = int(available // per_block)
        # One sequence of max_model_len must fit; the engine refuses to start otherwise, with the values.
        needed_blocks = -(-self.config.model.max_model_len // self.block_size)
        if num_blocks < needed_blocks:
            raise ValueError(_out_of_memory_message(peak, total, per_block, needed_blocks, num_blocks,
                                                    self.config, self.block_size))
        return num_blocks

    def _profile_run(self) -> None:
        from deepserve.engine.request import ScheduledRequest
        from deepserve.sampling_params import SamplingParams

        num_tokens = min(self.config.scheduler.max_num_batched_tokens, self.config.model.max_model_len)
        blocks_needed = -(-num_tokens // self.block_size)
        self.allocate_kv_cache(blocks_needed)
        request = Request("profile", [0] * num_tokens, SamplingParams(max_tokens=1))
        request.block_ids = list(range(blocks_needed))
        self.execute(SchedulerOutput([ScheduledRequest(request, num_tokens, 0)]))
        if envs.DEEPSERVE_PREFILL_WARMUP:  # on the profile's blocks; every rank runs the same lengths
            self.warm_up_prefill(num_tokens)
        self.allocate_kv_cache(0)
        self.profile_sampling()
        torch.cuda.synchronize(self.device)

    def warm_up_prefill(self, max_tokens: int) -> list[int]:
        """One prefill forward per length of prefill_warmup_lengths(max_tokens), so the kernel variants
        those steps pick (the fused MoE's tiles by tokens per expert, Triton's integer specializations)
        compile at start-up instead of inside the first request that meets them (compile_watch counts
        the ones that still do). Needs a KV cache of ceil(max_tokens / block_size) blocks; returns the
        lengths run."""
        from deepserve.engine.request import ScheduledRequest
        from deepserve.sampling_params import SamplingParams

        lengths = prefill_warmup_lengths(max_tokens)
        for n in lengths:
            request = Request(f"warmup-{n}", [0] * n, SamplingParams(max_tokens=1))
            request.block_ids = list(range(-(-n // self.block_size)))
            self.execute(SchedulerOutput([ScheduledRequest(request, n, 0)]))
        return lengths

    def profile_sampling(self) -> int:
        """The largest step's sampling on dummy logits, so the memory profile counts its [rows, V] float32
        temporaries (256 rows of a 129k vocabulary are 132 MB each): every sequence slot sampling at once,
        k + 1 rows each under speculative decoding (the verify step's rows, as many as the token budget
        allows), with filters, a penalty and 20 logprobs on (the server's top_logprobs limit). The rows.
        Not counted yet: prompt logprobs, whose rows can reach max_num_batched_tokens x V float32."""
        from deepserve.sampling_params import SamplingParams

        sched = self.config.scheduler
        k = self.config.speculative.num_speculative_tokens if self.config.speculative is not None else 0
        rows = min(sched.max_num_seqs * (k + 1), max(sched.max_num_batched_tokens, sched.max_num_seqs))
        params = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, presence_penalty=0.5, logprobs=PROFILE_LOGPROBS)
        meta = SamplingMetadata.build([params] * rows, [[0]] * rows, [[0]] * rows, [frozenset()] * rows,
                                      self.vocab_size, self.device)
        logits = torch.zeros(rows, self.vocab_size, dtype=self.dtype, device=self.device)
        if k:
            self.rejection_sampler(logits, meta, torch.zeros(rows, dtype=torch.int64, device=self.device))
        else:
            self.sampler(logits, meta)
        warm_up_fused_sampler(logits)  # its variants compiled here, not in the first sampled step
        if logits.is_cuda:  # the placeholder fill's one variant, before the first async-scheduled step needs it
            fill_placeholders(torch.tensor([-1, 5], device=self.device), torch.zeros(1, dtype=torch.int64,
                                                                                      device=self.device))
        return rows

    def allocate_kv_cache(self, num_blocks: int) -> None:
        for layer in self.attention_layers:
            layer.kv_cache = None
        if num_blocks == 0:
            return
        for layer, spec in zip(self.attention_layers, self.kv_specs, strict=True):
            layer.kv_cache = spec.allocate(num_blocks, self.block_size, self.device)

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache and, on the GPU, capture the decode CUDA graphs over it."""
        self.allocate_kv_cache(num_blocks)
        if (self.device.type == "cuda" and not self.config.model.enforce_eager
                and getattr(self.model, "supports_cuda_graphs", True)):
            # The MTP draft reads the main model's hidden states, and its requests hold KV slots past
            # max_model_len (2 k at most: a verify step's drafts, then the draft's own chain).
            lookahead = 0 if self.drafter is None else 2 * self.drafter.k
            self.graphs = DecodeGraphs(self.model, self.config.scheduler.max_num_seqs,
                                       self.config.model.max_model_len, self.block_size, self.device,
                                       keep_hidden=self.drafter is not None, lookahead=lookahead)
            self.graphs.capture()

    def determine_num_host_blocks(self) -> int:
        """Blocks of the host tier: --swap-space GiB over the bytes of one block in every layer."""
        return int(self.config.cache.swap_space * 2**30) // self.kv_cache_bytes_per_block()

    def initialize_host_cache(self, num_host_blocks: int) -> None:
        self.host_tier = HostTier(self.kv_specs, num_host_blocks, self.block_size, self.device)

    def _swap_blocks(self, out: SchedulerOutput) -> None:
        """The step's host-tier copies (swap-outs and prefix stores, then swap-ins and prefix loads) and
        the forward stream's waits on them, queued before its forward (kv_swap.HostTier.run)."""
        if self.host_tier is not None:
            self.host_tier.run(out, [layer.kv_cache for layer in self.attention_layers])

    def release_graphs(self) -> None:
        """Drop the decode graphs (see DecodeGraphs.release); the runner then runs eager."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def _forward(self, out: SchedulerOutput, inputs: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits of the sampling rows [S, V] or None, hidden states [T, E] or None under a graph)."""
        if self.graphs is not None and self.graphs.can_run(inputs) and not _wants_prompt_logprobs(out):
            logits = self.graphs.run(inputs)  # [B, V], one row per sequence
            hidden = self.graphs.hidden() if self.drafter is not None else None  # the MTP draft's input
            if len(inputs.sample_indices) == logits.shape[0]:  # every decode row samples: no gather
                return logits, hidden
            return (logits[inputs.sample_rows] if inputs.sample_indices else None), hidden
        if pdist.get_pp_world_size() > 1:
            return self._forward_stage(inputs), None
        with forward_context(inputs.attn):
            hidden = self.model(inputs.input_ids, inputs.positions)  # [T, E]
        if not inputs.sample_indices:
            return None, hidden
        return self.model.compute_logits(hidden[inputs.sample_rows]), hidden  # [S, V]

    def _forward_stage(self, inputs: StepInputs) -> torch.Tensor | None:
        """This pipeline stage's part of the step: receive (hidden, residual) [T, E] each from the
        previous stage (same tp_rank), run this stage's layers, send them on; the last stage computes
        the sampling rows' logits [S, V] and its tp_rank 0 sends them to rank 0. Rank 0 returns the
        logits (None when nothing samples), every other rank None."""
        stage, pp = pdist.get_pp_rank(), pdist.get_pp_world_size()
        intermediate = None
        if stage > 0:
            shape = (int(inputs.input_ids.shape[0]), self.config.model.hf_config.hidden_size)
            intermediate = (pdist.pp_recv(shape, self.dtype, self.device, stage - 1),
                            pdist.pp_recv(shape, self.dtype, self.device, stage - 1))
        with forward_context(inputs.attn):
            out = self.model(inputs.input_ids, inputs.positions, intermediate)
        if stage < pp - 1:
            pdist.pp_send(out[0], stage + 1)
            pdist.pp_send(out[1], stage + 1)
        if not inputs.sample_indices:
            return None
        rows = len(inputs.sample_indices)
        if stage == pp - 1:
            logits = self.model.compute_logits(out[inputs.sample_rows]).float()  # [S, V]
            if pdist.get_tp_rank() == 0:
                torch.distributed.send(logits.contiguous(), 0)
            return None
        if torch.distributed.get_rank() == 0:
            logits = torch.empty((rows, self.vocab_size), dtype=torch.float32, device=self.device)
            torch.distributed.recv(logits, (pp - 1) * pdist.get_tp_world_size())
            return logits
        return None

    @torch.inference_mode()
    def execute_without_sampling(self, out: SchedulerOutput, share_sampled: bool = False) -> None:
        """What a tensor-parallel worker runs each step: every collective rank 0's `launch` runs, in
        the same order (forward, LM head over the sampling rows, prompt-logprob rows, and under async
        scheduling the broadcast of the sampled tokens), without the sampler. Under async scheduling
        this step's placeholder inputs are the tokens rank 0 broadcast the step before."""
        self._swap_blocks(out)  # in this rank's own cache shard
        inputs = prepare_inputs(out, self.block_size, self.device)
        if inputs.has_placeholders:
            inputs.input_ids = fill_placeholders(inputs.input_ids, self._shared_sampled)
        _, hidden = self._forward(out, inputs)
        if hidden is not None:
            self._prompt_logprob_tensors(out, hidden)
        if share_sampled and inputs.sample_indices:
            self._shared_sampled = torch.empty(len(inputs.sample_indices), dtype=torch.int64, device=self.device)
            pdist.tp_broadcast_from_first(self._shared_sampled)
        if self.drafter is not None:  # the draft's forward, on the tokens rank 0 kept (its drafts go unused here)
            self.drafter.propose(out, hidden, self._share_kept_tokens(out, None))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return self.wait(self.launch(out))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, previous: PendingStep | None = None,
               share_sampled: bool = False) -> PendingStep:
        """Queue the step on the device and return without waiting for it. `previous` is the step
        launched before, whose sampled tokens this step's placeholder inputs read on the device
        (async scheduling, Request.append_placeholder); `share_sampled` (tensor parallelism) also
        broadcasts this step's sampled tokens to the other ranks, for their next step's placeholders."""
        self.finish_launch(previous)  # its tokens are this step's placeholders: its sampling comes first
        self._swap_blocks(out)
        inputs = prepare_inputs(out, self.block_size, self.device)
        if inputs.has_placeholders:
            if previous is None or previous.sampled is None:
                raise RuntimeError("a step reads tokens of a previous step that was not launched with it")
            inputs.input_ids = fill_placeholders(inputs.input_ids, previous.sampled)
        logits, hidden = self._forward(out, inputs)
        pending = PendingStep(out, inputs.sample_indices)
        if self.drafter is not None:
            pending.hidden = hidden
        if logits is not None and out.num_draft_tokens:
            self._verify(out, inputs, logits, pending)
        elif logits is not None:
            pending.requests = [out.scheduled[i].request for i in inputs.sample_indices]
            # Structured output: the rows' masks, in row order, computed now, while the device runs the
            # forward queued above (EngineCore attaches the function). A future (DEEPSERVE_GRAMMAR_OVERLAP)
            # leaves the sampling to finish_launch, so the engine's host work runs beside the fill; under
            # tensor parallelism (share_sampled) the tokens are broadcast here, so it is awaited now.
            masks = out.grammar_bitmask() if out.grammar_bitmask is not None else None
            later = isinstance(masks, Future)
            if later and share_sampled:
                masks, later = masks.result(), False
            meta = SamplingMetadata.build(
                [r.sampling_params for r in pending.requests],
                [r.prompt_token_ids for r in pending.requests],
                [r.output_token_ids for r in pending.requests],
                [r.eos_token_ids for r in pending.requests],
                self.vocab_size,
                self.device,
                [r.serial for r in pending.requests],
                self.penalty_history,
                None if later else masks,
            )
            if later:
                pending.sample_later = (logits, meta, masks)
            else:
                self._sample(pending, logits, meta)
        # Prompt logprobs are computed here, in the order the workers run their collectives (their
        # logits are all-gathered), and read on the host in wait.
        if hidden is not None:
            pending.prompt_logprobs = self._prompt_logprob_tensors(out, hidden)
        if share_sampled and pending.sampled is not None:
            pdist.tp_broadcast_from_first(pending.sampled)
        return pending

    def _sample(self, pending: PendingStep, logits: torch.Tensor, meta: SamplingMetadata) -> None:
        result = self.sampler(logits, meta)  # the model dtype: each sampling path reads it as fp32
        pending.sampled = result.sampled
        pending.to_host([result.sampled, result.logprob_token_ids, result.logprobs, result.ranks])

    def finish_launch(self, pending: PendingStep | None) -> None:
        """Queue the sampling that launch left waiting for its masks (DEEPSERVE_GRAMMAR_OVERLAP); nothing
        for any other step (checked before inference mode is entered: this runs twice a step). wait() and
        the next launch call it too, so a caller that never does still gets the step's tokens."""
        if pending is not None and pending.sample_later is not None:
            self._sample_later(pending)

    @torch.inference_mode()
    def _sample_later(self, pending: PendingStep) -> None:
        logits, meta, masks = pending.sample_later
        pending.sample_later = None
        meta.allowed_token_bitmask = bitmask_tensor(masks.result(), len(pending.requests), self.vocab_size,
                                                    self.device)
        self._sample(pending, logits, meta)

    def _verify(self, out: SchedulerOutput, inputs: StepInputs, logits: torch.Tensor, pending: PendingStep) -> None:
        """Speculative decoding: sample every row of a verify step against its draft (RejectionSampler).
        Row j of a request sees its output followed by drafts 0 .. j - 1, as the plain sampler would
        have seen them had they been sampled one step at a time (penalties, min_tokens, seeds)."""
        requests, outputs, drafts, row_request, before = [], [], [], [], []
        unique: list[Request] = []  # the step's requests, once each, in row order
        j, previous = 0, -1
        for i in inputs.sample_indices:
            sched = out.scheduled[i]
            j = j + 1 if i == previous else 0
            if j == 0:
                unique.append(sched.request)
            previous = i
            spec = sched.spec_token_ids
            requests.append(sched.request)
            outputs.append(sched.request.output_token_ids + spec[:j] if j else sched.request.output_token_ids)
            drafts.append(spec[j] if j < len(spec) else -1)
            row_request.append(len(unique) - 1)
            before.append(spec[:j])
        params = [r.sampling_params for r in requests]
        meta = SamplingMetadata.build(
            params, [r.prompt_token_ids for r in requests], outputs,
            [r.eos_token_ids for r in requests], self.vocab_size, self.device, penalties=False,
        )
        if any(p.has_penalties for p in params):  # the kept history, plus each row's earlier drafts
            meta.set_verify_penalties([r.sampling_params for r in unique], [r.serial for r in unique],
                                      [r.prompt_token_ids for r in unique], [r.output_token_ids for r in unique],
                                      self.penalty_history, row_request, before)
        draft_ids = torch.tensor(drafts, dtype=torch.int64).to(self.device, non_blocking=True)
        result = self.rejection_sampler(logits, meta, draft_ids)
        pending.requests, pending.sampled, pending.verify = requests, result.chosen, True
        pending.to_host([result.chosen, result.logprob_token_ids, result.logprobs, result.ranks, result.accepted])

    @torch.inference_mode()
    def wait(self, pending: PendingStep) -> RunnerOutput:
        """The step's tokens on the host (its one device -> host sync, which waits for this step only,
        not for a step launched after it)."""
        self.finish_launch(pending)
        out = pending.out
        sampled: list[list[int]] = [[] for _ in out.scheduled]
        logprobs: list[list[LogprobEntry]] = [[] for _ in out.scheduled]
        if pending.verify:
            _take_verified(pending, sampled, logprobs)
        elif pending.sampled is not None:
            host = pending.host_values()
            tokens = host[0].tolist()
            for row, i in enumerate(pending.sample_indices):  # one sampling row per sampled token
                sampled[i].append(tokens[row])
            if host[2] is not None:
                _attach_logprobs(host[1:], pending.requests, pending.sample_indices, logprobs)
        prompt_logprobs = {request_id: _entries(ids.tolist(), lps.tolist(), ranks.tolist(), k)
                           for request_id, k, ids, lps, ranks in pending.prompt_logprobs}
        drafts = None
        if self.drafter is not None:
            if pdist.get_tp_world_size() > 1:
                self._share_kept_tokens(out, sampled)
            drafts = self.drafter.propose(out, pending.hidden, sampled)
        return RunnerOutput(sampled, logprobs, prompt_logprobs, drafts)

    def _share_kept_tokens(self, out: SchedulerOutput, sampled: list[list[int]] | None) -> list[list[int]]:
        """Tensor parallelism with the MTP draft: every rank runs the draft's forward (its all-reduces), over
        the tokens the step kept, which only rank 0 knows (it sampled and verified them). One broadcast from
        rank 0 (`sampled`; the others pass None): per request its count, then a slot of num_sampled tokens,
        the most a step keeps, so every rank knows the size from the step itself."""
        slots = [s.num_sampled for s in out.scheduled]
        if sampled is not None:  # rank 0: counts, then each request's tokens padded to its slot
            flat = [len(tokens) for tokens in sampled]
            for tokens, slot in zip(sampled, slots, strict=True):
                flat += tokens + [0] * (slot - len(tokens))
            pdist.tp_broadcast_from_first(torch.tensor(flat, dtype=torch.int64).to(self.device))
            return sampled
        shared = torch.zeros(len(slots) + sum(slots), dtype=torch.int64, device=self.device)
        pdist.tp_broadcast_from_first(shared)
        values, kept, at = shared.tolist(), [], len(slots)
        for i, slot in enumerate(slots):
            kept.append(values[at: at + values[i]])
            at += slot
        return kept

    def _prompt_logprob_tensors(self, out: SchedulerOutput, hidden: torch.Tensor
                                ) -> list[tuple[str, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Logprobs of prompt tokens 1..P-1 from the positions this step computed, on the device:
        (request id, k, token ids [n, k+1], logprobs [n, k+1], ranks [n]) per request that asked."""
        result = []
        row_start = 0
        for sched in out.scheduled:
            request, k = sched.request, sched.request.sampling_params.prompt_logprobs
            first_row = row_start
            row_start += sched.num_new_tokens
            if k is None:
                continue
            # Position p predicts prompt token p + 1; request.prompt_logprobs holds positions done
            # (a recompute after preemption does not report them again).
            lo = max(sched.start, len(request.prompt_logprobs))
            hi = min(sched.start + sched.num_new_tokens, request.num_prompt_tokens - 1)
            if lo >= hi:
                continue
            rows = hidden[first_row + lo - sched.start : first_row + hi - sched.start]
            targets = torch.tensor(request.prompt_token_ids[lo + 1 : hi + 1]).to(hidden.device, non_blocking=True)
            result.append((request.request_id, k, *self._token_logprobs_in_slices(rows, targets, k)))
        return result

    def _token_logprobs_in_slices(self, rows: torch.Tensor, targets: torch.Tensor, k: int
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """compute_token_logprobs over the logits of `rows`, PROMPT_LOGPROB_ROWS at a time: a whole prefill chunk's
        float32 logits (8,192 rows x a 129,280 vocabulary: 4.2 GB, and log_softmax as much again) are not in the
        memory profile, and a client asks for them with prompt_logprobs or echo. The slices depend on shapes
        only, so tensor-parallel ranks run the LM head's all-gather in the same order."""
        parts = [compute_token_logprobs(self.model.compute_logits(rows[i:i + PROMPT_LOGPROB_ROWS]).float(),
                                        targets[i:i + PROMPT_LOGPROB_ROWS], k)
                 for i in range(0, rows.shape[0], PROMPT_LOGPROB_ROWS)]
        return tuple(torch.cat(pieces) for pieces in zip(*parts, strict=True))


PROMPT_LOGPROB_ROWS = 512  # prompt positions whose logits are made at once (_token_logprobs_in_slices)


def _stranded_bytes(device: torch.device) -> int:
    """Memory the caching allocator keeps after empty_cache without a tensor in it: free pieces of segments
    that still hold one (weights replaced after loading leave them). The KV cache's large tensors need new
    segments, so these bytes are not theirs; the peak of allocated memory does not count them. Logged when
    large, since they shrink the cache."""
    torch.cuda.empty_cache()
    stranded = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if stranded > 2**30:
        logger.warning("KV cache sizing: %.1f GiB reserved by the caching allocator outside any tensor "
                       "(fragmentation) is left out of the cache", stranded / 2**30)
    return stranded


def _out_of_memory_message(peak: int, total: int, per_block: int, needed_blocks: int, num_blocks: int,
                           config: EngineConfig, block_size: int) -> str:
    """What does not fit, and the values of the flags that would make it fit."""
    gib = 2**30
    fits_len = max(0, num_blocks) * block_size
    util_needed = (peak + needed_blocks * per_block) / total
    advice = [f"lower --max-model-len to {fits_len}" if fits_len > 0 else None,
              f"raise --gpu-memory-utilization to {util_needed:.2f}" if util_needed <= 0.98 else None,
              "use more GPUs (--tensor-parallel-size)"]
    return (
        f"the KV cache does not fit: the weights and the largest step's activations take {peak / gib:.1f} GiB "
        f"of the {config.cache.gpu_memory_utilization:.2f} x {total / gib:.1f} GiB allowed, leaving room for "
        f"{max(0, num_blocks) * block_size} tokens of KV cache, and one sequence of --max-model-len "
        f"{config.model.max_model_len} needs {needed_blocks * per_block / gib:.2f} GiB; "
        + ", or ".join(a for a in advice if a)
        + " (deepserve plan MODEL shows the whole budget)"
    )


def _wants_prompt_logprobs(out: SchedulerOutput) -> bool:
    return any(s.request.sampling_params.prompt_logprobs is not None and s.start < s.request.num_prompt_tokens - 1
               for s in out.scheduled)


def _take_verified(pending: PendingStep, sampled: list[list[int]], logprobs: list) -> None:
    """Each request's tokens of a verify step: its rows' chosen tokens up to and including the first row
    whose draft was rejected (the last row has none), with their logprob entries when asked."""
    host = pending.host_values()
    tokens, accepted = host[0].tolist(), host[4].tolist()
    wanted = host[2] is not None
    if wanted:
        ids, lps, ranks = (t.tolist() for t in host[1:4])
    done: set[int] = set()
    for row, (request, i) in enumerate(zip(pending.requests, pending.sample_indices, strict=True)):
        if i in done:
            continue
        sampled[i].append(tokens[row])
        k = request.sampling_params.logprobs
        if wanted and k is not None:
            logprobs[i].append(_entries([ids[row]], [lps[row]], [ranks[row]], k)[0])
        if not accepted[row]:
            done.add(i)


def _attach_logprobs(host: list[torch.Tensor], requests: list[Request], indices: list[int], logprobs: list) -> None:
    ids, lps, ranks = (t.tolist() for t in host)
    for row, (request, i) in enumerate(zip(requests, indices, strict=True)):
        k = request.sampling_params.logprobs
        if k is not None:
            logprobs[i].append(_entries([ids[row]], [lps[row]], [ranks[row]], k)[0])


def _entries(ids: list[list[int]], lps: list[list[float]], ranks: list[int], k: int) -> list[LogprobEntry]:
    """Per row: the chosen token with its rank, then the top-k tokens with ranks 1..k."""
    out = []
    for row_ids, row_lps, rank in zip(ids, lps, ranks, strict=True):
        entry = [(row_ids[0], row_lps[0], rank)]
        entry += [(row_ids[j], row_lps[j], j) for j in range(1, k + 1)]
        out.append(entry)
    return out
