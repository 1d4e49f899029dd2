"""Same-machine A/B: W1 (and W2 where the run has it) of a base tree and newer trees, one engine process
per tree and repeat, the trees' order reversed on every other repeat, so slow drift of the machine
cancels. Why: fresh H200 machines read W1 3.6 % apart for Qwen and 10 % for V2-Lite with identical GPU
code (bench/RESULTS.md, gate runs 1-5), so the absolute gate (bench/gate.py, against baseline.json)
cannot judge a W1 step of a few % on them; this can.

    bash bench/ab_trees.sh BASE NEW            # here: the trees, in .ab/ (carried to the device)
    bash bench/gate.sh ab [--runs r1-distill-qwen-7b,deepseek-llm-7b] [--repeats 2]   # device, carry .ab
    python bench/ab.py --trees A B --runs demo --smoke --out DIR                        # CPU plumbing

A new tree's figure is a REGRESSION when its median is more than its tolerance worse than the base's
(AB_TOLERANCE; TTFT the gate's 15 %) and none of its repeats is as good as the base's worst (the two
ranges do not overlap). Budget: 560 s a call; with two repeats of Qwen and LLM-7B over two trees the
estimate (each run's timeout) can skip the last run; --repeats 1 or one run then.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gate  # noqa: E402  (bench/gate.py: run definitions, the per-model step)

# Same machine, alternating order. Evidence so far is thin: one tree (8ac8ba1, LLM-7B W1) read 5,588 and
# 5,632 on one machine (0.8 % apart; RESULTS.md, gate run 5); Qwen and V2-Lite have no same-machine repeats
# yet. TTFT, one batch-1 prefill's median, moved 25-40 ms on one machine: it keeps the gate's 15 %.
AB_TOLERANCE = 0.015
METRICS = {"w1": True, "tpot": False, "ttft": False}  # metric -> higher is better
TOLERANCE = {"w1": AB_TOLERANCE, "tpot": AB_TOLERANCE, "ttft": gate.TTFT_TOLERANCE}


def run_ab(trees: list[Path], runs: list[gate.ModelRun], repeats: int, out: Path, smoke: bool) -> dict:
    """{run: {tree: {metric: [values per repeat]}}}; a step past its timeout or the budget is left out."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    values: dict = {r.name: {t.name: {} for t in trees} for r in runs}
    for rep in range(repeats):
        for run in runs:
            for tree in trees if rep % 2 == 0 else trees[::-1]:
                if not smoke and time.perf_counter() - gate.PROCESS_START + run.timeout_s > gate.BUDGET_S:
                    print(f"skipped {run.name} on {tree.name}, repeat {rep + 1}: past the {gate.BUDGET_S} s budget")
                    continue
                path = out / f"{run.name}-{tree.name}-{rep}.json"
                cmd = [sys.executable, str(gate.ROOT / "bench" / "gate.py"), "model", run.name, "--json", str(path),
                       "--tree", str(tree)] + (["--smoke"] if smoke else [])
                path_env = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH", "")) if p)  # wheels stay
                rc, tail = gate._step(cmd, run.timeout_s, out / f"{run.name}-{tree.name}-{rep}.log",
                                      {**env, "PYTHONPATH": path_env})
                if rc != 0 or not path.exists():
                    print(f"{run.name} on {tree.name}, repeat {rep + 1}: FAILED (rc={rc})\n{tail}")
                    continue
                data = json.loads(path.read_text())
                for metric in METRICS:
                    if metric in data:
                        values[run.name][tree.name].setdefault(metric, []).append(data[metric])
    return values


def judge(base: list[float], new: list[float], higher_is_better: bool,
          tolerance: float = AB_TOLERANCE) -> tuple[str, float]:
    """(verdict, median change as a fraction) of a new tree's repeats against the base tree's."""
    if not base or not new:
        return "MISSING", 0.0
    b, n = statistics.median(base), statistics.median(new)
    change = (n - b) / b
    worse = -change if higher_is_better else change
    overlap = max(new) >= min(base) if higher_is_better else min(new) <= max(base)
    if worse > tolerance and not overlap:
        return "REGRESSION", change
    if worse > tolerance:
        return "worse, ranges overlap", change
    return "ok", change


def table(values: dict, trees: list[str]) -> tuple[list[str], bool]:
    base, ok = trees[0], True
    lines = [f"A/B on one machine; base {base}", f"{'run':26} {'metric':6} {'tree':18} {'median':>9} "
             f"{'repeats':28} {'change':>8}  verdict"]
    for run, per_tree in values.items():
        for metric, higher in METRICS.items():
            if metric not in per_tree[base]:
                continue
            for tree in trees:
                got = per_tree[tree].get(metric, [])
                shown = " ".join(gate._num(v) for v in got)
                if tree == base:
                    lines.append(f"{run:26} {metric:6} {tree:18} {_median(got):>9} {shown:28} {'':>8}  base")
                    continue
                verdict, change = judge(per_tree[base][metric], got, higher, TOLERANCE[metric])
                ok = ok and verdict not in ("REGRESSION", "MISSING")
                lines.append(f"{run:26} {metric:6} {tree:18} {_median(got):>9} {shown:28} "
                             f"{100 * change:+7.1f}%  {verdict}")
    lines.append("A/B PASSED" if ok else "A/B FAILED")
    return lines, ok


def _median(v: list[float]) -> str:
    return gate._num(statistics.median(v)) if v else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", help="tree folders, base first (default: .ab/*, from ab_trees.sh)")
    ap.add_argument("--runs", default="r1-distill-qwen-7b,deepseek-llm-7b", help="gate run names, comma-separated")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU: the demo model and a tiny workload")
    ns = ap.parse_args()
    trees = ([Path(t).resolve() for t in ns.trees] if ns.trees  # ab_trees.sh's order prefix, numerically
             else sorted((gate.ROOT / ".ab").glob("*"), key=lambda p: int(p.name.split("-")[0])))
    if len(trees) < 2:
        raise SystemExit("ab needs a base tree and at least one more (bash bench/ab_trees.sh BASE NEW)")
    known = {r.name: r for r in gate.ALL_RUNS} | {"demo": gate.ModelRun("demo", None, w2=True, timeout_s=300)}
    unknown = [n for n in ns.runs.split(",") if n not in known]
    if unknown:
        raise SystemExit(f"--runs: unknown {unknown}; known: {', '.join(known)}")
    runs = [known[n] for n in ns.runs.split(",")]
    values = run_ab(trees, runs, ns.repeats, Path(ns.out), ns.smoke)
    (Path(ns.out) / "ab.json").write_text(json.dumps({"trees": [t.name for t in trees], "values": values}, indent=1))
    lines, ok = table(values, [t.name for t in trees])
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
