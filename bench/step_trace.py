"""Where each engine step's time goes, host and device, step by step: the questions the aggregate figures
left open (bench/RESULTS.md, sixth session of 2026-12-02): structured output adds 1.4-2.0 ms a W1 step that
the masks' host time does not explain, and the first step of a request (the prefill's launch) holds the
host for the whole TTFT.

    python3 bench/step_trace.py r1-distill-qwen-7b [--json-schema] [--out trace.json]   # W1, every step
    python3 bench/step_trace.py deepseek-llm-7b --quantization fp8 --ttft                 # one request's steps
    python3 bench/step_trace.py demo --smoke [--json-schema]                              # CPU plumbing

W1 (or --ttft: 8 requests of 1,024 tokens, one at a time, each then again for prefix-cache hits) runs with
the engine core's parts wrapped, nothing in the engine changed: per step the host time of schedule, launch
(and inside it the inputs' preparation, the forward's launch, the masks without the wait inside them, the
sampling metadata with the masks' copy, the sampling's launch), the wait for the step in flight,
update_from_output and the collector's pauses (also inside whichever part they interrupted); on the GPU,
CUDA events around the forward and the sampling: each step's device time, the stall between its forward and
its sampling (the masks not ready), and the device's idle gap before it. Steps are grouped by kind (graph
replay or eager; with or without masks) and the table prints means per kind. --profile N: torch.profiler
over the first N steps of the timed run (or --ttft's first request), its top host ops by self time (a
cudaStreamSynchronize or a pageable copy inside a launch shows there). --sync-debug: torch's synchronizing
calls by site; --gc-freeze: the start-up heap frozen as the server freezes it; --same-lengths (with
--json-schema): the unconstrained W1 at the schema run's output lengths traced after it, the gate's ratio's
two halves side by side."""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gate  # noqa: E402  (bench/gate.py: the presets' engines as the gate builds them)

RESTORE: list[tuple] = []  # (object, name, value) StepTracer replaced outside the core's own objects, for _unwrap


