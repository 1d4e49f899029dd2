"""The fused split-K sum (kernels/split_k.py, DEEPSERVE_SPLIT_K_FUSED_SUM) on the GPU: correctness under real
concurrency, then its time against the separate sum kernel, for both decode GEMVs on the 7B and V3 shapes.

Correct: for every (kernel, shape, M) the fused output equals the separate sum's bit for bit (the same
additions in the same order), first eagerly, then over --replays replays of a CUDA graph of 8 back-to-back
launches (each replay's outputs compared; a race in the counting would show as a wrong or stale tile), and
every tile counter is 0 afterwards. Timed: µs a call inside a CUDA graph (L2 not flushed, as the engine runs
them), separate sum vs fused. Exit 1 on any mismatch.

    python bench/check_split_k.py [--replays 50] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_decode_graphs import graph_us  # noqa: E402  (bench/: µs a call inside a CUDA graph)

from deepserve.kernels import fp8_gemv, int4, int4_gemv, split_k  # noqa: E402
from deepserve.kernels.fp8_ref import quantize_weight_block  # noqa: E402
from deepserve.kernels.int4_ref import pack_rows  # noqa: E402

SHAPES = {"7B qkv": (12288, 4096), "7B o": (4096, 4096), "7B gate_up": (22016, 4096), "7B down": (4096, 11008),
          "V3 q_b": (24576, 1536), "V3 kv_a": (576, 7168), "V3 o": (7168, 16384)}
CALLS = 8


def make(kind: str, n: int, k: int):
    """A function x -> y for this kernel and shape, with random weights in its format."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    if kind == "fp8":
        w_q, scale = quantize_weight_block(torch.randn(n, k, device="cuda", generator=g) / 64, (128, 128))
        return lambda x: fp8_gemv.fp8_gemv(x, w_q, scale, (128, 128))
    qweight = pack_rows(torch.randint(0, 16, (n, k), device="cuda", generator=g), 4)
    scales = (torch.rand(n, k // 128, device="cuda", generator=g) / 64).half()
    zeros = torch.randint(0, 16, (n, k // 128), device="cuda", generator=g).half()
    return lambda x: int4.w4a16_matmul(x, qweight, scales, zeros, 4, 128,
                                       config=int4_gemv.default_gemv_config(x.shape[0]))


def graph_of(fn, xs):
    """A CUDA graph of len(xs) launches (one per input) and its outputs (the correctness replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for x in xs:
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn(x) for x in xs]
    return graph, outs


def check(kind: str, name: str, n: int, k: int, m: int, replays: int) -> dict:
    fn = make(kind, n, k)
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
    split_k.FUSED_SUM = False
    want = [fn(x) for x in xs]
    separate_us = graph_us(lambda: fn(xs[0]), calls=CALLS)
    split_k.FUSED_SUM = True
    eager_ok = all(torch.equal(fn(x), w) for x, w in zip(xs, want, strict=True))
    fused_graph, outs = graph_of(fn, xs)
    bad = 0
    for _ in range(replays):
        for out in outs:
            out.fill_(float("nan"))
        fused_graph.replay()
        torch.cuda.synchronize()
        bad += sum(not torch.equal(o, w) for o, w in zip(outs, want, strict=True))
    locks = split_k._tile_locks.get(xs[0].device)
    counters_zero = locks is not None and int(locks.count_nonzero()) == 0
    row = {"kind": kind, "shape": name, "m": m, "eager_equal": eager_ok, "graph_mismatches": bad,
           "counters_zero": counters_zero, "separate_us": round(separate_us, 2),
           "fused_us": round(graph_us(lambda: fn(xs[0]), calls=CALLS), 2)}
    row["ok"] = eager_ok and bad == 0 and counters_zero
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--ms", default="1,2")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    rows = []
    for kind in ("fp8", "int4"):
        for name, (n, k) in SHAPES.items():
            for m in map(int, ns.ms.split(",")):
                rows.append(check(kind, name, n, k, m, ns.replays))
                print(json.dumps(rows[-1]), flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{'kernel':6} {'shape':12} {'M':>2} {'ok':>3} {'separate µs':>12} {'fused µs':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['kind']:6} {r['shape']:12} {r['m']:>2} {'yes' if r['ok'] else 'NO':>3} {r['separate_us']:>12} "
              f"{r['fused_us']:>9} {r['fused_us'] / r['separate_us']:>6.3f}")
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} correct")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
