"""The int4 routed experts at decode: kernels/int4_moe_mma.py (the tensor-core GEMV once per assignment) against
fused_moe's int4 tiles, on one H200. Correctness against fused_moe_int4_ref (the dequantized experts), then
µs a call inside CUDA graphs, cycling through CASES distinct routings so the experts' weights come mostly from
HBM (V2-Lite's 6 experts are 26 MB of codes: one routing alone would sit in the 50 MB L2).
    python bench/int4_moe_mma_probe.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_env  # noqa: E402
from check_int4 import errors, moe_case  # noqa: E402

from deepserve.kernels import fused_moe as fm  # noqa: E402
from deepserve.kernels import int4_moe_mma  # noqa: E402

# V3's experts are V3-sized, 16 of them (all 256 would take ~60 GB of host memory to generate)
SHAPES = {"V2-Lite": dict(experts=64, hidden=2048, inter=1408, top_k=6),
          "V3": dict(experts=16, hidden=7168, inter=2048, top_k=8)}
TOKENS = (1, 2, 4, 8, 16)
CASES = 8
TOLERANCE = dict(max_rel=2e-2, norm_rel=1e-2)


def routed(tiles: bool):
    # fused_moe with the mma path off (tiles) or on for every size timed here
    int4_moe_mma.MAX_ASSIGNMENTS = 0 if tiles else 1 << 20
    return fm.fused_moe


def call(tiles: bool, x, w13, w2, tw, ids, experts):
    return routed(tiles)(x, w13, w2, tw, ids, int4=experts)


def routing(t: int, cfg: dict, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # moe_case's inputs without its weights: x, topk_weights, ids
    x = torch.randn(t, cfg["hidden"], device=device, dtype=torch.bfloat16)
    scores = torch.randn(t, cfg["experts"], device=device)
    ids = scores.topk(cfg["top_k"], dim=-1).indices
    return x, scores.gather(1, ids).softmax(-1).float().contiguous(), ids


def check(name: str, cfg: dict, t: int, device, w13, w2, experts) -> dict:
    x, tw, ids = routing(t, cfg, device)
    ref = fm.fused_moe_int4_ref(x, w13, w2, tw, ids, experts)
    row = dict(shape=name, tokens=t)
    for label, tiles in (("tiles", True), ("mma", False)):
        err = errors(call(tiles, x, w13, w2, tw, ids, experts), ref)
        row[label] = err | dict(ok=err["max_rel"] <= TOLERANCE["max_rel"] and err["norm_rel"] <= TOLERANCE["norm_rel"])
    if t > 1:  # an assignment left out (expert parallelism: id E), as the tiles skip it
        skipped = ids.clone()
        skipped[0, 0] = cfg["experts"]
        kept = tw.clone()
        kept[0, 0] = 0.0
        expect = fm.fused_moe_int4_ref(x, w13, w2, kept, ids, experts)
        got = int4_moe_mma.int4_moe_mma(x, w13, w2, tw, skipped, experts.operands("w13"), experts.operands("w2"))
        err = errors(got, expect)
        row["mma skip"] = err | dict(ok=err["max_rel"] <= TOLERANCE["max_rel"])
    return row


def timing(name: str, cfg: dict, t: int, device, w13, w2, experts) -> dict:
    cases = [routing(t, cfg, device) for _ in range(CASES)]
    row = dict(shape=name, tokens=t)
    for label, tiles in (("tiles", True), ("mma", False)):
        routed(tiles)
        fns = [partial(fm.fused_moe, x, w13, w2, tw, ids, int4=experts) for (x, tw, ids) in cases]
        row[label] = bench_env.graph_per_call_us(fns, min_calls=4 * CASES, repeats=20)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    report = dict(env=bench_env.environment(device), checks=[], timings=[])
    for name, cfg in SHAPES.items():
        _, w13, w2, _, _, experts = moe_case(1, cfg, device)
        for t in TOKENS:
            report["checks"].append(check(name, cfg, t, device, w13, w2, experts))
            print(report["checks"][-1], flush=True)
        for t in TOKENS:
            report["timings"].append(timing(name, cfg, t, device, w13, w2, experts))
            print(report["timings"][-1], flush=True)
        del w13, w2, experts
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print("\n== correctness against fused_moe_int4_ref (max rel / norm rel) ==")
    for r in report["checks"]:
        cells = "  ".join(f"{k} {'ok' if r[k]['ok'] else 'BAD'} {r[k]['max_rel']:.1e}/{r[k]['norm_rel']:.1e}"
                          for k in ("tiles", "mma", "mma skip") if k in r)
        print(f"{r['shape']:>8} T={r['tokens']:<3} {cells}")
    print("\n== µs a call in a CUDA graph (int4 routed experts, weights mostly from HBM) ==")
    for r in report["timings"]:
        print(f"{r['shape']:>8} T={r['tokens']:<3} tiles {r['tiles']:8.1f}  mma {r['mma']:8.1f}  "
              f"({r['tiles'] / r['mma']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