class StepTracer:
    """Wraps one EngineCore's scheduler and runner methods with timers; `steps` holds one dict per
    core.step() call. Device events exist on CUDA only (CPU runs record host times)."""

    def __init__(self, core) -> None:
        import torch

        if not hasattr(core.runner, "_forward"):  # a tensor-parallel executor: the ranks' runners are elsewhere
            raise SystemExit("step_trace: one GPU only (the engine core's runner must be in this process)")
        self.core, self.steps, self.current = core, [], None
        self.cuda = core.runner.device.type == "cuda"
        self._torch = torch
        self._wrap(core, "step", self._step)
        self._wrap(core.scheduler, "schedule", self._timed("schedule"))
        self._wrap(core.scheduler, "update_from_output", self._timed("update"))
        self._wrap(core.runner, "launch", self._timed("launch"))
        self._wrap(core.runner, "wait", self._timed("wait"))
        self._wrap(core.runner, "_forward", self._forward)
        self._wrap(core.runner, "_sample", self._sample)
        self._wrap(core, "_attach_grammar_bitmask", self._attach)
        # Inside the launch, the host work between the forward's launch and the sampling's: the inputs, the
        # sampling metadata and (in it, or in the runner's deferred sampling under DEEPSERVE_GRAMMAR_OVERLAP)
        # the masks' copy to the device. Module and class attributes: _unwrap restores them.
        from deepserve.layers import sampling_metadata
        from deepserve.runner import model_runner

        self._replace(model_runner, "prepare_inputs", self._timed("prepare"))
        self._replace(sampling_metadata, "bitmask_tensor", self._timed("mask_copy"))
        self._replace(model_runner, "bitmask_tensor", self._timed("mask_copy"))
        build = sampling_metadata.SamplingMetadata.__dict__["build"]
        RESTORE.append((sampling_metadata.SamplingMetadata, "build", build))
        sampling_metadata.SamplingMetadata.build = classmethod(self._timed("meta_build")(build.__func__))
        # Python's collector: a full collection over a large heap stops the host for as long as it runs.
        self._gc_start = None
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self._add("gc", time.perf_counter() - self._gc_start)
            if self.current is not None and info.get("generation") == 2:
                self.current["gc_full"] = self.current.get("gc_full", 0) + 1
            self._gc_start = None

    _gc.step_tracer = True  # _unwrap finds the callback by this mark

    def _replace(self, obj, name: str, make) -> None:
        RESTORE.append((obj, name, getattr(obj, name)))
        self._wrap(obj, name, make)

    @staticmethod
    def _wrap(obj, name: str, make) -> None:
        original = getattr(obj, name)
        setattr(obj, name, make(original))

    def _add(self, key: str, seconds: float) -> None:
        if self.current is not None:
            self.current[key] = self.current.get(key, 0.0) + 1e3 * seconds

    def _timed(self, key: str):
        def make(original):
            def timed(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    self._add(key, time.perf_counter() - start)
            return timed
        return make

    def _event(self):
        if not self.cuda:
            return None
        event = self._torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _step(self, original):
        def step(*args, **kwargs):
            self.current = {"events": {}}
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.current["wall"] = 1e3 * (time.perf_counter() - start)
                self.steps.append(self.current)
                self.current = None
        return step

    def _forward(self, original):
        from deepserve.runner.model_runner import _wants_prompt_logprobs

        def forward(out, inputs):
            runner = self.core.runner
            if self.current is not None:  # the runner's own test for a graph replay
                graphs = runner.graphs
                self.current["graph"] = bool(graphs is not None and graphs.can_run(inputs)
                                             and not _wants_prompt_logprobs(out))
                self.current["tokens"] = int(inputs.input_ids.shape[0])
                self.current["events"]["forward_start"] = self._event()
            start = time.perf_counter()
            result = original(out, inputs)
            self._add("forward_launch", time.perf_counter() - start)
            if self.current is not None:
                self.current["events"]["forward_end"] = self._event()
            return result
        return forward

    def _sample(self, original):
        def sample(pending, logits, meta):
            if self.current is not None:
                self.current["events"]["sample_start"] = self._event()
            start = time.perf_counter()
            result = original(pending, logits, meta)
            self._add("sample_launch", time.perf_counter() - start)
            if self.current is not None:
                self.current["masked"] = meta.allowed_token_bitmask is not None
                self.current["events"]["sample_end"] = self._event()
            return result
        return sample

    def _attach(self, original):
        def attach(scheduled):
            original(scheduled)
            masks = scheduled.grammar_bitmask
            if masks is None:
                return

            def timed_masks():
                # Under async scheduling the masks first wait for the step in flight (runner.wait, timed
                # as "wait"): "masks" is the rest (feeding the matchers and filling the masks).
                waited = (self.current or {}).get("wait", 0.0)
                start = time.perf_counter()
                try:
                    return masks()
                finally:
                    inside = (self.current or {}).get("wait", 0.0) - waited
                    self._add("masks", time.perf_counter() - start - inside / 1e3)
            scheduled.grammar_bitmask = timed_masks
        return attach

    def finish(self) -> list[dict]:
        """Device times from the events (after a synchronize): the forward; the sampling (its kernels
        and the masks' copy); the stall between them (the device idle while the host fed and filled the
        masks, or past it when they were ready); and the gap from the previous step's last event to this
        step's forward (the device idle between steps, whatever the host did then)."""
        if self.cuda:
            self._torch.cuda.synchronize()
        previous_end = None
        for step in self.steps:
            events = step.pop("events")
            start, mid = events.get("forward_start"), events.get("forward_end")
            sample_start, end = events.get("sample_start"), events.get("sample_end")
            if start is not None and mid is not None:
                step["gpu_forward"] = start.elapsed_time(mid)
                if sample_start is not None and end is not None:
                    step["gpu_stall"] = mid.elapsed_time(sample_start)
                    step["gpu_sample"] = sample_start.elapsed_time(end)
                if previous_end is not None:
                    step["gpu_gap"] = previous_end.elapsed_time(start)
            previous_end = end or mid or previous_end
        return self.steps


COLUMNS = ("wall", "schedule", "launch", "prepare", "forward_launch", "masks", "meta_build", "mask_copy",
           "sample_launch", "wait", "update", "gc", "gpu_forward", "gpu_stall", "gpu_sample", "gpu_gap")


def summarize(steps: list[dict]) -> list[dict]:
    """Mean ms of each column per kind of step (graph / eager, masked or not), and over all steps."""
    kinds: dict[str, list[dict]] = {}
    for step in steps:
        if "graph" not in step:
            continue  # a step that launched nothing (only collected the one in flight)
        kind = ("graph" if step["graph"] else "eager") + (" +masks" if step.get("masked") else "")
        kinds.setdefault(kind, []).append(step)
        kinds.setdefault("all", []).append(step)
    rows = []
    for kind, group in sorted(kinds.items()):
        row = {"kind": kind, "steps": len(group), "tokens": statistics.mean(s["tokens"] for s in group)}
        for column in COLUMNS:
            values = [s[column] for s in group if column in s]
            row[column] = statistics.mean(values) if values else None
        rows.append(row)
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}: mean ms per step (host: wall of core.step and its parts; gpu: CUDA events)")
    header = f"{'kind':14} {'steps':>5} {'tokens':>7} " + " ".join(f"{c[:12]:>12}" for c in COLUMNS)
    print(header)
    for row in rows:
        cells = " ".join(f"{row[c]:>12.3f}" if row[c] is not None else f"{'-':>12}" for c in COLUMNS)
        print(f"{row['kind']:14} {row['steps']:>5} {row['tokens']:>7.0f} {cells}")


