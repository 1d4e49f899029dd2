"""Where one decode step's time goes, on a GPU, for one model shape and batch size.

For a batch of B requests in steady decode (prompt length L, dummy weights) it prints:
- wall ms per engine step (LLMEngine.step, everything included), step by step and with async
  scheduling (the next step launched before this one's tokens are read);
- the host-side phases inside it (scheduler, input preparation, graph launch, sampling metadata,
  sampler launch, waiting for the sampled tokens, scheduler update, output processing), timed with
  perf_counter around the engine's own functions;
- wall ms of one step that prefills --prefill-tokens fresh tokens (prompts of 512), the TFLOP/s
  that makes in the linear layers, and that step's top kernels;
- GPU ms of one decode CUDA-graph replay (CUDA events over back-to-back replays), so
  wall - replay = what the GPU spends idle or sampling;
- the top kernels of one graph replay and of one eager step (torch.profiler), written to $OUT.

Usage: python bench/profile_step.py --model deepseek-llm-7b --batch 1 --prompt-len 1024 [--temperature 0]
       [--quantization fp8|awq|gptq|none] [--kv-cache-dtype fp8] [--layers N] [--tag NAME]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections import defaultdict

import torch

import deepserve.runner.model_runner as model_runner_module
from deepserve import LLM, SamplingParams
from deepserve.layers.sampling_metadata import SamplingMetadata

PHASES: dict[str, float] = defaultdict(float)


def timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PHASES[name] += time.perf_counter() - start
    return wrapper


def instrument(llm: LLM) -> None:
    engine = llm.llm_engine
    core = engine.core
    runner = core.runner
    core.scheduler.schedule = timed("schedule", core.scheduler.schedule)
    core.scheduler.update_from_output = timed("update", core.scheduler.update_from_output)
    engine.output_processor.process = timed("output_processor", engine.output_processor.process)
    model_runner_module.prepare_inputs = timed("prepare_inputs", model_runner_module.prepare_inputs)
    SamplingMetadata.build = timed("sampling_metadata", SamplingMetadata.build)
    runner.sampler = timed("sampler_launch", runner.sampler)
    runner.execute = timed("execute", runner.execute)
    runner.launch = timed("launch", runner.launch)
    runner.wait = timed("wait", runner.wait)
    if runner.graphs is not None:
        runner.graphs.run = timed("graph_launch", runner.graphs.run)


def start_decoding(llm: LLM, batch: int, prompt_len: int, temperature: float) -> None:
    g = torch.Generator().manual_seed(0)
    engine = llm.llm_engine
    model = engine.config.model
    params = SamplingParams(temperature=temperature, max_tokens=model.max_model_len - prompt_len - 1, ignore_eos=True)
    vocab = min(10000, model.hf_config.vocab_size)
    for i in range(batch):
        engine.add_request(f"p{i}", torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), params,
                           final_only=True)  # as LLM.generate: no per-step RequestOutput
    while engine.core.scheduler.waiting or any(
            r.num_output_tokens < 2 for r in engine.core.scheduler.running):
        engine.step()


def prefill_runner(llm: LLM, total_tokens: int, prompt_len: int):
    """A function that runs one step prefilling total_tokens fresh tokens (total/prompt_len prompts,
    one output token each; each call's prompts are new, so the prefix cache finds nothing)."""
    vocab = min(10000, llm.llm_engine.config.model.hf_config.vocab_size)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    n = max(1, total_tokens // prompt_len)
    calls = iter(range(1, 1 << 30))

    def run() -> None:
        offset = next(calls)
        prompts = [[(offset * 7919 + i * 104729 + j * 31) % vocab for j in range(prompt_len)] for i in range(n)]
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    return run


def prefill_ms(llm: LLM, run) -> tuple[float, int]:
    """Wall ms of one prefill call, and the engine steps it took; the first call warms up."""
    run()
    sync()
    scheduler = llm.llm_engine.core.scheduler
    schedule, steps = scheduler.schedule, [0]

    def counted():
        steps[0] += 1
        return schedule()

    scheduler.schedule = counted
    start = time.perf_counter()
    run()
    sync()
    elapsed = (time.perf_counter() - start) * 1e3
    scheduler.schedule = schedule
    return elapsed, steps[0]


def linear_flops_per_token(llm: LLM) -> float:
    """2 x the weights one token multiplies through (top-k experts only, no embedding, no LM head,
    which a prefill computes for the last token only); attention's own FLOPs are not counted."""
    from deepserve.bench.latency import weight_bytes_read_per_step

    model = llm.llm_engine.core.runner.model
    cfg = model.config
    elem = next(model.parameters()).element_size()
    return 2 * (weight_bytes_read_per_step(model) / elem - cfg.vocab_size * cfg.hidden_size)


def timed_steps(engine, steps: int) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) * 1e3 / steps


def graph_replay_ms(llm: LLM, batch: int) -> float | None:
    graphs = llm.llm_engine.core.runner.graphs
    if graphs is None:
        return None
    size = min(s for s in graphs.sizes if s >= batch)
    graph = graphs.graphs[size]
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 20


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernel_table(fn, steps: int, path: str) -> list[tuple[str, float, int]]:
    """(kernel name, device µs per step, calls per step), largest first; the full table goes to `path`."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        sync()
    rows = []
    for evt in prof.key_averages():
        dev = getattr(evt, "self_device_time_total", None)
        if dev is None:
            dev = evt.self_cuda_time_total
        if dev > 0:
            rows.append((evt.key, dev / steps, evt.count // steps))
    rows.sort(key=lambda r: -r[1])
    with open(path, "w") as f:
        for name, us, calls in rows:
            f.write(f"{us:10.1f} us {calls:5d}x  {name}\n")
    return rows


def host_profile(fn, steps: int, path: str) -> list[tuple[str, float, int]]:
    """cProfile over `steps` calls: (function, own ms per step, calls per step), largest first, top 20;
    the full cumulative listing goes to `path`."""
    import cProfile
    import io
    import pstats

    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    sync()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("cumulative").print_stats(60)
    with open(path, "w") as f:
        f.write(buf.getvalue())
    rows = [(f"{file.rsplit('/', 2)[-1]}:{line}:{name}", tottime * 1e3 / steps, calls // steps)
            for (file, line, name), (_, calls, tottime, _, _) in stats.stats.items()]
    rows.sort(key=lambda r: -r[1])
    return [(n, round(ms, 3), c) for n, ms, c in rows[:20]]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--prefill-tokens", type=int, default=8192, help="0: skip the prefill timing")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--host-profile", action="store_true",
                    help="also time eager steps after a warm-up and cProfile them (where the host time goes)")
    ap.add_argument("--quantization", default=None, help="as deepserve's --quantization (dummy weights in it)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--layers", type=int, default=None,
                    help="keep only the first N decoder layers (the gate's V3 slice: 8)")
    ap.add_argument("--tag", default="", help="appended to the output files' names (variants of one model)")
    ns = ap.parse_args()
    quant = f"-{ns.quantization}" if ns.quantization else ""
    tag = f"{ns.model}{quant}-b{ns.batch}{ns.tag and '-' + ns.tag}"
    # Room for the prefill window's prompts (512 tokens each) in one step. With max_num_seqs = batch = 1
    # its 16 prompts went one per step, 16 steps: the likely reading of the 1,231 ms that BENCHMARKS.md's
    # V2-Lite batch-1 profile printed for "8,192 tokens". The window now also counts its engine steps.
    llm = LLM(model=None if ns.model == "demo" else ns.model, load_format="dummy", max_model_len=ns.max_model_len,
              max_num_seqs=max(ns.batch, ns.prefill_tokens // 512, 1), skip_tokenizer_init=True,
              quantization=ns.quantization, kv_cache_dtype=ns.kv_cache_dtype,
              **({"hf_overrides": {"num_hidden_layers": ns.layers}} if ns.layers else {}))
    prefill, prefill_steps, top_prefill = None, 0, []
    if ns.prefill_tokens:
        run_prefill = prefill_runner(llm, ns.prefill_tokens, 512)
        prefill, prefill_steps = prefill_ms(llm, run_prefill)
        top_prefill = kernel_table(run_prefill, 1, f"{ns.out}/{tag}-prefill-kernels.txt")
    prefill_tflops = prefill and linear_flops_per_token(llm) * ns.prefill_tokens / (prefill * 1e-3) / 1e12
    start_decoding(llm, ns.batch, ns.prompt_len, ns.temperature)
    engine = llm.llm_engine
    core = engine.core
    can_overlap = hasattr(core.runner, "launch")

    # Step by step (the engine waits for each step's tokens before scheduling the next), then with
    # async scheduling (step n+1 launched before step n is read): the difference is host time hidden.
    core.async_scheduling = False
    wall_ms = timed_steps(engine, ns.steps)
    core.async_scheduling = can_overlap
    async_ms = timed_steps(engine, ns.steps)
    core.async_scheduling = False

    # Same state, same host work, graphs off then on again: any difference is GPU time.
    graphs = engine.core.runner.graphs
    engine.core.runner.graphs = None
    eager_ms = timed_steps(engine, ns.steps)
    engine.core.runner.graphs = graphs
    graph_again_ms = timed_steps(engine, ns.steps)

    instrument(llm)
    for _ in range(ns.steps):
        engine.step()
    phases = {k: round(v * 1e3 / ns.steps, 3) for k, v in PHASES.items()}
    replay = graph_replay_ms(llm, ns.batch)

    top_graph = []
    graphs = engine.core.runner.graphs
    if graphs is not None:
        size = min(s for s in graphs.sizes if s >= ns.batch)
        top_graph = kernel_table(graphs.graphs[size].replay, 5, f"{ns.out}/{tag}-graph-kernels.txt")
    engine.core.runner.graphs = None  # eager steps from here on
    top_eager = kernel_table(engine.step, 3, f"{ns.out}/{tag}-eager-kernels.txt")
    eager_warm_ms = host_top = None
    if ns.host_profile:  # the eager figure above includes any kernel compiling its first steps did
        eager_warm_ms = timed_steps(engine, ns.steps)
        host_top = host_profile(engine.step, 5, f"{ns.out}/{tag}-eager-host.txt")

    result = {"model": ns.model, "quantization": ns.quantization, "kv_cache_dtype": ns.kv_cache_dtype,
              "tag": ns.tag, "batch": ns.batch, "prompt_len": ns.prompt_len, "temperature": ns.temperature,
              "wall_ms_per_step": round(wall_ms, 3), "async_wall_ms_per_step": round(async_ms, 3),
              "eager_wall_ms_per_step": round(eager_ms, 3),
              "eager_warm_wall_ms_per_step": eager_warm_ms and round(eager_warm_ms, 3),
              "eager_host_top_tottime_ms": host_top, "graph_wall_again_ms_per_step": round(graph_again_ms, 3),
              "graph_replay_ms": replay and round(replay, 3),
              "prefill_ms": prefill and round(prefill, 2), "prefill_tokens": ns.prefill_tokens,
              "prefill_engine_steps": prefill_steps,
              "prefill_linear_tflops": prefill_tflops and round(prefill_tflops, 1),
              "host_phases_ms": phases,
              "graph_top_kernels_us": [(n[:80], round(u, 1), c) for n, u, c in top_graph[:15]],
              "prefill_top_kernels_us": [(n[:80], round(u, 1), c) for n, u, c in top_prefill[:25]],
              "eager_top_kernels_us": [(n[:80], round(u, 1), c) for n, u, c in top_eager[:25]]}
    with open(f"{ns.out}/{tag}-profile.json", "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    print(f"SUMMARY {tag}: wall {wall_ms:.3f} ms/step, async {async_ms:.3f} (eager {eager_ms:.3f}, "
          f"graphs again {graph_again_ms:.3f}), prefill of {ns.prefill_tokens} tokens {prefill} ms "
          f"in {prefill_steps} engine steps "
          f"({prefill_tflops} TFLOP/s in the linear layers), "
          f"graph replay {replay} ms, phases {phases}")
    if host_top:
        print(f"eager after warm-up {eager_warm_ms:.3f} ms/step; own time per step (ms, calls):")
        print("\n".join(f"  {ms:8.3f} {calls:6d}  {name}" for name, ms, calls in host_top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
