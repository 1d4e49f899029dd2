"""FP8 linear layers at decode batch sizes, timed as the engine runs them: inside a CUDA graph (no launch
overhead), per call, L2 not flushed (a decode step streams each weight once, larger than L2 anyway for
these shapes). Variants: bf16 F.linear, the block-scaled Triton path with and without split-K, torch's
block-wise _scaled_mm, and for per-channel weights the Triton path and torch._scaled_mm row-wise.

    python bench/fp8_decode_graphs.py [--json OUT] [--sweep-s 120]   # --sweep-s: also sweep the GEMM's tiles
    python bench/fp8_decode_graphs.py --gemv-s 240 [--gemv-m 1] [--gemv-timed channel] [--json OUT]  # the GEMVs only

--gemv-s: kernels/fp8_gemv.py (the linears take it up to DEEPSERVE_FP8_GEMV_MAX_M tokens, 1 by default;
here the other columns are the W8A8 path at every M) for M = 1..16 on every shape, each config checked
against x @ the dequantized weight, block-scaled and per-channel (exit 1 if any is wrong, or every config
tried on a row failed; rows past the deadline are listed untimed), then timed block-scaled beside bf16 and
the W8A8 Triton path; the table ends with the best config per (shape, M).
"""

from __future__ import annotations

import argparse
import functools
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


# Tile sweep for the block-scaled GEMM alone (activations quantized outside the graph), per decode M:
# (block_m, block_n, num_warps, num_stages, split_k); split_k 0 = the library's rule (split_count).
SWEEP_TILES = [(bm, bn, w, st, sk) for bm in (16, 32) for bn in (32, 64, 128) for w in (4, 8) for st in (4, 6)
               for sk in (0, 2, 4)]
SWEEP_SHAPES = ("7B qkv", "7B down", "V3 kv_a", "V3 gate_up")
SWEEP_BATCHES = (1, 16, 64)