def print_outliers(steps: list[dict], count: int = 5) -> None:
    """The collector's total, and the slowest steps whole: a mean hides one long stall."""
    collected = [s for s in steps if "gc" in s]
    print(f"\ngc: {sum(s['gc'] for s in collected):.1f} ms in {len(collected)} steps, "
          f"{sum(s.get('gc_full', 0) for s in steps)} full collections")
    print(f"the {count} slowest steps (ms):")
    ranked = sorted(range(len(steps)), key=lambda i: steps[i]["wall"], reverse=True)[:count]
    for i in sorted(ranked):
        parts = " ".join(f"{c}={steps[i][c]:.2f}" for c in COLUMNS if steps[i].get(c) is not None)
        print(f"  step {i} tokens={steps[i].get('tokens', 0)} {parts}")


class SyncWatch:
    """--sync-debug: torch's sync debug mode over the timed run; each synchronizing CUDA call torch makes (an
    .item(), a blocking copy, a nonzero) is counted by where our code made it (the deepserve and bench frames
    of the stack). A copy from pageable memory that the driver holds is not torch's sync: it shows in the
    step's host times instead."""

    def __init__(self, enabled: bool) -> None:
        import torch

        self.enabled = enabled and torch.cuda.is_available()
        self.sites: dict[tuple, int] = {}
        self._torch = torch
        self._shown = warnings.showwarning

    def __enter__(self):
        if self.enabled:
            warnings.showwarning = self._record
            self._filters = warnings.filters[:]
            warnings.simplefilter("always")
            self._torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = self._shown
            warnings.filters[:] = self._filters

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):  # torch's words; any other warning is shown as usual
            self._shown(message, category, filename, lineno, file, line)
            return
        frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                  if "deepserve" in f.filename or "/bench/" in f.filename]
        key = (str(message).splitlines()[0][:80], tuple(frames[-4:]))
        self.sites[key] = self.sites.get(key, 0) + 1

    def report(self) -> None:
        if not self.enabled:
            return
        print(f"\nsynchronizing CUDA calls in the watched run: {sum(self.sites.values())} at {len(self.sites)} sites "
              "(the debug mode slows what it watches: its times are not comparable with other runs)")
        for (message, frames), count in sorted(self.sites.items(), key=lambda kv: -kv[1])[:10]:
            print(f"  {count:6d}  {message}\n          " + "\n          ".join(frames))


def profiled(n_steps: int, core, run):
    """Run `run()` under torch.profiler for the core's first n_steps steps; print the top host ops."""
    import torch

    if n_steps <= 0:
        return run()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    original, seen = core.step, [0]
    profiler = torch.profiler.profile(activities=activities)

    def step(*args, **kwargs):
        if seen[0] == 0:
            profiler.start()
        try:
            return original(*args, **kwargs)
        finally:
            seen[0] += 1
            if seen[0] == n_steps:
                profiler.stop()
                print(f"\ntorch.profiler, the first {n_steps} steps: top host ops by self time")
                print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    core.step = step
    try:
        return run()
    finally:
        core.step = original
        if 0 < seen[0] < n_steps:
            profiler.stop()


