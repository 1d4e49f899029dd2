"""Sweep the fused MoE kernel's tile configs at decode sizes on a GPU (DeepSeek-V2-Lite and V3 expert
shapes), each checked against fused_moe_ref first and timed as CUDA-graph replays (CUDA events), so
a batch of one measures GPU time rather than Python launch overhead. Prints one line per config and
the best per token count last. Usage: python bench/sweep_moe_config.py [--out DIR]"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import bench_env
import torch

from deepserve.kernels import fused_moe as fm

SHAPES = {"v2-lite": (64, 2048, 1408, 6), "v3": (256, 7168, 2048, 8)}  # experts, hidden, inter, top-k
TOKENS = (1, 4, 16, 64)
CANDIDATES = [fm.MoEConfig(block_m=16, block_n=n, block_k=k, group_m=1, num_warps=w, num_stages=s)
              for n, k, w, s in itertools.product((16, 32, 64), (128, 256), (4,), (3, 4))]
CANDIDATES += [fm.MoEConfig(block_m=16, block_n=n, block_k=128, group_m=1, num_warps=8, num_stages=4) for n in (32, 64)]


def sweep(name: str, tokens: int, gen: torch.Generator) -> list[dict]:
    e, h, inter, k = SHAPES[name]
    dev = torch.device("cuda")
    x = (torch.randn(tokens, h, generator=gen) * 0.5).to(dev, torch.bfloat16)
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) * 0.02).to(dev, torch.bfloat16)
    w2 = (torch.randn(e, h, inter, generator=gen) * 0.02).to(dev, torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)]).to(dev)
    weights = torch.rand(tokens, k, generator=gen).to(dev)
    ref = fm.fused_moe_ref(x, w13, w2, weights, ids).float()
    weight_bytes = len(ids.unique()) * 3 * h * inter * 2
    rows = []
    for cfg in [None] + CANDIDATES:
        try:
            out = fm.fused_moe(x, w13, w2, weights, ids, config=cfg).float()
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            us = bench_env.graph_per_call_us([lambda cfg=cfg: fm.fused_moe(x, w13, w2, weights, ids, config=cfg)],
                                             min_calls=10, repeats=20)
        except Exception as exc:  # a config the compiler rejects (shared memory) is skipped, not fatal
            rows.append({"shape": name, "tokens": tokens, "config": str(cfg), "error": str(exc)[:120]})
            continue
        rows.append({"shape": name, "tokens": tokens, "config": "default" if cfg is None else cfg.__dict__,
                     "us": round(us, 1), "tb_per_s": round(weight_bytes / us / 1e6, 2), "rel_err": err,
                     "ok": err < 2e-2})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ns = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    results, best = [], []
    for name in SHAPES:
        for tokens in TOKENS:
            rows = sweep(name, tokens, gen)
            results += rows
            good = [r for r in rows if r.get("ok")]
            default = next((r for r in rows if r.get("config") == "default"), None)
            top = min(good, key=lambda r: r["us"]) if good else None
            best.append((name, tokens, default and default.get("us"), top))
    with open(f"{ns.out}/sweep_moe_config.json", "w") as f:
        json.dump(results, f, indent=1)
    bad = [r for r in results if "ok" in r and not r["ok"]]
    print(f"{len(results)} configs timed, {len(bad)} wrong")
    for name, tokens, default_us, top in best:
        print(f"{name:8s} T={tokens:3d} default {default_us} us | best {top and top['us']} us "
              f"({top and top['tb_per_s']} TB/s) {top and top['config']}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
