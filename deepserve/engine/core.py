"""EngineCore: scheduler + model runner, speaking token ids only.

`step()` is three calls — schedule, execute, update — with outputs built around them
(DESIGN.md principle 2). Text, stop strings and n > 1 aggregation belong to the front end
(processors.py), which runs in the caller's process or in the API server.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from deepserve import envs
from deepserve.compile_watch import WATCH as COMPILE_WATCH
from deepserve.config import EngineArgs, EngineConfig
from deepserve.engine.block_manager import BlockManager
from deepserve.engine.grammar import (
    GrammarCompiler,
    GrammarTiming,
    fill_bitmasks,
    fill_bitmasks_beside,
    grammar_warmup_enabled,
    mask_row_bytes,
)
from deepserve.engine.ngram_proposer import ModelDrafts, NgramProposer
from deepserve.engine.request import Request, RequestStatus, SchedulerOutput
from deepserve.engine.scheduler import Scheduler, SchedulerStats
from deepserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepserve.layers.sampling_metadata import MaskSlot
    from deepserve.runner.model_runner import RunnerOutput

logger = logging.getLogger(__name__)

LogprobEntry = list[tuple[int, float, int]]


class Runner(Protocol):
    def determine_num_blocks(self) -> int: ...
    def initialize_cache(self, num_blocks: int) -> None: ...
    # The host tier; called only when swap_space > 0.
    def determine_num_host_blocks(self) -> int: ...
    def initialize_host_cache(self, num_host_blocks: int) -> None: ...
    def execute(self, out: SchedulerOutput) -> RunnerOutput: ...
    # Async scheduling: execute split in two, the launch not waiting for the device.
    def launch(self, out: SchedulerOutput, previous: Any = None) -> Any: ...
    def wait(self, pending: Any) -> RunnerOutput: ...
    # DEEPSERVE_GRAMMAR_OVERLAP: queue the sampling a launch left waiting for its masks (a no-op otherwise).
    def finish_launch(self, pending: Any) -> None: ...


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    wait_for: str | None = None  # sibling whose prompt is computed first (n > 1)

    def to_dict(self) -> dict[str, Any]:
        # Shallow, as core_process.encode packs it at once: asdict would deep-copy every prompt token.
        d = dict(vars(self))
        d["sampling_params"] = params = asdict(self.sampling_params)
        if params["logit_bias"] is not None:  # pairs: a msgpack map with integer keys does not unpack
            params["logit_bias"] = list(params["logit_bias"].items())
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineCoreRequest:
        return cls(**{**d, "sampling_params": SamplingParams(**d["sampling_params"])})


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[LogprobEntry] | None = None  # one entry per new token
    prompt_logprobs: list[LogprobEntry] | None = None  # entries for prompt tokens newly computed
    num_cached_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        # Shallow (vars): asdict's deep copy cost 8-13 ms a step for 256 outputs (bench/api_host_cost.py).
        return dict(vars(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineCoreOutput:
        out = cls(**d)
        # msgpack turns tuples into lists; give the entries back their tuple shape
        if out.new_logprobs is not None:
            out.new_logprobs = [[tuple(t) for t in e] for e in out.new_logprobs]
        if out.prompt_logprobs is not None:
            out.prompt_logprobs = [[tuple(t) for t in e] for e in out.prompt_logprobs]
        return out


class EngineCore:
    def __init__(self, config: EngineConfig, runner: Runner, load_s: float | None = None,
                 process_age_s: float | None = None, grammar_warmup_s: float | None = None) -> None:
        self.config = config
        self.runner = runner
        # Where start-up goes (seconds): structured output's warm-up and building the model and its
        # weights (when from_config timed them), sizing the KV cache (a profile step on the GPU),
        # allocating it and capturing the decode CUDA graphs; and what came before them. Logged, and read
        # by the benchmarks.
        self.startup_s: dict[str, float] = {} if grammar_warmup_s is None else {"grammar_warmup": grammar_warmup_s}
        if load_s is not None:
            self.startup_s["load"] = load_s
        start = time.perf_counter()
        logger.info("sizing the KV cache (a profile step; the first run of each kernel compiles it)")
        self.num_blocks = runner.determine_num_blocks()
        _check_cache_fits(config, self.num_blocks)
        sized = time.perf_counter()
        runner.initialize_cache(self.num_blocks)
        self.startup_s.update(kv_cache_sizing=sized - start, kv_cache_and_graphs=time.perf_counter() - sized)
        if process_age_s is not None:  # the process's age when loading began (interpreter, imports, config;
            self.startup_s["process_age_at_load"] = process_age_s  # in a long-lived process, all of its life)
        logger.info("start-up: %s", ", ".join(f"{k} {v:.1f} s" for k, v in self.startup_s.items()))
        num_host_blocks = 0
        if config.cache.swap_space > 0:
            num_host_blocks = runner.determine_num_host_blocks()
            host_start = time.perf_counter()
            runner.initialize_host_cache(num_host_blocks)
            self.startup_s["host_tier"] = time.perf_counter() - host_start
            logger.info("host KV tier (--swap-space %s GiB): %d blocks, its first chunk allocated in %.1f s, the "
                        "rest in the background; a preempted request moves there when it fits, else it "
                        "recomputes%s", config.cache.swap_space, num_host_blocks, self.startup_s["host_tier"],
                        "; prefix blocks evicted from the GPU are kept there" if config.cache.enable_prefix_caching
                        else "")
        block_manager = BlockManager(self.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                     num_host_blocks)
        self.scheduler = Scheduler(config.scheduler, block_manager, _proposer(config))
        self._spec_log = SpecDecodeLog() if config.speculative is not None else None
        logger.info("KV cache: %d blocks of %d tokens = %s tokens (kv_cache_dtype %s)", self.num_blocks,
                    config.cache.block_size, f"{self.num_blocks * config.cache.block_size:,}",
                    config.cache.kv_cache_dtype)
        self.async_scheduling = config.scheduler.async_scheduling
        self.inflight: Any = None  # async: the launched step whose tokens the host has not read yet
        # async + grammar: the in-flight step's result, read early inside the next step's launch
        self._inflight_result: RunnerOutput | None = None
        # Host time of structured output's masks (the benchmarks read it: where a constrained run's time goes)
        self.grammar_timing = GrammarTiming()
        self.num_steps = 0  # calls of step(), for per-step figures in the benchmarks
        self.grammars: GrammarCompiler | None = None  # built at the first structured-output request
        # Requests whose grammar is compiling on a side thread (a grammar not seen before): admitted to the
        # scheduler once it is ready, so a slow compile never holds up the step loop and the other requests.
        self._compiling: list[tuple[Request, Future]] = []
        self._compile_pool: ThreadPoolExecutor | None = None
        # Async + DEEPSERVE_GRAMMAR_OVERLAP: a step's masks fill on a thread of their own while the main
        # thread collects the step before (_step_async); off (no gain on the H200, bench/RESULTS.md).
        self.grammar_overlap = self.async_scheduling and envs.DEEPSERVE_GRAMMAR_OVERLAP
        self._mask_pool: ThreadPoolExecutor | None = None
        self._mask_buffers = self._pinned_mask_buffers() if envs.DEEPSERVE_PINNED_GRAMMAR_MASKS else None
        self._filling: Future | None = None  # the fill of the step being launched (join time, GrammarTiming)
        logger.info("async scheduling %s", "on" if self.async_scheduling else "off (steps run one at a time)")
        COMPILE_WATCH.arm()  # start-up is over: a kernel compiled from here on stalls a serving step

    @classmethod
    def from_engine_args(cls, args: EngineArgs, warm_grammars: bool = False) -> EngineCore:
        return cls.from_config(args.create_engine_config(), warm_grammars=warm_grammars)

    @classmethod
    def from_config(cls, config: EngineConfig, grammars: GrammarCompiler | None = None,
                    warm_grammars: bool = False) -> EngineCore:
        """Structured output's compiler is warmed first, before the model loads (GrammarCompiler.warm_up says
        why): `grammars`, the one a front end in this process shares with the core, or with warm_grammars
        (the core runs in a process of its own) one this core builds from its tokenizer."""
        # The one place the torch-free engine reaches for the runner, lazily, at construction.
        from deepserve.runner.model_runner import ModelRunner

        age = _process_age_s()  # the interpreter, imports and the config: before any of the engine's work
        start = time.perf_counter()
        if warm_grammars:
            grammars = _warm_grammar_compiler(config)
        elif grammars is not None:
            grammars.warm_up()
        warmed = time.perf_counter()
        m = config.model
        logger.info("loading %s (%s, %s weights%s) on %s", m.model, m.dtype,
                    "random" if m.load_format == "dummy" else "checkpoint",
                    f", {m.quantization}" if m.quantization else "", m.device)
        if config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size > 1:
            from deepserve.runner.executor import MultiprocExecutor

            runner: Runner = MultiprocExecutor(config)
        else:
            runner = ModelRunner(config)
        core = cls(config, runner, load_s=time.perf_counter() - warmed, process_age_s=age,
                   grammar_warmup_s=warmed - start if grammars is not None or warm_grammars else None)
        core.grammars = grammars
        return core

    def add_request(self, req: EngineCoreRequest) -> None:
        wait_for = self.scheduler.requests.get(req.wait_for) if req.wait_for else None
        request = Request(
            req.request_id, req.prompt_token_ids, req.sampling_params,
            frozenset(req.eos_token_ids), req.arrival_time, wait_for,
        )
        so = req.sampling_params.structured_outputs
        if so is not None:
            compiler = self._grammar_compiler()
            request.grammar = compiler.cached(so)
            if request.grammar is None:
                if self._compile_pool is None:
                    self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="deepserve-grammar")
                self._compiling.append((request, self._compile_pool.submit(compiler.compile, so)))
                return
        self.scheduler.add_request(request)

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Move requests whose grammar finished compiling to the scheduler; one that failed ends (the front
        end validated it, so this is unexpected) with an abort output. Waits a little when nothing else
        could run, instead of spinning."""
        if not self.scheduler.has_unfinished_requests() and self.inflight is None:
            wait([f for _, f in self._compiling], timeout=0.05, return_when=FIRST_COMPLETED)
        outputs, still = [], []
        for request, future in self._compiling:
            if not future.done():
                still.append((request, future))
            elif future.exception() is not None:
                logger.warning("request %s: its grammar failed to compile: %s", request.request_id,
                               future.exception())
                outputs.append(EngineCoreOutput(request.request_id, finish_reason="abort"))
            else:
                request.grammar = future.result()
                self.scheduler.add_request(request)
        self._compiling = still
        return outputs

    def _grammar_compiler(self) -> GrammarCompiler:
        if self.grammars is None:
            if self.config.model.tokenizer is None:
                raise ValueError("structured_outputs needs a tokenizer; this engine runs with skip_tokenizer_init")
            self.grammars = _load_grammar_compiler(self.config)
        return self.grammars

    def abort_requests(self, request_ids: list[str]) -> None:
        if self._compiling:
            ids = set(request_ids)
            self._compiling = [(r, f) for r, f in self._compiling if r.request_id not in ids]
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.inflight is not None or bool(self._compiling)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def reset_prefix_cache(self) -> bool:
        """BlockManager.reset_prefix_cache, between requests only: False while any is unfinished."""
        return not self.has_unfinished_requests() and self.scheduler.block_manager.reset_prefix_cache()

    def kernel_compiles(self) -> dict[str, Any]:
        """Kernel compiles in this process since start-up ended (compile_watch; under tensor parallelism
        the workers' own are not counted)."""
        return COMPILE_WATCH.snapshot()

    def step(self) -> list[EngineCoreOutput]:
        self.num_steps += 1
        failed = self._admit_compiled() if self._compiling else []
        return failed + self._step()

    def _step(self) -> list[EngineCoreOutput]:
        # A request whose sampling reads its earlier tokens (penalties) needs them real, not
        # placeholders (SamplingParams.needs_known_tokens): while there is one, steps run one at a time.
        # A grammar's mask for step n+1 also depends on step n's token, but only on the host and only
        # at sampling: it is built inside n+1's launch, after n+1's forward is queued
        # (_attach_grammar_bitmask), so constrained requests keep async scheduling.
        if self.async_scheduling and not self.scheduler.num_needing_known_tokens:
            return self._step_async()
        outputs = self._finish_inflight()
        if outputs:
            return outputs
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty():
            return []
        self._attach_grammar_bitmask(scheduled)
        result = self.runner.execute(scheduled)
        self.scheduler.update_from_output(scheduled, result.sampled, draft_token_ids=result.draft_token_ids)
        if self._spec_log is not None:
            self._spec_log.maybe_log(self.scheduler.stats())
        return _outputs(scheduled, result)

    def _step_async(self) -> list[EngineCoreOutput]:
        """Schedule and launch step n+1, then collect step n while the device runs n+1: the host's
        share of a step (scheduling, input preparation, bookkeeping) overlaps the device's work
        instead of following it. Returns step n's outputs. A request that step n finishes (EOS, a
        stop token) has already been given a row in step n+1; that row's token is dropped."""
        scheduled = self.scheduler.schedule()
        launched = None
        if not scheduled.is_empty():
            self._attach_grammar_bitmask(scheduled)
            launched = self.runner.launch(scheduled, self.inflight)
            # After the launch: the sampler saw the request as the step-by-step engine would (its
            # output count decides min_tokens and a seeded row's noise).
            self.scheduler.commit(scheduled)
        try:
            outputs = self._finish_inflight()
        finally:
            if self._filling is not None:
                # The masks of the step just launched filled on their thread while step n was collected
                # above (joined even when that raised: no fill is left running); its sampling is queued
                # now, before step n + 2's forward, which reads its tokens.
                joining = time.perf_counter()
                wait([self._filling])
                self.grammar_timing.join_s += time.perf_counter() - joining
                self._filling = None
                self.runner.finish_launch(launched)
        self.inflight = launched
        if launched is not None and not self.scheduler.has_unfinished_requests():
            # Every request ended with the step just collected: the one launched after it holds only rows
            # whose tokens are dropped. Collected now, so an idle engine holds no step
            # (has_unfinished_requests, reset_prefix_cache, a test's next request).
            outputs += self._finish_inflight()
        return outputs

    def _finish_inflight(self) -> list[EngineCoreOutput]:
        if self.inflight is None:
            return []
        pending, self.inflight = self.inflight, None
        result, self._inflight_result = self._inflight_result or self.runner.wait(pending), None
        self.scheduler.update_from_output(pending.out, result.sampled, committed=True)
        return _outputs(pending.out, result)

    def _attach_grammar_bitmask(self, scheduled: SchedulerOutput) -> None:
        """The allowed tokens of each sampling row, as a function the runner calls once the step's forward
        is queued, so the masks' CPU time overlaps the device's forward. Under async scheduling the step
        before is still in flight when this step is launched: the function first reads that step's tokens
        (kept for _finish_inflight, which then does not wait again) and feeds them to their requests'
        matchers ahead of the scheduler (GrammarState.feed_ahead), then builds the masks from the
        matchers as they stand after every earlier token."""
        self._filling = None
        if self.grammars is None or not self.scheduler.num_with_grammar:
            return  # nothing per step for unconstrained work
        rows = [s.request.grammar for s in scheduled.scheduled if s.num_sampled]
        if all(g is None for g in rows):
            return
        num_bytes, previous = self.grammars.bitmask_bytes, self.inflight
        overlap = self.grammar_overlap and previous is not None  # else nothing runs beside the fill

        def masks() -> bytearray | MaskSlot | Future:
            timing = self.grammar_timing
            start = time.perf_counter()
            if previous is not None and self._inflight_result is None:
                self._inflight_result = self.runner.wait(previous)
                waited = time.perf_counter()
                _feed_ahead(previous.out, self._inflight_result.sampled, snapshot=overlap)
                timing.wait_s += waited - start
                timing.feed_s += time.perf_counter() - waited
            timing.steps += 1
            if overlap:  # the runner queues the sampling once the future is done (finish_launch)
                self._filling = fill_bitmasks_beside(rows, num_bytes, self._mask_thread(), timing.add_fill,
                                                     self._mask_buffers)
                timing.beside += 1
                return self._filling
            filling = time.perf_counter()
            buffer = fill_bitmasks(rows, num_bytes, self._mask_buffers)
            timing.add_fill(time.perf_counter() - filling)
            return buffer

        scheduled.grammar_bitmask = masks

    def _pinned_mask_buffers(self) -> Any:
        """This engine's MaskBuffers, sized for a full batch of masks (imported here: the engine package
        itself stays torch-free, and only this switch needs torch in the engine)."""
        from deepserve.layers.sampling_metadata import MaskBuffers

        row_bytes = mask_row_bytes(self.config.model.hf_config.vocab_size)
        return MaskBuffers(initial_bytes=self.config.scheduler.max_num_seqs * row_bytes)

    def _mask_thread(self) -> ThreadPoolExecutor:
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="deepserve-masks")
        return self._mask_pool


