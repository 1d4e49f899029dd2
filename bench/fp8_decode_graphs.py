"""FP8 linear layers at decode batch sizes, timed as the engine runs them: inside a CUDA graph (no launch
overhead), per call, L2 not flushed (a decode step streams each weight once, larger than L2 anyway for
these shapes). Variants: bf16 F.linear, the block-scaled Triton path with and without split-K, torch's
block-wise _scaled_mm, and for per-channel weights the Triton path and torch._scaled_mm row-wise.

    python bench/fp8_decode_graphs.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from deepserve.kernels import fp8  # noqa: E402
from deepserve.kernels.fp8_ref import quantize_weight_block, quantize_weight_per_channel  # noqa: E402

SHAPES = {"7B qkv": (12288, 4096), "7B o": (4096, 4096), "7B gate_up": (22016, 4096), "7B down": (4096, 11008),
          "V3 q_b": (24576, 1536), "V3 kv_a": (576, 7168), "V3 o": (7168, 16384), "V3 gate_up": (36864, 7168),
          "V3 down": (7168, 18432)}
BATCHES = (1, 16, 64, 256)


def graph_us(fn, calls: int = 10, replays: int = 20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def scaled_mm_rowwise(x, w_q, w_s):
    x_q, x_s = fp8.quantize_per_token_group(x, x.shape[1])
    return torch._scaled_mm(x_q, w_q.t(), scale_a=x_s, scale_b=w_s.view(1, -1), out_dtype=x.dtype)


def variants(x, w, wb, sb, wc, sc) -> dict:
    def no_split():
        fp8.USE_SPLIT_K = False
        try:
            return fp8.block_fp8_linear(x, wb, sb, (128, 128))
        finally:
            fp8.USE_SPLIT_K = True

    return {"bf16": lambda: torch.nn.functional.linear(x, w),
            "block triton": lambda: fp8.block_fp8_linear(x, wb, sb, (128, 128)),
            "block triton nosplit": no_split,
            "channel triton": lambda: fp8.channel_fp8_triton(x, wc, sc),
            "channel scaled_mm": lambda: scaled_mm_rowwise(x, wc, sc)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ns = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wb, sb = quantize_weight_block(w, (128, 128))
        wc, sc = quantize_weight_per_channel(w)
        for m in BATCHES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"shape": name, "M": m, "bf16_weight_MB": n * k * 2 / 1e6}
            for label, fn in variants(x, w, wb, sb, wc, sc).items():
                try:
                    row[label] = graph_us(fn)
                except Exception as exc:  # one failing variant must not hide the others
                    row[label] = f"{type(exc).__name__}: {exc}"[:80]
            rows.append(row)
            print(json.dumps(row), flush=True)
    labels = list(variants(*[None] * 6))
    print(f"{'shape':>11} {'M':>4} " + " ".join(f"{lab:>20}" for lab in labels) + "   (us per call in a CUDA graph)")
    for r in rows:
        cells = [f"{r[lab]:20.1f}" if isinstance(r[lab], float) else f"{'error':>20}" for lab in labels]
        print(f"{r['shape']:>11} {r['M']:>4} " + " ".join(cells))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