def trace_w1(llm, ns) -> dict:
    from deepserve.bench import workloads
    from deepserve.bench.throughput import measure_throughput

    workload = workloads.w1()
    if ns.smoke:  # the demo model's vocabulary has 1,000 tokens
        workload = workloads.fixed(32, 8, 8)
        workload.prompts = [[t % 1000 for t in p] for p in workload.prompts]
    plain = workload
    if ns.json_schema:
        workload = workloads.with_json_schema(workload)
    core = llm.llm_engine.core
    measure_throughput(llm, workload)  # warm: the traced run is the second, as the gate's w1_2nd
    llm.reset_prefix_cache()
    tracer = StepTracer(core)
    try:
        with SyncWatch(ns.sync_debug) as syncs:
            result = profiled(ns.profile, core, lambda: measure_throughput(llm, workload))
    finally:
        _unwrap(core)
    syncs.report()
    steps = tracer.finish()
    rows = summarize(steps)
    print_table(f"W1{' + JSON schema' if ns.json_schema else ''}, {result['output_tokens_per_second']:.0f} out tok/s",
                rows)
    print_outliers(steps)
    report = {"w1": result["output_tokens_per_second"], "output_tokens": result["num_output_tokens"], "summary": rows,
              "steps": steps}
    if getattr(ns, "same_lengths", False) and ns.json_schema:  # the gate's denominator, traced the same way
        report["same_lengths"] = _trace_same_lengths(llm, core, workloads.with_output_lengths(
            plain, result["output_lengths"]), measure_throughput)
    return report


def _trace_same_lengths(llm, core, workload, measure_throughput) -> dict:
    """The unconstrained W1 with the schema run's output lengths (the gate's w1_same_lengths), traced: its
    per-kind table beside the schema run's says which steps the masks make longer."""
    llm.reset_prefix_cache()
    tracer = StepTracer(core)
    try:
        result = measure_throughput(llm, workload)
    finally:
        _unwrap(core)
    steps = tracer.finish()
    rows = summarize(steps)
    print_table(f"W1 unconstrained, the schema run's output lengths, {result['output_tokens_per_second']:.0f} out "
                f"tok/s", rows)
    return {"w1": result["output_tokens_per_second"], "output_tokens": result["num_output_tokens"], "summary": rows,
            "steps": steps}