def _feed_ahead(out: SchedulerOutput, sampled: list[list[int]], snapshot: bool = False) -> None:
    """Each constrained request's tokens of a finished step into its matcher, before the scheduler takes
    them. A request that ended before (its row's token will be dropped) is skipped. snapshot: see
    GrammarState.feed_ahead (the masks will fill beside the scheduler's update)."""
    for sched, tokens in zip(out.scheduled, sampled, strict=True):
        request = sched.request
        if request.grammar is not None and not request.is_finished:
            for token_id in tokens:
                if request.grammar_consumes(token_id):
                    request.grammar.feed_ahead(token_id, snapshot)


def _proposer(config: EngineConfig) -> NgramProposer | ModelDrafts | None:
    spec = config.speculative
    if spec is None:
        return None
    if spec.is_mtp:
        logger.info("speculative decoding: the checkpoint's MTP layer drafts %d tokens per step",
                    spec.num_speculative_tokens)
        return ModelDrafts(spec.num_speculative_tokens)
    logger.info("speculative decoding: %s, %d draft tokens per step (prompt lookup n = %d..%d)", spec.method,
                spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)


def acceptance(stats: SchedulerStats) -> tuple[float, float]:
    """(draft acceptance rate, mean accepted length = tokens per verify step, the target's own included);
    vLLM's two speculative-decoding summaries. (0, 0) before any draft."""
    if not stats.spec_decode_num_drafts_total:
        return 0.0, 0.0
    accepted = stats.spec_decode_num_accepted_tokens_total
    return (accepted / max(1, stats.spec_decode_num_draft_tokens_total),
            1.0 + accepted / stats.spec_decode_num_drafts_total)


