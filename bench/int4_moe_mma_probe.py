"""The int4 routed experts at decode: kernels/int4_moe_mma.py (the tensor-core GEMV once per assignment) against
fused_moe's int4 tiles, on one H200. Correctness against fused_moe_int4_ref (the dequantized experts), then
µs a call inside CUDA graphs, cycling through CASES distinct routings so the experts' weights come mostly from
HBM (V2-Lite's 6 experts are 26 MB of codes: one routing alone would sit in the 50 MB L2); also as one rank of
EP_RANKS under expert parallelism sees them (the other ranks' assignments left out, id E).
    python bench/int4_moe_mma_probe.py --json OUT.json
    python bench/int4_moe_mma_probe.py --warps 1,2,4,8 --json OUT.json   # DEEPSERVE_INT4_MOE_MMA_WARPS's choice:
        # the tensor-core path alone with programs of each warp count, checked, then timed at WARP_TOKENS
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

# V3's experts are V3-sized, 16 of them (all 256 would take ~60 GB of host memory to generate); "V3-256" has
# all 256, their codes, scales and zero points drawn on the GPU (timed only: no reference for them)
SHAPES = {"V2-Lite": dict(experts=64, hidden=2048, inter=1408, top_k=6),
          "V3": dict(experts=16, hidden=7168, inter=2048, top_k=8),
          "V3-256": dict(experts=256, hidden=7168, inter=2048, top_k=8, on_gpu=True)}
TOKENS = (1, 2, 4, 8, 16)
TIMED_TOKENS = (1, 2, 4, 8, 16, 32)
CASES = 8
EP_RANKS = 8  # the "ep" timings: one rank's share of the assignments (ep_ids)
WARP_TOKENS = (1, 2, 4)  # --warps: the decode sizes the path takes
TOLERANCE = dict(max_rel=2e-2, norm_rel=1e-2)


def routed(tiles: bool):
    # fused_moe with the mma path off (tiles) or on for every size timed here
    int4_moe_mma.MAX_ASSIGNMENTS = 0 if tiles else 1 << 20
    int4_moe_mma.MMA_HITS_RATIO = float("inf")  # whatever mma_moe_pays would choose
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


def ep_ids(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    # One rank of EP_RANKS under expert parallelism: experts e with e % EP_RANKS == 0 are its own, every other
    # assignment is left out (id E), about 7 of a token's 8 at 8 ranks.
    return torch.where(ids % EP_RANKS == 0, ids, num_experts)


def timing(name: str, cfg: dict, t: int, device, w13, w2, experts) -> dict:
    cases = [routing(t, cfg, device) for _ in range(CASES)]
    row = dict(shape=name, tokens=t)
    for label, tiles, ep in (("tiles", True, False), ("mma", False, False), ("tiles ep", True, True),
                             ("mma ep", False, True)):
        routed(tiles)
        fns = [partial(fm.fused_moe, x, w13, w2, tw, ep_ids(ids, cfg["experts"]) if ep else ids, int4=experts)
               for (x, tw, ids) in cases]
        row[label] = bench_env.graph_per_call_us(fns, min_calls=4 * CASES, repeats=20)
    return row


def warp_rows(name: str, cfg: dict, device, w13, w2, experts, warps: tuple[int, ...], checked: bool) -> list[dict]:
    """--warps: the mma path with programs of each warp count (int4_moe_mma.NUM_WARPS, read at each launch), checked
    against fused_moe_int4_ref where `checked`, and µs a call in CUDA graphs at WARP_TOKENS."""
    rows = []
    for t in WARP_TOKENS:
        cases = [routing(t, cfg, device) for _ in range(CASES)]
        row = dict(shape=name, tokens=t)
        for w in warps:
            int4_moe_mma.NUM_WARPS = w
            routed(False)
            if checked:
                x, tw, ids = cases[0]
                err = errors(call(False, x, w13, w2, tw, ids, experts), fm.fused_moe_int4_ref(x, w13, w2, tw, ids,
                                                                                              experts))
                row[f"ok w{w}"] = err["max_rel"] <= TOLERANCE["max_rel"] and err["norm_rel"] <= TOLERANCE["norm_rel"]
            fns = [partial(fm.fused_moe, x, w13, w2, tw, ids, int4=experts) for (x, tw, ids) in cases]
            row[f"w{w}"] = bench_env.graph_per_call_us(fns, min_calls=4 * CASES, repeats=20)
        rows.append(row)
        print(row, flush=True)
    return rows


def experts_on_gpu(cfg: dict, device) -> tuple:
    # (w13, w2, Int4Experts) in fused_moe's int4 layout: random code words, scales 10^-3 .. 10^-1, zero points
    # 0 .. 15, all drawn on the device (V3's 256 experts: ~5.6 GB of codes)
    e, h, i = cfg["experts"], cfg["hidden"], cfg["inter"]

    def product(n: int, k: int) -> tuple:
        words = torch.randint(-2**31, 2**31, (e, n, k // 8), dtype=torch.int32, device=device)
        scales = (10 ** (torch.rand(e, n, k // 128, device=device) * 2 - 3)).half()
        return words, scales, torch.randint(0, 16, (e, n, k // 128), device=device).half()

    (w13, s13, z13), (w2, s2, z2) = product(2 * i, h), product(h, i)
    return w13, w2, fm.Int4Experts(4, s13, z13, s2, z2, 128, 128)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--warps", type=lambda v: tuple(int(w) for w in v.split(",")),
                        help="only the mma path, with programs of these warp counts (e.g. 1,2,4,8)")
    args = parser.parse_args()
    device = torch.device("cuda")
    report = dict(env=bench_env.environment(device), checks=[], timings=[])
    if args.warps:
        return warps_only(args, device, report)
    for name, cfg in SHAPES.items():
        if cfg.get("on_gpu"):
            w13, w2, experts = experts_on_gpu(cfg, device)
        else:
            _, w13, w2, _, _, experts = moe_case(1, cfg, device)
            for t in TOKENS:
                report["checks"].append(check(name, cfg, t, device, w13, w2, experts))
                print(report["checks"][-1], flush=True)
        for t in TIMED_TOKENS:
            report["timings"].append(timing(name, cfg, t, device, w13, w2, experts))
            print(report["timings"][-1], flush=True)
        del w13, w2, experts
        torch.cuda.empty_cache()
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
              f"({r['tiles'] / r['mma']:.2f}x)   one rank of {EP_RANKS} (expert parallelism): "
              f"tiles {r['tiles ep']:8.1f}  mma {r['mma ep']:8.1f}")
    return 0


def warps_only(args, device, report: dict) -> int:
    for name, cfg in SHAPES.items():
        on_gpu = bool(cfg.get("on_gpu"))
        if on_gpu:
            w13, w2, experts = experts_on_gpu(cfg, device)
        else:
            _, w13, w2, _, _, experts = moe_case(1, cfg, device)
        report["timings"] += warp_rows(name, cfg, device, w13, w2, experts, args.warps, checked=not on_gpu)
        del w13, w2, experts
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    bad = [(r["shape"], r["tokens"], k) for r in report["timings"] for k, v in r.items()
           if k.startswith("ok") and not v]
    print(f"\n== the mma path by warps a program: µs a call in a CUDA graph ({'ALL CORRECT' if not bad else bad}) ==")
    for r in report["timings"]:
        print(f"{r['shape']:>8} T={r['tokens']:<3} " + "  ".join(f"w{w} {r[f'w{w}']:7.1f}" for w in args.warps))
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