def trace_ttft(llm, ns) -> dict:
    import random

    from deepserve import SamplingParams

    engine, core = llm.llm_engine, llm.llm_engine.core
    vocab = 1000 if ns.smoke else min(engine.config.model.hf_config.vocab_size, 10001)
    rng = random.Random(1)
    length = 32 if ns.smoke else 1024
    prompts = [[rng.randrange(vocab) for _ in range(length)] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = {}
    for label in ("fresh", "prefix hits"):
        tracer = StepTracer(core)
        firsts = []
        for i, prompt in enumerate(prompts):
            count = len(tracer.steps)
            profile = ns.profile if (i == 2 and label == "fresh") else 0
            watched = ns.sync_debug and i == 2 and label == "fresh"  # one request: the debug mode slows it
            try:
                with SyncWatch(watched) as syncs:
                    first = profiled(profile, core, lambda: _first_token_ms(engine, f"{label}-{i}", prompt, params))  # noqa: B023
            except BaseException:
                _unwrap(core)
                raise
            syncs.report()
            firsts.append((first, count))
        steps = tracer.finish()
        first_steps = [steps[c] for _, c in firsts[2:]]  # each request's first step (the prefill's launch)
        for step in first_steps:  # its gap runs back to the request before: host time between requests
            step.pop("gpu_gap", None)
        rows = summarize(first_steps)
        print_table(f"TTFT, {label}: each request's first step (median TTFT "
                    f"{statistics.median(f for f, _ in firsts[2:]):.1f} ms)", rows)
        out[label] = {"ttft_ms": [f for f, _ in firsts], "first_steps": first_steps, "summary": rows}
        _unwrap(core)
    return out


def trace_w2(llm, ns) -> dict:
    """W2's one request (1,024-token prompt, 512 output tokens, greedy) three times: a warm-up, one untraced
    (its median gap between tokens is the gate's TPOT) and one traced. Per decode step the table splits the
    gap between tokens into the device's forward, its sampling and its idle time before the forward: how far
    W2's TPOT runs above the decode graph's replay, and whether the host or the device holds that time."""
    import random

    from deepserve import SamplingParams
    from deepserve.bench.latency import _timed_request

    engine = llm.llm_engine
    vocab = 1000 if ns.smoke else min(engine.config.model.hf_config.vocab_size, 10001)
    rng = random.Random(2)
    length, outputs = (32, 16) if ns.smoke else (1024, 512)
    params = SamplingParams(temperature=0.0, max_tokens=outputs, ignore_eos=True)

    def one(request_id: str) -> list[float]:
        return _timed_request(engine, [rng.randrange(vocab) for _ in range(length)], params, request_id)

    one("w2-warm")
    stamps = one("w2-untraced")
    untraced = 1e3 * statistics.median(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    tracer = StepTracer(llm.llm_engine.core)
    try:
        traced_stamps = profiled(ns.profile, llm.llm_engine.core, lambda: one("w2-traced"))
    finally:
        _unwrap(llm.llm_engine.core)
    traced = 1e3 * statistics.median(b - a for a, b in zip(traced_stamps, traced_stamps[1:], strict=False))
    steps = tracer.finish()
    decode = [s for s in steps if s.get("tokens") == 1]
    rows = summarize(decode)
    print_table(f"W2 decode steps (TPOT median {untraced:.3f} ms untraced, {traced:.3f} traced)", rows)
    for label, part in (("first 64", decode[:64]), ("last 64", decode[-64:])):
        cells = {c: statistics.median(s[c] for s in part if c in s) for c in ("gpu_forward", "gpu_sample", "gpu_gap",
                                                                              "wall") if any(c in s for s in part)}
        print(f"  {label} decode steps, medians (ms): " + " ".join(f"{c}={v:.3f}" for c, v in cells.items()))
    print_outliers(decode)
    return {"tpot_untraced_ms": untraced, "tpot_traced_ms": traced, "summary": rows, "steps": steps}


def _first_token_ms(engine, request_id: str, prompt: list[int], params) -> float | None:
    """Run one request to its end; ms from adding it to the step that returned its first token."""
    engine.add_request(request_id, prompt, params)
    start, first = time.perf_counter(), None
    while engine.has_unfinished_requests():
        if any(o.outputs[0].token_ids for o in engine.step()) and first is None:
            first = 1e3 * (time.perf_counter() - start)
    return first


def _unwrap(core) -> None:
    """Drop the tracer's wrappers (instance attributes shadowing the class methods; the module functions and
    the classmethod put back)."""
    while RESTORE:  # newest first: a second tracer's wrappers come off before the first's
        obj, name, value = RESTORE.pop()
        setattr(obj, name, value)
    gc.callbacks[:] = [c for c in gc.callbacks if not getattr(c, "step_tracer", False)]
    for obj, names in ((core, ("step", "_attach_grammar_bitmask")),
                       (core.scheduler, ("schedule", "update_from_output")),
                       (core.runner, ("launch", "wait", "_forward", "_sample"))):
        for name in names:
            obj.__dict__.pop(name, None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a preset (dummy weights) or demo")
    parser.add_argument("--quantization", default=None, help="fp8, awq, ... (default: the preset's)")
    parser.add_argument("--json-schema", action="store_true", help="W1 with the gate's JSON schema on every request")
    parser.add_argument("--ttft", action="store_true", help="one request at a time: each one's first steps")
    parser.add_argument("--w2", action="store_true", help="W2's one request: each decode step's device time and gaps")
    parser.add_argument("--profile", type=int, default=0, help="torch.profiler over this many steps")
    parser.add_argument("--smoke", action="store_true", help="tiny workloads (CPU)")
    parser.add_argument("--sync-debug", action="store_true",
                        help="count torch's synchronizing CUDA calls in the timed run by where they were made")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="freeze the start-up heap as the server does (deepserve/heap.py): no full collection "
                             "walks it during the run")
    parser.add_argument("--same-lengths", action="store_true",
                        help="with --json-schema: then trace W1 unconstrained with the schema run's output lengths "
                             "(the gate's ratio's denominator)")
    parser.add_argument("--out", type=Path, help="write every step's record and the summaries here (JSON)")
    ns = parser.parse_args()
    run = gate.ModelRun("trace", None if ns.model == "demo" else ns.model, w2=False, quantization=ns.quantization,
                        json_schema=ns.json_schema)
    llm = gate.make_llm(run)
    if ns.gc_freeze:
        from deepserve.heap import freeze_startup_heap

        freeze_startup_heap("step_trace")
    report = trace_ttft(llm, ns) if ns.ttft else trace_w2(llm, ns) if ns.w2 else trace_w1(llm, ns)
    if ns.out:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
