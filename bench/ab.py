"""Same-machine A/B: W1 (and W2 where the run has it) of a base tree and newer trees, one engine process
per tree and repeat, the trees' order reversed on every other repeat, so slow drift of the machine
cancels. Why: fresh H200 machines read W1 3.6 % apart for Qwen and 10 % for V2-Lite with identical GPU
code (bench/RESULTS.md, gate runs 1-5), so the absolute gate (bench/gate.py, against baseline.json)
cannot judge a W1 step of a few % on them; this can.

    bash bench/ab_trees.sh BASE NEW            # here: the trees, in .ab/ (carried to the device)
    bash bench/gate.sh ab [--runs r1-distill-qwen-7b,deepseek-llm-7b] [--repeats 2]   # device, carry .ab
    python bench/ab.py --trees A B --runs demo --smoke --out DIR                        # CPU plumbing
    bash bench/gate.sh ab --trees . --env warm:DEEPSERVE_PREFILL_WARMUP=1               # a switch, one tree

--env LABEL:VAR=VALUE[,VAR=VALUE] (repeatable) adds the last tree run with those variables as one more
variant, judged against the base like a tree: how a switch that is off by default is measured before it
is turned on. Time to ready and the kernels compiled inside W1 are shown beside, not judged.

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
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gate  # noqa: E402  (bench/gate.py: run definitions, the per-model step)

# Same machine, alternating order. Evidence so far is thin: one tree (8ac8ba1, LLM-7B W1) read 5,588 and
# 5,632 on one machine (0.8 % apart; RESULTS.md, gate run 5); Qwen and V2-Lite have no same-machine repeats
# yet. TTFT, one batch-1 prefill's median, moved 25-40 ms on one machine: it keeps the gate's 15 %.
AB_TOLERANCE = 0.015
METRICS = {"w1": True, "tpot": False, "ttft": False}  # metric -> higher is better
TOLERANCE = {"w1": AB_TOLERANCE, "tpot": AB_TOLERANCE, "ttft": gate.TTFT_TOLERANCE}


# Shown, not judged: time to ready; Triton kernels compiled inside W1; with --w1-repeats, W1 run again in
# the same engine (w1_2nd) and its compiles.
# A JSON-schema run (r1-distill-qwen-7b-json) adds its unconstrained W1 at the same lengths and the gate's
# ratio of the two, in percent.
INFO = ("ready", "w1_compiles", "w1_2nd", "w1_2nd_compiles", "w1_same_lengths", "json_ratio_pct")
INFO_LABELS = {"ready": "ready s", "w1_compiles": "w1 jit", "w1_2nd": "w1 2nd", "w1_2nd_compiles": "2nd jit",
               "w1_same_lengths": "same len", "json_ratio_pct": "ratio%"}


@dataclass(frozen=True)
class Variant:
    name: str
    tree: Path
    env: tuple[tuple[str, str], ...] = ()


def variants_of(trees: list[Path], env_specs: list[str]) -> list[Variant]:
    """One variant per tree, then the last tree once per --env spec 'LABEL:VAR=VALUE[,VAR=VALUE]'."""
    found = [Variant(t.name, t) for t in trees]
    for spec in env_specs:
        label, sep, assignments = spec.partition(":")
        pairs = [a.partition("=") for a in assignments.split(",") if a]
        if not sep or not label or not pairs or any(not name or not eq for name, eq, _ in pairs):
            raise SystemExit(f"--env {spec!r}: expected LABEL:VAR=VALUE[,VAR=VALUE]")
        found.append(Variant(f"{trees[-1].name}+{label}", trees[-1], tuple((n, v) for n, _, v in pairs)))
    if len({v.name for v in found}) != len(found):
        raise SystemExit("two variants share a name: give each --env its own label")
    return found


def run_ab(variants: list[Variant], runs: list[gate.ModelRun], repeats: int, out: Path, smoke: bool,
           w1_repeats: int = 1) -> dict:
    """{run: {variant: {metric: [values per repeat]}}}; a step past its timeout or the budget is left out."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    values: dict = {r.name: {v.name: {} for v in variants} for r in runs}
    for rep in range(repeats):
        for run in runs:
            for variant in variants if rep % 2 == 0 else variants[::-1]:
                name = variant.name
                if not smoke and time.perf_counter() - gate.PROCESS_START + run.timeout_s > gate.BUDGET_S:
                    print(f"skipped {run.name} on {name}, repeat {rep + 1}: past the {gate.BUDGET_S} s budget")
                    continue
                path = out / f"{run.name}-{name}-{rep}.json"
                cmd = [sys.executable, str(gate.ROOT / "bench" / "gate.py"), "model", run.name, "--json", str(path),
                       "--tree", str(variant.tree)] + (["--smoke"] if smoke else [])
                if w1_repeats > 1:  # this checkout's gate.py runs every tree, so older trees take it too
                    cmd += ["--w1-repeats", str(w1_repeats)]
                path_env = os.pathsep.join(p for p in (str(variant.tree), env.get("PYTHONPATH", "")) if p)  # wheels
                rc, tail = gate._step(cmd, run.timeout_s, out / f"{run.name}-{name}-{rep}.log",
                                      {**env, **dict(variant.env), "PYTHONPATH": path_env})
                if rc != 0 or not path.exists():
                    print(f"{run.name} on {name}, repeat {rep + 1}: FAILED (rc={rc})\n{tail}")
                    continue
                data = json.loads(path.read_text())
                compiles = (data.get("w1_detail") or {}).get("kernel_compiles_during_run")  # older trees: none
                if compiles is not None and compiles.get("watching", True):  # CPU: nothing watched, no count
                    data["w1_compiles"] = compiles["triton_compiles"]
                # A second W1 is shown only where the prefix cache was emptied before it: a tree without
                # LLM.reset_prefix_cache found every W1 prompt cached and timed decode alone.
                if len(data.get("w1_runs", [])) > 1 and data.get("w1_runs_prefix_cache_reset"):
                    data["w1_2nd"] = data["w1_runs"][1]
                    if data["w1_runs_compiles"][1] is not None:  # older trees count no compiles
                        data["w1_2nd_compiles"] = data["w1_runs_compiles"][1]
                data.update(json_ratio(data))
                for metric in (*METRICS, *INFO):
                    if metric in data:
                        values[run.name][name].setdefault(metric, []).append(data[metric])
    return values


