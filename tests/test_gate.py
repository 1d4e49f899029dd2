"""bench/gate.py's verdicts: a figure more than 3 % worse than the baseline (in its own direction) is a
regression and fails the gate, as do a failed check and a gated figure the baseline has but the run lost;
time to ready is shown, never gated. Plus the whole gate on the CPU (demo model, tiny workloads)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gate", ROOT / "bench" / "gate.py")
gate = importlib.util.module_from_spec(spec)
sys.modules["gate"] = gate  # dataclasses look their module up there
spec.loader.exec_module(gate)

BASE = {"commit": "abc", "figures": {"r1-distill-qwen-7b/w1": 10_000.0, "deepseek-llm-7b/tpot": 4.0,
                                     "deepseek-llm-7b/ready": 20.0, "deepseek-llm-7b/ttft": 20.0}}


def figs(changes: dict) -> dict:
    return {**BASE["figures"], **changes}


def verdicts(figures: dict, checks: dict | None = None) -> tuple[dict[str, str], bool]:
    lines, ok = gate.compare({"figures": figures, "checks": checks or {}}, BASE)
    labels = {f.label: f.key for f in gate.FIGURES}
    found = {}
    for line in lines:
        for label, key in labels.items():
            if line.startswith(label + " "):
                found[key] = line.rsplit("  ", 1)[-1].strip()
    return found, ok


def test_within_tolerance_passes_and_beyond_fails_in_each_direction():
    found, ok = verdicts(figs({"r1-distill-qwen-7b/w1": 9_800.0, "deepseek-llm-7b/tpot": 4.1}))
    assert ok and found["r1-distill-qwen-7b/w1"] == "ok" and found["deepseek-llm-7b/tpot"] == "ok"
    found, ok = verdicts(figs({"r1-distill-qwen-7b/w1": 9_600.0}))
    assert not ok and found["r1-distill-qwen-7b/w1"] == "REGRESSION"  # 4 % fewer tokens/s
    found, ok = verdicts(figs({"deepseek-llm-7b/tpot": 4.2}))
    assert not ok and found["deepseek-llm-7b/tpot"] == "REGRESSION"  # 5 % slower per token


def test_targets_missing_figures_checks_and_ungated_ready():
    found, ok = verdicts(figs({"r1-distill-qwen-7b/w1": 13_500.0, "deepseek-llm-7b/tpot": 3.3,
                               "deepseek-llm-7b/ready": 40}))
    assert ok, "time to ready is not gated"
    assert found["r1-distill-qwen-7b/w1"] == "ok target met" and found["deepseek-llm-7b/ready"] == "worse (not gated)"
    found, ok = verdicts(figs({"deepseek-llm-7b/ttft": 25.0}))
    assert not ok and found["deepseek-llm-7b/ttft"] == "REGRESSION target met"  # under 30 ms, 25 % over 20 ms
    found, ok = verdicts(figs({"deepseek-llm-7b/ttft": 22.0}))  # TTFT is judged at 15 %: 10 % over is noise
    assert ok and found["deepseek-llm-7b/ttft"] == "ok target met"
    found, ok = verdicts({"deepseek-llm-7b/tpot": 3.9})
    assert not ok and found["r1-distill-qwen-7b/w1"] == "MISSING"
    _, ok = verdicts(BASE["figures"], {"greedy": "FAIL (rc=1)"})
    assert not ok


def test_a_result_is_judged_against_the_baseline_of_its_own_gpu(tmp_path):
    # An H100's figures against the H200's would all read as regressions: another GPU gets its own file
    # beside the default, and with none its figures are new (only the checks are judged).
    h200 = {**BASE, "gpu": "NVIDIA H200"}
    default = tmp_path / "baseline.json"
    default.write_text(json.dumps(h200))
    assert gate.baseline_for("NVIDIA H200", default) == h200
    h100 = "NVIDIA H100 80GB HBM3"
    assert gate.baseline_name(h100) == "baseline-nvidia-h100-80gb-hbm3.json"
    assert gate.baseline_for(h100, default) is None
    result = {"gpu": h100, "checks": {"greedy": "PASS"}, "figures": figs({"r1-distill-qwen-7b/w1": 7_000.0})}
    (tmp_path / "result.json").write_text(json.dumps(result))
    compare = [sys.executable, str(ROOT / "bench" / "gate.py"), "compare", str(tmp_path / "result.json"),
               "--baseline", str(default)]
    proc = subprocess.run(compare, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.startswith(f"no baseline for {h100}"), proc.stdout + proc.stderr
    assert "bench/baseline-nvidia-h100-80gb-hbm3.json" in proc.stdout and "GATE PASSED" in proc.stdout
    default.write_text(json.dumps(BASE))  # a baseline that names no GPU judges nothing
    assert gate.baseline_for("NVIDIA H200", default) is None and gate.baseline_for(h100, default) is None
    (tmp_path / gate.baseline_name(h100)).write_text(json.dumps({**BASE, "gpu": h100}))
    assert gate.baseline_for(h100, default)["gpu"] == h100
    proc = subprocess.run(compare, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 1 and "REGRESSION" in proc.stdout, proc.stdout  # 30 % under its own baseline


def test_a_run_the_gpu_lacks_memory_for_is_skipped_and_named_not_failed(tmp_path, monkeypatch):
    # The V3 slice in bf16 needs an H200: on an H100 the gate says so and judges the rest.
    assert next(r for r in gate.RUNS if r.name == "v3-slice8").min_gpu_gib > 79.6  # an H100's, by nvidia-smi
    big = gate.ModelRun("big", "deepseek-v3", w2=False, min_gpu_gib=120)
    monkeypatch.setitem(gate.SUITES, "all", ([], [big]))
    monkeypatch.setattr(gate, "_gpu_gib", lambda: 79.6)
    monkeypatch.setattr(gate, "_gpu", lambda: "NVIDIA H100 80GB HBM3")
    result = gate.run_all(tmp_path, smoke=False)
    assert result["checks"] == {"run big": "not on this GPU (needs 120 GiB, has 79.6)"} and result["figures"] == {}
    assert gate.compare(result, None)[1]
    assert not gate.compare({**result, "checks": {"run big": "SKIPPED (would pass the 560 s budget)"}}, None)[1]


def test_the_whole_gate_runs_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gate.py"), "all", "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "gate.json").read_text())
    assert result["checks"] == {"run demo": "PASS"}
    assert result["figures"]["demo/w1"] > 0 and result["figures"]["demo/tpot"] > 0
    assert result["startup_s"]["demo"]["load"] > 0
    w1 = result["details"]["demo"]["w1"]  # what explains the figure travels in gate.json too
    assert w1["engine_steps"] > 0 and w1["peak_batch"] >= 1
    assert proc.stdout.strip().endswith("GATE PASSED")
    candidate = json.loads((tmp_path / "baseline-candidate.json").read_text())
    assert candidate["figures"] == result["figures"]


def test_a_suite_is_judged_on_its_own_runs_only():
    # The FP8 suite runs none of the bf16 models: their baseline figures are not MISSING there.
    result = {"runs": ["v3-slice8-fp8"], "figures": {"v3-slice8-fp8/w1": 5_000.0}, "checks": {}}
    lines, ok = gate.compare(result, BASE)
    assert ok and not any(line.startswith("W1 R1-Distill") for line in lines)
    assert any(line.startswith("FP8 W1 V3 8-layer slice") and line.endswith("new target met") for line in lines)
    lost = {"runs": ["r1-distill-qwen-7b", "deepseek-llm-7b"], "figures": {}, "checks": {}}
    assert not gate.compare(lost, BASE)[1]  # the bf16 suite still fails on its lost figures
    assert {r.name for r in gate.ALL_RUNS} == {
        f.key.split("/")[0] for f in gate.FIGURES}


def test_the_int4_suite_judges_the_issue_targets():
    # LLM-7B AWQ TPOT 1.7 ms misses the 1.6 ms target (reported, not a regression: no baseline yet);
    # V2-Lite's 1.5 ms meets it. The suite runs the int4 kernel and engine checks first.
    assert gate.SUITES["int4"][1] == gate.INT4_RUNS and all(r.quantization == "awq" for r in gate.INT4_RUNS)
    assert [cmd[1] for _, cmd, _ in gate.INT4_CHECKS] == ["bench/check_int4.py", "bench/check_int4_engine.py"]
    result = {"runs": [r.name for r in gate.INT4_RUNS], "checks": {},
              "figures": {"deepseek-llm-7b-awq/tpot": 1.7, "deepseek-v2-lite-awq/tpot": 1.5}}
    lines, ok = gate.compare(result, BASE)
    assert ok and not any(line.startswith("W1 R1-Distill") for line in lines)
    assert any(line.startswith("INT4 W2 TPOT DeepSeek-LLM-7B") and line.endswith("new") for line in lines)
    assert any(line.startswith("INT4 W2 TPOT DeepSeek-V2-Lite") and line.endswith("new target met") for line in lines)


def _ab():
    spec = importlib.util.spec_from_file_location("ab", ROOT / "bench" / "ab.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["ab"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_ab_verdict_needs_a_step_beyond_tolerance_and_ranges_that_do_not_overlap():
    ab = _ab()

    assert ab.judge([5681, 5700], [5632, 5650], True)[0] == "ok"  # -0.9 %: inside one machine's repeats
    verdict, change = ab.judge([5700, 5720], [5500, 5560], True)
    assert verdict == "REGRESSION" and round(100 * change, 2) == -3.15  # medians 5,710 and 5,530
    assert ab.judge([5700, 5720], [5500, 5710], True)[0] == "worse, ranges overlap"
    assert ab.judge([4.40, 4.45], [4.60, 4.62], False)[0] == "REGRESSION"  # TPOT: lower is better
    assert ab.judge([4.40, 4.45], [4.30, 4.31], False)[0] == "ok"
    assert ab.judge([4.40], [], False)[0] == "MISSING"
    # TTFT keeps the gate's 15 %: 27 -> 29 ms (+7 %) with no overlap is not a regression there.
    lines, ok = ab.table({"demo": {"base": {"ttft": [26.0, 27.0]}, "new": {"ttft": [29.0, 29.5]}}}, ["base", "new"])
    assert ok and lines[-2].endswith("ok")
    lines, ok = ab.table({"demo": {"base": {"w1": [100.0, 102.0]}, "new": {"w1": [90.0, 91.0]}}}, ["base", "new"])
    assert not ok and lines[-1] == "A/B FAILED" and "REGRESSION" in lines[-2]


def test_ab_shows_a_json_runs_ratio_beside_its_figures():
    ab = _ab()
    assert ab.json_ratio({"w1": 4780.0, "w1_same_lengths": 5483.0}) == {"json_ratio_pct": 100 * 4780 / 5483}
    assert ab.json_ratio({"w1": 4780.0}) == {} and ab.json_ratio({"w1": None, "w1_same_lengths": 1.0}) == {}
    values = {"json": {"base": {"w1": [4780.0], "json_ratio_pct": [87.18]}, "new": {"w1": [5000.0],
                                                                                   "json_ratio_pct": [91.2]}}}
    lines, _ = ab.table(values, ["base", "new"])
    assert [line.split()[2:4] for line in lines if "ratio" in line] == [["base", "87.18"], ["new", "91.20"]]


def test_ab_runs_each_tree_from_its_own_copy_on_cpu(tmp_path):
    # Two trees, the second a copy of deepserve elsewhere: each engine imports deepserve from its own tree.
    import shutil

    base, new = tmp_path / "0-base", tmp_path / "1-new"
    base.mkdir()
    (base / "deepserve").symlink_to(ROOT / "deepserve")
    shutil.copytree(ROOT / "deepserve", new / "deepserve", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "ab.py"), "--trees", str(base), str(new),
                           "--runs", "demo", "--repeats", "1", "--smoke", "--out", str(out),
                           "--env", "warm:DEEPSERVE_PREFILL_WARMUP=1,DEEPSERVE_FUSED_SAMPLING=0", "--w1-repeats", "2"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert "A/B" in proc.stdout, proc.stdout + proc.stderr
    result = json.loads((out / "ab.json").read_text())
    values = result["values"]["demo"]
    assert values["0-base"]["w1"][0] > 0 and values["1-new"]["w1"][0] > 0 and values["1-new"]["tpot"][0] > 0
    assert values["1-new+warm"]["w1"][0] > 0 and values["1-new+warm"]["ready"][0] > 0
    assert values["1-new"]["w1_2nd"][0] > 0  # shown: this tree emptied the prefix cache before it
    assert json.loads((out / "demo-1-new-0.json").read_text())["w1_runs_prefix_cache_reset"] is True
    # On CPU no Triton kernel is compiled or watched: no compile counts rather than zeros.
    assert "w1_compiles" not in values["1-new"] and "w1_2nd_compiles" not in values["1-new"]
    assert result["env"]["1-new+warm"] == {"DEEPSERVE_PREFILL_WARMUP": "1", "DEEPSERVE_FUSED_SAMPLING": "0"}
    assert json.loads((out / "demo-1-new-0.json").read_text())["tree"] == str(new.resolve())
    assert json.loads((out / "demo-0-base-0.json").read_text())["tree"] == str(ROOT)  # through its link
    # The variant is the last tree run with its variables; the others run without them.
    warm = json.loads((out / "demo-1-new+warm-0.json").read_text())
    assert warm["tree"] == str(new.resolve())
    assert warm["deepserve_env"] == {"DEEPSERVE_PREFILL_WARMUP": "1", "DEEPSERVE_FUSED_SAMPLING": "0"}
    assert "DEEPSERVE_PREFILL_WARMUP" not in json.loads((out / "demo-1-new-0.json").read_text())["deepserve_env"]
    assert any(line.split()[:3] == ["demo", "w1", "1-new+warm"] for line in proc.stdout.splitlines())


def test_ab_env_variants_are_named_after_the_last_tree_and_checked():
    ab = _ab()
    from pathlib import Path as P

    got = ab.variants_of([P("/x/0-a"), P("/x/1-b")], ["on:A=1,B=2"])
    assert [(v.name, v.tree.name, v.env) for v in got] == [
        ("0-a", "0-a", ()), ("1-b", "1-b", ()), ("1-b+on", "1-b", (("A", "1"), ("B", "2")))]
    assert [v.name for v in ab.variants_of([P("/x/main")], ["on:A=1"])] == ["main", "main+on"]  # one tree
    for bad in ("A=1", "on:", "on:A", ":A=1"):
        with pytest.raises(SystemExit, match="LABEL:VAR=VALUE"):
            ab.variants_of([P("/x/main")], [bad])
    with pytest.raises(SystemExit, match="own label"):
        ab.variants_of([P("/x/main")], ["on:A=1", "on:A=2"])


def test_the_structured_suite_runs_plain_and_constrained_w1_side_by_side(tmp_path):
    runs = gate.SUITES["structured"][1]
    assert [(r.preset, r.json_schema) for r in runs] == [("r1-distill-qwen-7b", False), ("r1-distill-qwen-7b", True)]
    # Judged against the same lengths unconstrained (a grammar ends requests early); plain W1 for reference.
    result = {"runs": [r.name for r in runs], "checks": {},
              "figures": {"r1-distill-qwen-7b/w1": 12_000.0, "r1-distill-qwen-7b-json/w1": 4_600.0,
                          "r1-distill-qwen-7b-json/w1_same_lengths": 5_000.0}}
    lines, ok = gate.compare(result, BASE)
    assert ok and any(line.startswith("W1 R1-Distill-Qwen-7B, JSON schema") and line.endswith("new") for line in lines)
    assert any(line.startswith("W1 JSON schema / same lengths") and "0.920" in line and line.endswith("target met")
               for line in lines)
    assert any(line.startswith("W1 JSON schema / plain W1") and "0.383" in line and line.rstrip().endswith("-")
               for line in lines)  # reported, not judged
    result["figures"]["r1-distill-qwen-7b-json/w1"] = 4_250.0
    lines, ok = gate.compare(result, BASE)
    assert ok and any(line.startswith("W1 JSON schema / same lengths") and line.endswith("below target")
                      for line in lines)
    # The constrained engine runs on CPU: the demo model's own tokenizer, a schema on every request; then
    # the same prompts unconstrained at the lengths the constrained run made.
    got = gate.run_model(gate.ModelRun("demo", None, w2=False, json_schema=True), smoke=True)
    assert got["w1"] > 0 and got["w1_detail"]["num_requests"] == 8  # workloads.fixed(32, 8, 8)
    lengths = got["w1_detail"]["output_lengths"]
    assert len(lengths) == 8 and got["w1_same_lengths_detail"]["num_output_tokens"] == sum(lengths)
    assert got["w1_same_lengths_detail"]["workload"].endswith("+lengths") and got["w1_same_lengths"] > 0
    # and the schema run once more after it, the same requests (json), judged by a ratio of its own
    assert got["w1_2nd_detail"]["workload"] == got["w1_detail"]["workload"] and got["w1_2nd"] > 0
    assert got["w1_2nd_detail"]["num_requests"] == 8
    result["figures"]["r1-distill-qwen-7b-json/w1_2nd"] = 4_700.0
    lines, _ = gate.compare(result, BASE)
    assert any(line.startswith("the same, the schema's second run") and "0.940" in line
               and line.endswith("target met") for line in lines)


def test_every_suite_is_reachable_from_gate_sh_and_its_check_scripts_exist():
    text = (ROOT / "bench" / "gate.sh").read_text()
    case = next(line for line in text.splitlines() if line.startswith('case "$1" in all|'))
    names = case.split(" in ", 1)[1].split(")", 1)[0].split("|")
    assert sorted(names) == sorted(gate.SUITES)
    for checks, _ in gate.SUITES.values():
        for _name, cmd, _timeout in checks:
            script = next(part for part in cmd if part.startswith("bench/"))
            assert (ROOT / script).is_file(), script
    switches = [cmd for _, cmd, _ in gate.SUITES["switches"][0]]
    assert ["env", "DEEPSERVE_TRITON_ELEMENTWISE=1"] == switches[1][:2]
    assert ["env", "DEEPSERVE_PREFILL_WARMUP=1"] == switches[2][:2]


def test_a_w1_repeat_empties_the_prefix_cache_first_or_stops():
    calls = []

    class FakeLLM:
        def __init__(self, resets: bool) -> None:
            self.resets = resets

        def reset_prefix_cache(self) -> bool:
            calls.append("reset")
            return self.resets

    def measure(llm, workload):
        calls.append("measure")
        return {"output_tokens_per_second": 1.0}

    assert gate._w1_again(FakeLLM(True), None, measure) == {"output_tokens_per_second": 1.0}
    assert calls == ["reset", "measure"]
    with pytest.raises(RuntimeError, match="prefix cache could not be reset"):
        gate._w1_again(FakeLLM(False), None, measure)
    calls.clear()
    gate._w1_again(object(), None, measure)  # an older tree's LLM has no reset: measured as it is
    assert calls == ["measure"]
