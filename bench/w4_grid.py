"""W4 of BENCHMARKS.md on one GPU: the fixed-shape grid, every request of a shape queued at once
(ISL/OSL 128/128 x 3,000, 1000/1000 x 1,000, 2048/128 x 1,000, 128/2048 x 500), with output tok/s, the
peak batch and the peak KV-cache usage of each shape's run. One engine per max_num_seqs value, each in a
process of its own (two 7B engines do not fit one card at 0.9 utilisation); with two values, the table
ends with the scaling ratio per shape (BENCHMARKS.md: V2-Lite at batch 256 >= 3x its batch-64 throughput).

    python bench/w4_grid.py --model deepseek-v2-lite --max-num-seqs 64,256    # the H200 run
    python bench/w4_grid.py --smoke --max-num-seqs 2,4                        # CPU, the demo model, tiny grid

Dummy weights, bf16, max_model_len 4096, defaults otherwise. JSON to $OUT/w4-<model>.json when OUT is set;
the table comes last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

GRID = [(128, 128, 3000), (1000, 1000, 1000), (2048, 128, 1000), (128, 2048, 500)]
SMOKE_GRID = [(16, 8, 6), (32, 16, 4)]


def pick_shapes(spec: str | None, smoke: bool) -> list[tuple[int, int, int]]:
    """The grid's rows named by --shapes ("128/128,2048/128"), in the grid's order; all when None."""
    grid = SMOKE_GRID if smoke else GRID
    if spec is None:
        return grid
    wanted = set(spec.split(","))
    known = {f"{isl}/{osl}" for isl, osl, _ in grid}
    if not wanted <= known:
        raise ValueError(f"--shapes: {', '.join(sorted(wanted - known))} not in the grid ({', '.join(sorted(known))})")
    return [row for row in grid if f"{row[0]}/{row[1]}" in wanted]


def run_engine(model: str, max_num_seqs: int, smoke: bool, shapes: str | None = None) -> list[dict]:
    """One engine, the grid's shapes (or those --shapes names) in order; a row per shape."""
    from deepserve import LLM
    from deepserve.bench import workloads
    from deepserve.bench.throughput import measure_throughput

    if smoke:
        llm = LLM(device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=512, load_format="dummy",
                  max_num_seqs=max_num_seqs)
    else:
        llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
                  max_num_seqs=max_num_seqs)
    vocab = llm.llm_engine.config.model.hf_config.vocab_size
    rows = []
    for isl, osl, n in pick_shapes(shapes, smoke):
        result = measure_throughput(llm, workloads.within_vocab(workloads.fixed(isl, osl, n), vocab))
        rows.append({"max_num_seqs": max_num_seqs, "input_len": isl, "output_len": osl, "num_requests": n,
                     **{k: result[k] for k in ("output_tokens_per_second", "elapsed_time", "peak_batch",
                                               "peak_kv_cache_usage", "num_preemptions", "device")}})
    return rows


def child(model: str, max_num_seqs: int, smoke: bool, shapes: str | None = None) -> list[dict]:
    cmd = [sys.executable, __file__, "--model", model, "--child", str(max_num_seqs)] + (["--smoke"] if smoke else [])
    cmd += ["--shapes", shapes] if shapes else []
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"the engine with max_num_seqs={max_num_seqs} failed (exit code {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(model: str, rows: list[dict]) -> list[str]:
    lines = [f"W4, {model}, {rows[0]['device']}",
             "| max_num_seqs | ISL/OSL x requests | out tok/s | elapsed s | peak batch | peak KV usage | preemptions |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['max_num_seqs']} | {r['input_len']}/{r['output_len']} x {r['num_requests']:,} | "
                     f"{r['output_tokens_per_second']:,.0f} | {r['elapsed_time']:.1f} | {r['peak_batch']} | "
                     f"{r['peak_kv_cache_usage']:.1%} | {r['num_preemptions']} |")
    sizes = sorted({r["max_num_seqs"] for r in rows})
    if len(sizes) > 1:
        small, large = sizes[0], sizes[-1]
        by = {(r["max_num_seqs"], r["input_len"], r["output_len"]): r["output_tokens_per_second"] for r in rows}
        for r in rows:
            if r["max_num_seqs"] == large:
                shape = (r["input_len"], r["output_len"])
                lines.append(f"scaling {shape[0]}/{shape[1]}: max_num_seqs {large} / {small} = "
                             f"{by[(large, *shape)] / by[(small, *shape)]:.2f}x")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deepseek-v2-lite", help="a preset (dummy weights)")
    parser.add_argument("--max-num-seqs", default="256", help="comma-separated: one engine per value")
    parser.add_argument("--smoke", action="store_true", help="CPU, the demo model, a tiny grid")
    parser.add_argument("--shapes", help="comma-separated ISL/OSL of the grid to run, e.g. 128/128,2048/128 "
                        "(the whole grid at batch 64 does not fit one 10-minute device call)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    try:
        pick_shapes(ns.shapes, ns.smoke)
    except ValueError as e:
        parser.error(str(e))
    if ns.child:  # one engine; its rows as JSON on the last line
        print(json.dumps(run_engine(ns.model, ns.child, ns.smoke, ns.shapes)))
        return 0
    try:
        sizes = [int(v) for v in ns.max_num_seqs.split(",")]
    except ValueError:
        parser.error("--max-num-seqs takes comma-separated integers, e.g. 64,256")
    if any(v < 1 for v in sizes):
        parser.error("--max-num-seqs values must be at least 1")
    rows = [row for size in sizes for row in child(ns.model, size, ns.smoke, ns.shapes)]
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"w4-{ns.model}.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(table("demo" if ns.smoke else ns.model, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
