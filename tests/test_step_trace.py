"""bench/step_trace.py on the demo model (CPU): every step's host phases are recorded where they ran, the
masks' time only on constrained steps, and the wrappers come off so a second trace sees plain methods."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gate = _load("gate")
step_trace = _load("step_trace")


def _ns(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"smoke": True, "json_schema": False, "profile": 0, "sync_debug": False, **kw})


def test_w1_trace_records_each_steps_phases_and_the_masks_where_rows_are_constrained(capsys):
    llm = gate.make_llm(gate.ModelRun("trace", None, w2=False, json_schema=True))
    report = step_trace.trace_w1(llm, _ns(json_schema=True))
    launched = [s for s in report["steps"] if "graph" in s]
    assert launched and report["w1"] > 0
    for step in launched:
        # the step's parts were timed inside it: none longer than the step itself
        assert step["wall"] >= step["launch"] >= step["forward_launch"] > 0
        assert step["launch"] >= step["prepare"] > 0 and step["meta_build"] > 0
        assert step["schedule"] > 0 and step["tokens"] > 0
    masked = [s for s in launched if s.get("masked")]
    assert masked and all(s["masks"] > 0 and s["mask_copy"] > 0 for s in masked)  # every request has the schema
    kinds = {row["kind"]: row for row in report["summary"]}
    assert kinds["all"]["steps"] == len(launched)
    assert sum(row["steps"] for kind, row in kinds.items() if kind != "all") == len(launched)
    assert "W1 + JSON schema" in capsys.readouterr().out


def test_w2_trace_times_one_requests_decode_steps_and_unwraps(capsys):
    llm = gate.make_llm(gate.ModelRun("trace", None, w2=False))
    core = llm.llm_engine.core
    report = step_trace.trace_w2(llm, _ns())
    decode = [s for s in report["steps"] if s.get("tokens") == 1]
    assert len(decode) == 15  # 16 outputs: the prefill step's token, then one a decode step
    assert report["tpot_untraced_ms"] > 0 and report["tpot_traced_ms"] > 0
    assert all(s["wall"] >= s["launch"] > 0 for s in decode)
    assert [r["kind"] for r in report["summary"]] == ["all", "eager"] and report["summary"][0]["steps"] == 15
    assert "step" not in vars(core) and "launch" not in vars(core.runner)  # the wrappers came off
    assert "W2 decode steps" in capsys.readouterr().out


def test_same_lengths_trace_follows_the_schema_run_unconstrained(capsys):
    # --same-lengths: the gate's denominator traced after the schema run, its steps without masks and its
    # output exactly the schema run's token count (each request stopped at the schema run's length)
    llm = gate.make_llm(gate.ModelRun("trace", None, w2=False, json_schema=True))
    report = step_trace.trace_w1(llm, _ns(json_schema=True, same_lengths=True))
    same = report["same_lengths"]
    assert same["output_tokens"] == report["output_tokens"] > 0 and same["w1"] > 0
    launched = [s for s in same["steps"] if "graph" in s]
    assert launched and not any(s.get("masked") for s in launched)
    assert "the schema run's output lengths" in capsys.readouterr().out


def test_ttft_trace_times_each_requests_first_step_and_unwraps_between_labels():
    llm = gate.make_llm(gate.ModelRun("trace", None, w2=False))
    report = step_trace.trace_ttft(llm, _ns())
    for label in ("fresh", "prefix hits"):
        firsts = report[label]["first_steps"]
        assert len(firsts) == 6 and all(s["tokens"] > 1 for s in firsts)  # each a prefill
        assert all(t is not None and t > 0 for t in report[label]["ttft_ms"])
    # the prefix hits computed only the prompts' uncached tails
    assert max(s["tokens"] for s in report["prefix hits"]["first_steps"]) < min(
        s["tokens"] for s in report["fresh"]["first_steps"])
    core = llm.llm_engine.core
    assert "step" not in vars(core) and "launch" not in vars(core.runner)  # the wrappers came off


class _Scheduled:
    scheduled: list = []  # no rows: _wants_prompt_logprobs has nothing to ask
    grammar_bitmask = None


class _FakeRunner:
    """launch runs a forward, the step's masks (which first wait for the step in flight, as the engine's
    do under async scheduling), then a sampling; wait sleeps 20 ms, the masks' own work 10 ms."""

    def __init__(self) -> None:
        import torch

        self.device, self.graphs = torch.device("cpu"), None

    def launch(self, scheduled, previous=None):
        import types

        import torch

        self._forward(scheduled, types.SimpleNamespace(input_ids=torch.zeros(3)))
        scheduled.grammar_bitmask()
        self._sample(None, None, types.SimpleNamespace(allowed_token_bitmask=object()))

    def wait(self, pending):
        time.sleep(0.02)

    def _forward(self, out, inputs):
        return None, None

    def _sample(self, pending, logits, meta):
        return None