class SpecDecodeLog:
    """The engine's periodic speculative-decoding line: acceptance since start, every `every` seconds."""

    def __init__(self, every: float = 10.0) -> None:
        self.every = every
        self.last = time.monotonic()

    def maybe_log(self, stats: SchedulerStats) -> None:
        now = time.monotonic()
        if now - self.last < self.every or not stats.spec_decode_num_drafts_total:
            return
        self.last = now
        rate, length = acceptance(stats)
        logger.info("speculative decoding: acceptance rate %.3f, mean accepted length %.2f, %d drafts, "
                    "%d draft tokens, %d accepted", rate, length, stats.spec_decode_num_drafts_total,
                    stats.spec_decode_num_draft_tokens_total, stats.spec_decode_num_accepted_tokens_total)


def _outputs(scheduled: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
    outputs = []
    for i, sched in enumerate(scheduled.scheduled):
        request, tokens = sched.request, result.sampled[i]
        prompt_lps = result.prompt_logprobs.get(request.request_id)
        if prompt_lps:
            request.prompt_logprobs.extend(prompt_lps)
        if not tokens and prompt_lps is None:
            continue
        entries = result.logprobs[i][:len(tokens)] if result.logprobs else []
        outputs.append(EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=tokens,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            new_logprobs=entries or None,
            prompt_logprobs=prompt_lps,
            num_cached_tokens=request.num_cached_tokens,
        ))
    return outputs