def sweep(deadline_s: float) -> list[dict]:
    """The fastest tiles per (shape, M) inside CUDA graphs: what default_config's decode rows should be."""
    import time

    start, rows = time.perf_counter(), []
    for name in SWEEP_SHAPES:
        n, k = SHAPES[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        w_q, w_s = quantize_weight_block(w, (128, 128))
        for m in SWEEP_BATCHES:
            x_q, x_s = fp8.quantize_per_token_group(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), 128)
            timings = {}
            for bm, bn, warps, stages, split in SWEEP_TILES:
                if bm > max(16, m) or time.perf_counter() - start > deadline_s:
                    continue
                tiles = -(-m // bm) * -(-n // bn)
                split = split or fp8.split_count(tiles, -(-k // 128), 132)
                cfg = fp8.Fp8GemmConfig(bm, bn, 128, 1, warps, stages, split)
                try:
                    timings[f"m{bm}-n{bn}-w{warps}-s{stages}-k{split}"] = graph_us(
                        functools.partial(fp8.block_fp8_matmul, x_q, x_s, w_q, w_s, (128, 128), torch.bfloat16,
                                          config=cfg), calls=5, replays=10)
                except Exception as exc:  # a tile that does not compile or fit: skip it, say so
                    timings[f"m{bm}-n{bn}-w{warps}-s{stages}-k{split}"] = f"{type(exc).__name__}"
            ok = {key: v for key, v in timings.items() if isinstance(v, float)}
            best = sorted(ok.items(), key=lambda kv: kv[1])[:5]
            default = graph_us(functools.partial(fp8.block_fp8_matmul, x_q, x_s, w_q, w_s, (128, 128), torch.bfloat16),
                               5, 10)
            row = {"shape": name, "M": m, "default_us": default, "best": best, "tried": len(timings),
                   "fp8_bytes_MB": n * k / 1e6}
            rows.append(row)
            print("SWEEP", json.dumps(row), flush=True)
    return rows


GEMV_BATCHES = (1, 2, 4, 8, 16)
GEMV_CONFIGS = [dict(numerics=nu, block_n=bn, block_k=128, waves=wv, num_warps=4, prefetch=False)
                for nu in ("fma", "dot") for bn in (16, 32, 64, 128) for wv in (2, 4, 8)]
# the prefetching loop (the next K tile loaded before this one is multiplied), at the one-token sizes
GEMV_CONFIGS += [dict(numerics="fma", block_n=bn, block_k=128, waves=wv, num_warps=4, prefetch=True)
                 for bn in (64, 128) for wv in (2, 4, 8)]
# one row, the products summed along K after the loop (kernels/fp8_gemv.py "fma2d"): M = 1 only
GEMV_CONFIGS += [dict(numerics="fma2d", block_n=bn, block_k=bk, waves=wv, num_warps=nw, prefetch=False)
                 for bn in (32, 64, 128) for bk in (64, 128) for wv in (2, 4) for nw in (4, 8)]


def gemv_sweep(deadline_s: float, batches: tuple[int, ...] = GEMV_BATCHES, timed: str = "block"
               ) -> tuple[list[dict], bool]:
    """Every GEMV config per (shape, M in batches) until the deadline: (rows, all correct). Both weight kinds
    are checked; `timed` ("block": DeepSeek's 128 x 128 scales, "channel": --quantization fp8's) is timed."""
    import time

    from deepserve.kernels import fp8_gemv
    from deepserve.kernels.fp8_ref import dequantize_weight_block

    start, rows, correct = time.perf_counter(), [], True
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wb, sb = quantize_weight_block(w, (128, 128))
        wc, sc = quantize_weight_per_channel(w)
        weights = {"block": (wb, sb, (128, 128), dequantize_weight_block(wb, sb, (128, 128)).float()),
                   "channel": (wc, sc, None, wc.float() * sc[:, None])}
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"shape": name, "M": m, "fp8_MB": n * k / 1e6,
                   "bf16": graph_us(lambda x=x, w=w: torch.nn.functional.linear(x, w)),
                   "w8a8 triton": graph_us(functools.partial(fp8.block_fp8_linear, x, wb, sb, (128, 128))),
                   "gemv": {}}
            for c in GEMV_CONFIGS:
                if ((c["numerics"] == "fma" and m > 4) or (c["numerics"] == "fma2d" and m > 1)
                        or time.perf_counter() - start > deadline_s):
                    continue
                cfg = fp8_gemv.Fp8GemvConfig(**c)
                key = "-".join(f"{v}" for v in c.values())
                for kind, (w_q, scale, block, exact) in weights.items():  # both checked, block-scaled timed
                    fn = functools.partial(fp8_gemv.fp8_gemv, x, w_q, scale, block, None, cfg)
                    try:
                        want = x.float() @ exact.T
                        err = ((fn().float() - want).norm() / want.norm()).item()
                        if not err < 1e-2:
                            correct = False
                            row["gemv"][key] = f"WRONG ({kind}) {err:.2e}"
                            break
                        if kind == timed:
                            row["gemv"][key] = graph_us(fn, calls=5, replays=10)
                    except Exception as exc:  # a config that does not compile or fit: counted as not run
                        row["gemv"][key] = f"{type(exc).__name__} ({kind})"
                        break
            ok = sorted(((k_, v) for k_, v in row["gemv"].items() if isinstance(v, float)), key=lambda kv: kv[1])
            row["best"] = ok[:3]
            correct = correct and (bool(ok) or not row["gemv"])  # every config tried failing is no pass
            rows.append(row)
            print("GEMV", json.dumps({k_: v for k_, v in row.items() if k_ != "gemv"}), flush=True)
    return rows, correct


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--sweep-s", type=float, default=0.0, help="seconds for the tile sweep (0: none)")
    ap.add_argument("--gemv-s", type=float, default=0.0, help="seconds for the GEMV configs alone (0: none)")
    ap.add_argument("--gemv-m", type=lambda v: tuple(int(m) for m in v.split(",")), default=GEMV_BATCHES,
                    help="with --gemv-s: the token counts, e.g. 1 (default 1,2,4,8,16)")
    ap.add_argument("--gemv-timed", choices=("block", "channel"), default="block",
                    help="which weights the GEMV configs are timed on (both are checked): DeepSeek's 128 x 128 block "
                         "scales or --quantization fp8's per-channel scales")
    ns = ap.parse_args()
    # The "block triton" / "w8a8 triton" columns time the W8A8 path at every M; the GEMVs, which the linears
    # take first at 1-8 tokens by default, are timed through their own configs (--gemv-s; the tensor-core one:
    # bench/fp8_gemv_probe.py).
    fp8.GEMV_MAX_M = 0
    fp8.MMA_GEMV_MAX_M = 0
    torch.manual_seed(0)
    if ns.gemv_s > 0:
        return _gemv_main(ns)
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
    swept = sweep(ns.sweep_s) if ns.sweep_s > 0 else []
    for r in swept:
        best = ", ".join(f"{key} {us:.1f}" for key, us in r["best"][:3])
        rate = r["fp8_bytes_MB"] / r["default_us"]
        print(f"{r['shape']:>11} M={r['M']:<4} default {r['default_us']:.1f} us ({rate:.2f} TB/s); best: {best}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"variants": rows, "sweep": swept}, f, indent=1)
    return 0


def _gemv_main(ns: argparse.Namespace) -> int:
    rows, correct = gemv_sweep(ns.gemv_s, ns.gemv_m, ns.gemv_timed)
    print(f"{'shape':>11} {'M':>3} {'bf16':>7} {'w8a8':>7} {'gemv':>7} {'TB/s':>5}  best config "
          "(numerics-block_n-block_k-waves-warps-prefetch), us in a CUDA graph")
    for r in rows:
        if not r["best"]:
            print(f"{r['shape']:>11} {r['M']:>3} {r['bf16']:7.1f} {r['w8a8 triton']:7.1f}  (no config timed)")
            continue
        key, us = r["best"][0]
        print(f"{r['shape']:>11} {r['M']:>3} {r['bf16']:7.1f} {r['w8a8 triton']:7.1f} {us:7.1f} "
              f"{r['fp8_MB'] / us:5.2f}  {key}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"gemv": rows}, f, indent=1)
    print("ALL CORRECT" if correct else "WRONG RESULTS, OR A ROW WHOSE EVERY CONFIG FAILED (see the rows)")
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