class _FakeCore:
    def __init__(self) -> None:
        import types

        self.runner = _FakeRunner()
        self.scheduler = types.SimpleNamespace(schedule=_Scheduled, update_from_output=lambda *a: [])

    def _attach_grammar_bitmask(self, scheduled) -> None:
        scheduled.grammar_bitmask = lambda: (self.runner.wait(None), time.sleep(0.01))

    def step(self) -> list:
        scheduled = self.scheduler.schedule()
        self._attach_grammar_bitmask(scheduled)
        self.runner.launch(scheduled)
        return []


def test_the_masks_column_leaves_out_the_wait_inside_them():
    core = _FakeCore()
    tracer = step_trace.StepTracer(core)
    try:
        core.step()
    finally:
        step_trace._unwrap(core)
    (step,) = tracer.finish()
    assert step["wait"] >= 19.9 and step["masks"] >= 9.9 and step["masked"] and step["tokens"] == 3
    # counted once: the masks and the wait inside them both fit in the launch that ran them
    assert step["launch"] + 0.5 >= step["masks"] + step["wait"]


def test_a_full_collection_inside_a_step_is_charged_to_it_and_the_tracer_comes_off():
    import gc

    from deepserve.layers import sampling_metadata
    from deepserve.runner import model_runner

    originals = (model_runner.prepare_inputs, sampling_metadata.bitmask_tensor,
                 sampling_metadata.SamplingMetadata.build)
    core = _FakeCore()
    tracer = step_trace.StepTracer(core)
    assert model_runner.prepare_inputs is not originals[0]  # timed while the tracer is on
    real_wait = core.runner.wait
    core.runner.wait = lambda pending: (gc.collect(), real_wait(pending))
    try:
        core.step()
        core.runner.wait = real_wait
        core.step()
    finally:
        step_trace._unwrap(core)
    first, second = tracer.finish()
    assert first["gc"] > 0 and first["gc_full"] >= 1 and "gc_full" not in second
    assert (model_runner.prepare_inputs, sampling_metadata.bitmask_tensor,
            sampling_metadata.SamplingMetadata.build) == originals
    assert not any(getattr(c, "step_tracer", False) for c in gc.callbacks)


def test_sync_watch_counts_synchronizing_calls_by_the_site_that_made_them(capsys):
    watch = step_trace.SyncWatch(False)
    watch.enabled = True  # CUDA-only in use; the counting is plain Python
    passed_on = []
    watch._shown = lambda message, *args: passed_on.append(str(message))
    # two call sites in a file under bench/ (the frames the watch keeps), compiled from source here
    call = "    record(UserWarning('called a synchronizing CUDA operation'), UserWarning, 'x', 1)\n"
    source = f"def first(record):\n{call}def second(record):\n{call}"
    sites: dict = {}
    exec(compile(source, "/repo/bench/fake_site.py", "exec"), sites)
    for _ in range(3):
        sites["first"](watch._record)
    sites["second"](watch._record)
    watch._record(UserWarning("a deprecation"), DeprecationWarning, "x", 3)  # not a sync: shown, not counted
    counts = {frames[-1]: n for (_, frames), n in watch.sites.items()}
    assert counts == {"fake_site.py:2 first": 3, "fake_site.py:4 second": 1}
    assert passed_on == ["a deprecation"]
    watch.report()
    out = capsys.readouterr().out
    assert "4 at 2 sites" in out and "fake_site.py:2 first" in out