def _check_cache_fits(config: EngineConfig, num_blocks: int) -> None:
    capacity = num_blocks * config.cache.block_size
    if capacity < config.model.max_model_len:
        raise ValueError(
            f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {config.cache.block_size}), fewer "
            f"than one sequence of max_model_len={config.model.max_model_len}; lower --max-model-len to "
            f"{capacity} or less, or give the cache more memory (--gpu-memory-utilization, "
            "--num-gpu-blocks-override, --cpu-kv-cache-gib)"
        )


def _warm_grammar_compiler(config: EngineConfig) -> GrammarCompiler | None:
    """The engine core process's own GrammarCompiler, its tokenizer loaded and llguidance's view of it built
    (GrammarCompiler.warm_up; a view that failed to build is left to the first request with a grammar,
    which reports why); None without a tokenizer, when the warm-up is off or the tokenizer does not load
    (then the first such request loads it)."""
    if config.model.tokenizer is None or not grammar_warmup_enabled():
        return None
    try:
        compiler = _load_grammar_compiler(config)
    except Exception as e:  # noqa: BLE001 (the engine serves token ids without it; a grammar request reports it)
        logger.warning("structured output's warm-up could not load the tokenizer: %s", e)
        return None
    compiler.warm_up()
    return compiler


def _load_grammar_compiler(config: EngineConfig) -> GrammarCompiler:
    """A GrammarCompiler on the model's tokenizer, loaded here (this core's own: its front end, if any, runs
    in another process)."""
    from deepserve.loader.tokenizer import load_tokenizer

    return GrammarCompiler(load_tokenizer(config.model.tokenizer), config.model.hf_config.vocab_size)


def _process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None
