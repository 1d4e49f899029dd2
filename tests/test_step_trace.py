"""bench/step_trace.py on the demo model (CPU): every step's host phases are recorded where they ran, the
masks' time only on constrained steps, and the wrappers come off so a second trace sees plain methods."""

from __future__ import annotations

import argparse
import importlib.util
import sys
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
    return argparse.Namespace(**{"smoke": True, "json_schema": False, "profile": 0, **kw})


def test_w1_trace_records_each_steps_phases_and_the_masks_where_rows_are_constrained(capsys):
    llm = gate.make_llm(gate.ModelRun("trace", None, w2=False, json_schema=True))
    report = step_trace.trace_w1(llm, _ns(json_schema=True))
    launched = [s for s in report["steps"] if "graph" in s]
    assert launched and report["w1"] > 0
    for step in launched:
        # the step's parts were timed inside it: none longer than the step itself
        assert step["wall"] >= step["launch"] >= step["forward_launch"] > 0
        assert step["schedule"] > 0 and step["tokens"] > 0
    masked = [s for s in launched if s.get("masked")]
    assert masked and all(s["masks"] > 0 for s in masked)  # every request carries the schema
    kinds = {row["kind"]: row for row in report["summary"]}
    assert kinds["all"]["steps"] == len(launched)
    assert sum(row["steps"] for kind, row in kinds.items() if kind != "all") == len(launched)
    assert "W1 + JSON schema" in capsys.readouterr().out


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
