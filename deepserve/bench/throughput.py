"""`deepserve bench throughput`: W1 (or a W4 grid point) through the offline engine.

Reports vLLM's field names (elapsed_time, num_requests, total_num_tokens, requests_per_second,
tokens_per_second) plus output tokens/s, time to ready, peak memory and tokens per joule.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from deepserve.bench.gpu_stats import EnergyMeter, device_name, peak_memory_gib
from deepserve.bench.spec_stats import describe, spec_decode_summary
from deepserve.bench.workloads import Workload, within_vocab
from deepserve.compile_watch import compiles_between
from deepserve.config import EngineArgs
from deepserve.sampling_params import SamplingParams


def run_throughput(engine_args: EngineArgs, workload: Workload, process_start: float) -> dict[str, Any]:
    from deepserve.entrypoints.llm import LLM

    llm = LLM(**vars(engine_args))
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    time_to_ready = time.perf_counter() - process_start  # process start -> first token out
    workload = within_vocab(workload, llm.llm_engine.config.model.hf_config.vocab_size)
    return {"model": engine_args.model, **measure_throughput(llm, workload), "time_to_ready_s": time_to_ready,
            "startup_s": llm.llm_engine.core.startup_s}


def measure_throughput(llm, workload: Workload) -> dict[str, Any]:
    """One warm-up generate, then the workload in one timed generate on an engine that is ready."""
    llm.generate([p[:16] for p in workload.prompts[:8]], SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)  # the warm-up generate of the definition
    parallel = llm.llm_engine.config.parallel
    meter = EnergyMeter(parallel.tensor_parallel_size * parallel.pipeline_parallel_size // parallel.nnodes)
    before = llm.llm_engine.stats()
    compiles_before = llm.llm_engine.core.kernel_compiles()
    core = llm.llm_engine.core
    core.scheduler.reset_peaks()  # the run's own peak batch and KV usage (W4)
    steps_before, grammar_before = core.num_steps, dataclasses.replace(core.grammar_timing)
    meter.start()
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, workload.params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    joules = meter.stop()
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    if workload.exact_output and num_out != workload.num_output_tokens:
        raise RuntimeError(f"generated {num_out} tokens, the workload asks for {workload.num_output_tokens}")
    stats = llm.llm_engine.stats()
    return {
        "workload": workload.name,
        "device": device_name(),
        "elapsed_time": elapsed,
        "num_requests": len(workload.prompts),
        "num_prompt_tokens": workload.num_prompt_tokens,
        "num_output_tokens": num_out,
        "total_num_tokens": workload.num_prompt_tokens + num_out,
        "requests_per_second": len(workload.prompts) / elapsed,
        "tokens_per_second": (workload.num_prompt_tokens + num_out) / elapsed,
        "output_tokens_per_second": num_out / elapsed,
        "peak_memory_gib": peak_memory_gib(),
        "num_preemptions": stats.num_preemptions_total,
        "peak_batch": stats.peak_num_running,
        "peak_kv_cache_usage": stats.peak_kv_cache_usage,
        "num_swapped_out_blocks": stats.num_swapped_out_blocks_total,
        "kv_cache_blocks": llm.llm_engine.core.num_blocks,
        "output_tokens_per_joule": num_out / joules if joules else None,
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "pipeline_parallel_size": parallel.pipeline_parallel_size,
        "enable_expert_parallel": parallel.enable_expert_parallel,
        "async_scheduling": llm.llm_engine.core.async_scheduling,
        "speculative": spec_decode_summary(llm.llm_engine, before),
        # Kernels compiled inside the timed run (a shape start-up did not compile): their time is in it.
        "kernel_compiles_during_run": compiles_between(compiles_before, llm.llm_engine.core.kernel_compiles()),
        # Where lengths are not fixed (a grammar may complete early): each request's, in workload order, so
        # the same work can be timed unconstrained (workloads.with_output_lengths).
        "output_lengths": None if workload.exact_output else [len(o.outputs[0].token_ids) for o in outputs],
        "engine_steps": core.num_steps - steps_before,
        "grammar_host_ms": _grammar_ms(grammar_before, core.grammar_timing),
    }


def _grammar_ms(before, after) -> dict[str, float] | None:
    """Structured output's host time in the run, ms per step that built masks (None without any)."""
    steps = after.steps - before.steps
    if not steps:
        return None
    return {"steps": steps, **{name: 1e3 * (getattr(after, f"{name}_s") - getattr(before, f"{name}_s")) / steps
                               for name in ("wait", "feed", "fill", "join")}}


def print_result(result: dict[str, Any]) -> None:
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.1f} total "
        f"tokens/s, {result['output_tokens_per_second']:.1f} output tokens/s "
        f"({result['num_output_tokens']} tokens in {result['elapsed_time']:.2f} s, {result['device']})"
        + describe(result.get("speculative"))
    )
    compiles = result.get("kernel_compiles_during_run") or {}
    if compiles.get("watching") and (compiles.get("triton_compiles") or compiles.get("dynamo_graphs")):
        print(f"note: {compiles['triton_compiles']} Triton kernel variants and {compiles['dynamo_graphs']} "
              "torch.compile graphs were compiled (or read from the disk cache) inside the timed run "
              "(DEEPSERVE_PREFILL_WARMUP=1 compiles prefill shapes at start-up)")
    grammar = result.get("grammar_host_ms")
    if grammar:
        print(f"structured output: {result['engine_steps']} engine steps, {grammar['steps']} built masks; per such "
              f"step {grammar['wait']:.2f} ms waiting for the step before, {grammar['feed']:.2f} ms advancing the "
              f"matchers, {grammar['fill']:.2f} ms computing the masks")
    print(json.dumps(result))