def json_ratio(data: dict) -> dict:
    """A JSON-schema run's gate ratio (its W1 over the unconstrained W1 at the same lengths), in percent."""
    if not data.get("w1_same_lengths") or data.get("w1") is None:
        return {}
    return {"json_ratio_pct": 100 * data["w1"] / data["w1_same_lengths"]}


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
    lines = [f"A/B on one machine; base {base}", f"{'run':26} {'metric':7} {'tree':18} {'median':>9} "
             f"{'repeats':28} {'change':>8}  verdict"]
    for run, per_tree in values.items():
        for metric, higher in METRICS.items():
            if metric not in per_tree[base]:
                continue
            for tree in trees:
                got = per_tree[tree].get(metric, [])
                shown = " ".join(gate._num(v) for v in got)
                if tree == base:
                    lines.append(f"{run:26} {metric:7} {tree:18} {_median(got):>9} {shown:28} {'':>8}  base")
                    continue
                verdict, change = judge(per_tree[base][metric], got, higher, TOLERANCE[metric])
                ok = ok and verdict not in ("REGRESSION", "MISSING")
                lines.append(f"{run:26} {metric:7} {tree:18} {_median(got):>9} {shown:28} "
                             f"{100 * change:+7.1f}%  {verdict}")
        for metric in INFO:
            for tree in trees:
                got = per_tree[tree].get(metric, [])
                if got:
                    shown = " ".join(gate._num(v) for v in got)
                    label = INFO_LABELS[metric]
                    lines.append(f"{run:26} {label:7} {tree:18} {_median(got):>9} {shown:28} {'':>8}  (shown)")
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
    ap.add_argument("--w1-repeats", type=int, default=1,
                    help="W1 this many times in each engine; the second is shown beside (w1_2nd), not judged")
    ap.add_argument("--env", action="append", default=[], metavar="LABEL:VAR=VALUE[,VAR=VALUE]",
                    help="the last tree again with these environment variables, as one more variant")
    ns = ap.parse_args()
    trees = ([Path(t).resolve() for t in ns.trees] if ns.trees  # ab_trees.sh's order prefix, numerically
             else sorted((gate.ROOT / ".ab").glob("*"), key=lambda p: int(p.name.split("-")[0])))
    variants = variants_of(trees, ns.env)
    if len(variants) < 2:
        raise SystemExit("ab needs a base and at least one more variant (bash bench/ab_trees.sh BASE NEW, "
                         "or --env)")
    known = {r.name: r for r in gate.ALL_RUNS} | {"demo": gate.ModelRun("demo", None, w2=True, timeout_s=300)}
    unknown = [n for n in ns.runs.split(",") if n not in known]
    if unknown:
        raise SystemExit(f"--runs: unknown {unknown}; known: {', '.join(known)}")
    runs = [known[n] for n in ns.runs.split(",")]
    values = run_ab(variants, runs, ns.repeats, Path(ns.out), ns.smoke, ns.w1_repeats)
    names = [v.name for v in variants]
    (Path(ns.out) / "ab.json").write_text(json.dumps(
        {"trees": names, "env": {v.name: dict(v.env) for v in variants}, "values": values}, indent=1))
    lines, ok = table(values, names)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
