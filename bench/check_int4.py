"""Correctness and speed of the W4A16 kernels (deepserve/kernels/int4.py, the int4 path of
kernels/fused_moe.py), in one run on one H200.

1. The GEMM against int4_ref (the weight dequantized, rounded to bf16, cuBLAS bf16 matmul) on every
   (N, K) of SHAPES (DeepSeek-LLM-7B's, V2-Lite's, odd ones) at M = 1, 2, 3, 8, 64, 257, 1024, 8192; random
   codes, per-group scales of different magnitudes; 4-bit groups of 128, act order, 8-bit.
2. The fused MoE's int4 path against fused_moe_int4_ref on V2-Lite's experts (64 x 2048 x 1408, top 6) at
   T = 1, 8, 64, 512, 4096.
3. Speed at M = 1, 8, 16, 64, 256, 1024, 8192 on LLM-7B's projections: the int4 GEMM (and with the other
   way of unpacking the words, kernels/int4_tile.py) against bf16 F.linear (cuBLAS), each call captured
   in a CUDA graph and its replays timed by triton.testing.do_bench with L2 flushed (weights from HBM, no
   Python in the figure, as in decode: time_us), and the int4 weight stream's GB/s; the fused MoE int4
   against bf16 at T = 1, 8, 64; one CUDA graph capture of the GEMM (no host sync).

Tables come last; JSON to --json; exit code 1 on any wrong result. About 90 s on the H200.
    python bench/check_int4.py --json OUT.json     # the H200 run
    python bench/check_int4.py --smoke             # tiny shapes; CPU under TRITON_INTERPRET

--variants instead checks and times every variant of the GEMM (kernels/int4.py's docstring: the tile
kernel and its other unpacking, the split-K GEMV in several tiles and both numerics, dequantize + cuBLAS)
on LLM-7B's and V2-Lite's shapes at M = 1 .. 8192, against bf16 cuBLAS; it ends with the best variant per
(shape, M), its GB/s (int4 bytes read) and TFLOP/s, and what that suggests for DEEPSERVE_INT4_GEMV_MAX_M /
DEEPSERVE_INT4_CUBLAS_MIN_M. Budgeted to stay under about 4 min on the H200 (later timings are skipped and
listed past VARIANTS_DEADLINE_S).
    python bench/check_int4.py --variants --json OUT.json
    python bench/check_int4.py --variants --smoke --one-of-each   # tests/kernels/test_int4_variants.py's run
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import bench_env
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # --smoke on CPU; must precede the first `import triton`
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import triton.testing  # noqa: E402

from deepserve.kernels import fused_moe as fm  # noqa: E402
from deepserve.kernels import int4  # noqa: E402
from deepserve.kernels import int4_ref as ref  # noqa: E402
from deepserve.kernels.int4_dequant import Int4DequantConfig  # noqa: E402
from deepserve.kernels.int4_gemv import Int4GemvConfig  # noqa: E402

START = time.perf_counter()
DEADLINE_S = 100.0  # past this, remaining timings are skipped (and listed as skipped)
SHAPES = {  # name: (N, K)
    "odd": (1000, 328), "7B qkv/o": (4096, 4096), "7B gate_up": (22016, 4096), "7B down": (4096, 11008),
    "Lite kv_a": (576, 2048), "Lite q": (3072, 2048), "Lite dense down": (2048, 10944),
}
VARIANTS = {"g128": (4, 128, False), "act-order": (4, 128, True), "8-bit": (8, 128, False)}
CHECK_MS = (1, 2, 3, 8, 64, 257, 1024, 8192)
TIME_SHAPES = ("7B qkv/o", "7B gate_up", "7B down")
TIME_MS = (1, 8, 16, 64, 256, 1024, 8192)
MOE = dict(experts=64, hidden=2048, inter=1408, top_k=6)
MOE_TOKENS = (1, 8, 64, 512, 4096)
SMOKE = dict(shapes={"odd": (200, 328), "even": (128, 256)}, ms=(1, 3, 40),
             moe=dict(experts=4, hidden=128, inter=128, top_k=2), moe_tokens=(1, 5))
TOLERANCE = dict(max_rel=2e-2, norm_rel=1e-2)  # bf16 outputs: accumulation order and rounding differ
# The interpreter's fp32 -> bf16 cast truncates (the GPU rounds): --smoke on CPU runs fp16.
DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float16


def elapsed() -> float:
    return time.perf_counter() - START


def weights(n: int, k: int, bits: int, group: int, act_order: bool, device, seed: int, lead: tuple = ()):
    """Our layout: (qweight, scales, zeros, g_idx or None), random codes, scales 10^-3 .. 10^-1."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    codes = torch.randint(0, 2**bits, (*lead, n, k), generator=gen)
    scales = (10 ** (torch.rand(*lead, n, groups, generator=gen) * 2 - 3)).half()
    zeros = torch.randint(0, 2**bits, (*lead, n, groups), generator=gen).half()
    g_idx = (torch.randperm(k, generator=gen) // group).to(torch.int32) if act_order else None
    out = [ref.pack_rows(codes, bits), scales, zeros, g_idx]
    return [t.to(device) if t is not None else None for t in out]


def errors(out: torch.Tensor, expected: torch.Tensor) -> dict:
    diff, e = (out.float() - expected.float()), expected.float()
    return dict(max_rel=(diff.abs().max() / e.abs().max().clamp_min(1e-30)).item(),
                norm_rel=(diff.norm() / e.norm().clamp_min(1e-30)).item(), nan=bool(out.isnan().any()))


def ok(err: dict) -> bool:
    return not err["nan"] and err["max_rel"] <= TOLERANCE["max_rel"] and err["norm_rel"] <= TOLERANCE["norm_rel"]


def run_gemm_correctness(shapes: dict, ms: tuple, device) -> list[dict]:
    rows = []
    for name, (n, k) in shapes.items():
        for variant, (bits, group, act_order) in VARIANTS.items():
            qw, s, z, g = weights(n, k, bits, group, act_order, device, seed=n + k + bits)
            w = ref.dequantize(qw, s, z, bits, group, g).to(DTYPE)  # [N, K]
            for m in ms:
                row = dict(shape=name, variant=variant, m=m)
                try:
                    x = torch.randn(m, k, device=device, dtype=DTYPE)
                    got = int4.w4a16_matmul(x, qw, s, z, bits, group, g)
                    row |= errors(got, torch.nn.functional.linear(x.float(), w.float()))
                    row["ok"] = ok(row)
                except Exception as exc:
                    row |= dict(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
                    traceback.print_exc()
                rows.append(row)
                print(_check_line(row), flush=True)
    return rows


def moe_case(t: int, cfg: dict, device, act_order: bool = False):
    e, h, i, k = cfg["experts"], cfg["hidden"], cfg["inter"], cfg["top_k"]
    w13, s13, z13, g13 = weights(2 * i, h, 4, 128, False, device, seed=1, lead=(e,))
    w2, s2, z2, g2 = weights(h, i, 4, 128, False, device, seed=2, lead=(e,))
    experts = fm.Int4Experts(4, s13, z13, s2, z2, 128, 128)
    x = torch.randn(t, h, device=device, dtype=DTYPE)
    scores = torch.randn(t, e, device=device)
    ids = scores.topk(k, dim=-1).indices
    topk_weights = scores.gather(1, ids).softmax(-1).float().contiguous()
    return x, w13, w2, topk_weights, ids, experts


def run_moe_correctness(cfg: dict, tokens: tuple, device) -> list[dict]:
    rows = []
    for t in tokens:
        row = dict(shape="V2-Lite experts", variant="g128", m=t)
        try:
            x, w13, w2, tw, ids, experts = moe_case(t, cfg, device)
            row |= errors(fm.fused_moe(x, w13, w2, tw, ids, int4=experts),
                          fm.fused_moe_int4_ref(x, w13, w2, tw, ids, experts))
            row["ok"] = ok(row)
        except Exception as exc:
            row |= dict(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
            traceback.print_exc()
        rows.append(row)
        print(_check_line(row), flush=True)
    return rows


def _check_line(row: dict) -> str:
    head = f"{row['shape']:>16} {row['variant']:>9} M={row['m']:<5}"
    if "error" in row:
        return f"{head} ERROR {row['error']}"
    return f"{head} max_rel {row['max_rel']:.2e} norm_rel {row['norm_rel']:.2e}  {'ok' if row['ok'] else 'FAIL'}"


def time_us(fn) -> float:
    """Median microseconds of one call on the GPU: the call captured in a CUDA graph and the replays timed
    by do_bench with L2 flushed (weights from HBM), so the wrapper's Python is not in the figure, as in a
    decode step's graph. Int4 runs 1-2 timed the calls directly and read 60-113 us even for V2-Lite's kv_a
    (0.6 MB of codes; bf16 9 us): most likely the wrappers' host time, which a decode graph does not pay;
    this separates the two. A call that cannot be captured is timed directly (TIMED_IN_GRAPHS counts)."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    graph = _captured(fn)
    target = graph.replay if graph is not None else fn
    us = triton.testing.do_bench(target, warmup=10, rep=30, return_mode="median") * 1e3
    TIMED_IN_GRAPHS.append(graph is not None)
    return us


TIMED_IN_GRAPHS: list[bool] = []  # one entry per timing: was it a graph replay


def _captured(fn) -> torch.cuda.CUDAGraph | None:
    fn()  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:  # a call that syncs with the host cannot be captured: time it directly
        print(f"not capturable, timed directly: {type(exc).__name__}: {exc}", flush=True)
        torch.cuda.synchronize()
        return None
    return graph


def run_gemm_speed(shapes: dict, ms: tuple, device) -> list[dict]:
    rows = []
    for name, (n, k) in shapes.items():
        qw, s, z, _ = weights(n, k, 4, 128, False, device, seed=7)
        w = ref.dequantize(qw, s, z, 4, 128).to(DTYPE)
        for m in ms:
            row = dict(shape=name, n=n, k=k, m=m)
            if elapsed() > DEADLINE_S:
                rows.append(row | dict(skipped=True))
                continue
            x = torch.randn(m, k, device=device, dtype=DTYPE)
            cfg = int4.default_config(m, n, k)
            gather = replace(cfg, reshape_unpack=not cfg.reshape_unpack)  # the other unpacking (int4_tile.py)
            row |= dict(config=str(cfg),
                        int4_us=time_us(functools.partial(int4.w4a16_matmul, x, qw, s, z, 4, 128)),
                        other_unpack_us=time_us(functools.partial(int4.w4a16_matmul, x, qw, s, z, 4, 128,
                                                                  config=gather)),
                        bf16_us=time_us(functools.partial(torch.nn.functional.linear, x, w)))
            # bytes the int4 GEMM must read: codes, scales and zeros (x and the output are small at decode)
            row["int4_gbs"] = (qw.numel() * 4 + 2 * s.numel() * 2) / row["int4_us"] / 1e3
            rows.append(row)
            print(f"{name:>12} M={m:<5} int4 {row['int4_us']:8.1f} us  other unpacking {row['other_unpack_us']:8.1f} us"
                  f"  bf16 {row['bf16_us']:8.1f} us  {row['int4_gbs']:6.0f} GB/s  ({row['config']})", flush=True)
    return rows


def run_moe_speed(cfg: dict, tokens: tuple, device) -> list[dict]:
    rows = []
    for t in tokens:
        if elapsed() > DEADLINE_S:
            rows.append(dict(m=t, skipped=True))
            continue
        x, w13, w2, tw, ids, experts = moe_case(t, cfg, device)
        w13b = torch.randn(cfg["experts"], 2 * cfg["inter"], cfg["hidden"], device=device, dtype=DTYPE)
        w2b = torch.randn(cfg["experts"], cfg["hidden"], cfg["inter"], device=device, dtype=DTYPE)
        row = dict(m=t, int4_us=time_us(functools.partial(fm.fused_moe, x, w13, w2, tw, ids, int4=experts)),
                   bf16_us=time_us(functools.partial(fm.fused_moe, x, w13b, w2b, tw, ids)))
        rows.append(row)
        print(f"fused MoE T={t:<5} int4 {row['int4_us']:8.1f} us  bf16 {row['bf16_us']:8.1f} us", flush=True)
    return rows


def run_graph_check(device) -> dict:
    """The GEMM at M = 1 captured in a CUDA graph: proves no host sync."""
    if device.type != "cuda":
        return dict(skipped="CPU")
    try:
        qw, s, z, _ = weights(4096, 4096, 4, 128, False, device, seed=3)
        x = torch.randn(1, 4096, device=device, dtype=DTYPE)
        want = int4.w4a16_matmul(x, qw, s, z, 4, 128)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = int4.w4a16_matmul(x, qw, s, z, 4, 128)
        graph.replay()
        torch.cuda.synchronize()
        return dict(ok=bool(torch.equal(out, want)))
    except Exception as exc:
        return dict(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])


def print_tables(report: dict) -> bool:
    rows = report["gemm"] + report["moe"]
    failed = [r for r in rows if not r.get("ok")]
    print("\n==== correctness (bf16 against the dequantized weight in cuBLAS / the MoE reference) ====")
    print(f"{len(rows) - len(failed)}/{len(rows)} cases ok; worst max_rel "
          f"{max((r.get('max_rel', 0) for r in rows), default=0):.2e} (tolerance {TOLERANCE['max_rel']})")
    for r in failed:
        print("FAILED", _check_line(r))
    print(f"CUDA graph capture: {report['graph']}")
    print("\n==== W4A16 GEMM against bf16 cuBLAS (us, median, L2 flushed) ====")
    print(f"unpacking: default reshape={int4.RESHAPE_UNPACK}; 'other' times the other way (kernels/int4_tile.py)")
    print(f"{'shape':>12} {'M':>5} {'int4':>8} {'other':>8} {'bf16':>8} {'bf16/int4':>9} {'int4 GB/s':>9}")
    for r in report["gemm_speed"]:
        if "int4_us" in r:
            print(f"{r['shape']:>12} {r['m']:>5} {r['int4_us']:8.1f} {r['other_unpack_us']:8.1f} {r['bf16_us']:8.1f} "
                  f"{r['bf16_us'] / r['int4_us']:9.2f} {r['int4_gbs']:9.0f}")
    print("\n==== fused MoE, V2-Lite experts: int4 against bf16 (us) ====")
    for r in report["moe_speed"]:
        if "int4_us" in r:
            print(f"T={r['m']:>5} int4 {r['int4_us']:8.1f} bf16 {r['bf16_us']:8.1f} bf16/int4 "
                  f"{r['bf16_us'] / r['int4_us']:.2f}")
    skipped = [r for r in report["gemm_speed"] + report["moe_speed"] if r.get("skipped")]
    good = not failed and report["graph"].get("ok", True)
    print(f"\nwall {elapsed():.0f} s; {len(skipped)} timings skipped past {DEADLINE_S:.0f} s; "
          + ("ALL CORRECT" if good else "CORRECTNESS FAILURES"))
    return good


# --- --variants ----------------------------------------------------------------------------------------
VARIANT_SHAPES = {  # name: (N, K): LLM-7B's projections, V2-Lite's attention, shared experts and dense MLP
    "7B qkv/o": (4096, 4096), "7B gate_up": (22016, 4096), "7B down": (4096, 11008),
    "Lite q": (3072, 2048), "Lite kv_a": (576, 2048), "Lite o": (2048, 2048),
    "Lite shared up": (5632, 2048), "Lite dense down": (2048, 10944),
}
VARIANT_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 8192)
VARIANT_CHECK_MS = (1, 3, 16, 33, 64, 257, 1024)  # correctness: each variant at the M it is timed at
VARIANTS_DEADLINE_S = 210.0
GEMV_MAX_TIMED_M = 32  # the GEMV unpacks the weight once per token: past this it cannot win
# (block_n, block_k, programs per SM, warps) of the prefetching GEMV at one token: wider tiles and more
# programs an SM keep more of the weight stream in flight (the variants' M = 1 rows read 0.5-0.9 TB/s).
PREFETCH_VARIANTS = ((64, 128, 4, 4), (64, 128, 8, 4), (64, 128, 16, 4), (128, 128, 8, 4), (128, 128, 8, 8),
                     (64, 256, 8, 4), (32, 256, 8, 4), (32, 128, 16, 4))
# Every kind of variant is timed at some M: several tokens a program needs M >= 2, dequantize + cuBLAS 64.
# One shape (odd: every tile edge masked): the kernels' even and odd shapes are checked one by one in
# tests/kernels; this run checks the script (each variant at its M), and the interpreter is slow.
SMOKE_VARIANTS = dict(shapes={"odd": (200, 328)}, ms=(3, 64), check_ms=(1, 64))


def variant_configs(m: int, n: int, k: int, every: bool = True) -> dict:
    """The variants worth timing at M (name: config for int4.w4a16_matmul); every False: one of each kind
    (the act-order and 8-bit checks: each config is one more compile)."""
    tile = int4.default_config(m, n, k)
    out = {"tile": tile}
    if m <= 64 and every:
        out["tile other-unpack"] = replace(tile, reshape_unpack=not tile.reshape_unpack)
    if m <= GEMV_MAX_TIMED_M:
        for bn, bk in ((16, 256), (32, 256), (64, 128), (32, 512)) if every else ((32, 256),):
            out[f"gemv n{bn} k{bk}"] = Int4GemvConfig(bn, bk)
        for bn, bk in ((32, 256), (16, 512)) if every else ((32, 256),):
            out[f"gemv-factored n{bn} k{bk}"] = Int4GemvConfig(bn, bk, factored=True)
        if m == 1:  # one token a program: the next tile's words loaded before this one's unpacking
            for bn, bk, pps, warps in PREFETCH_VARIANTS if every else ((64, 128, 8, 4),):
                out[f"gemv n{bn} k{bk} pf pps{pps} w{warps}"] = Int4GemvConfig(
                    bn, bk, prefetch=True, programs_per_sm=pps, num_warps=warps)
            for pps in (8, 16) if every else ():
                out[f"gemv n64 k128 pps{pps}"] = Int4GemvConfig(64, 128, programs_per_sm=pps)
            out["gemv-factored n64 k128 pf pps8 w4"] = Int4GemvConfig(64, 128, factored=True, prefetch=True,
                                                                      programs_per_sm=8)
        for bm in (4, 8, 16) if every else (4,):  # several tokens a program: one unpacking for them all
            if m >= 2 and bm <= max(4, m):
                out[f"gemv m{bm} n16 k128"] = Int4GemvConfig(16, 128, block_m=bm)
                out[f"gemv-factored m{bm} n16 k128"] = Int4GemvConfig(16, 128, block_m=bm, factored=True)
    if m >= 64:
        out["dequant+cublas"] = Int4DequantConfig()
    return out


def one_of_each_kind(every: dict, some: dict) -> dict:
    """--one-of-each: `some` (one variant of each kind, as --smoke times them) and the first of every kind
    in `every` that `some` lacks (a kind: the name without its tile sizes, e.g. "gemv n k pf pps w"), so
    each code path the variants take is still checked once, not once per tile."""
    out = dict(some)
    kinds = {re.sub(r"\d+", "", v) for v in out}
    for variant, cfg in every.items():
        if re.sub(r"\d+", "", variant) not in kinds:
            kinds.add(re.sub(r"\d+", "", variant))
            out[variant] = cfg
    return out


MOE_VARIANT_TOKENS = (1, 2, 4, 8, 16, 32, 64)
MOE_VARIANT_CHECK_TOKENS = (1, 5, 33)


def moe_variant_configs(t: int, cfg: dict, every: bool = True) -> dict:
    """The fused MoE's int4 variants at T tokens: its tiles (the default) and the expert GEMVs (every False:
    one GEMV of each kind)."""
    out = {"moe tiles": fm.default_config(t, cfg["top_k"], cfg["experts"], DTYPE)}
    for bn, bk in ((16, 256), (32, 256), (64, 128)) if every else ((32, 256),):
        out[f"moe gemv n{bn} k{bk}"] = Int4GemvConfig(bn, bk)
    out["moe gemv-factored n32 k256"] = Int4GemvConfig(32, 256, factored=True)
    for bn, bk in ((16, 128), (32, 128), (64, 128)) if every else ((32, 128),):
        out[f"moe gemv n{bn} k{bk} pf"] = Int4GemvConfig(bn, bk, prefetch=True)
    if every:
        out["moe gemv-factored n32 k128 pf"] = Int4GemvConfig(32, 128, factored=True, prefetch=True)
    return out


def run_moe_variants(cfg: dict, check_tokens: tuple, tokens: tuple, device,
                     time_every: bool = True, one_of_each: bool = False) -> tuple[list, list]:
    """Each MoE variant against fused_moe_int4_ref at check_tokens, then timed (with bf16) at tokens (with
    time_every False one variant of each kind: --smoke, where the interpreter's times mean nothing;
    one_of_each: check one variant of each kind too, one_of_each_kind)."""
    checks, speed = [], []
    for t in check_tokens:
        x, w13, w2, tw, ids, experts = moe_case(t, cfg, device)
        want = fm.fused_moe_int4_ref(x, w13, w2, tw, ids, experts)
        configs = moe_variant_configs(t, cfg)
        if one_of_each:
            configs = one_of_each_kind(configs, moe_variant_configs(t, cfg, every=False))
        for variant, mcfg in configs.items():
            row = dict(shape="V2-Lite experts", variant=f"{variant} g128", m=t)
            try:
                row |= errors(fm.fused_moe(x, w13, w2, tw, ids, mcfg, int4=experts), want)
                row["ok"] = ok(row)
            except Exception as exc:
                row |= dict(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
                traceback.print_exc()
            checks.append(row)
    w13b = torch.randn(cfg["experts"], 2 * cfg["inter"], cfg["hidden"], device=device, dtype=DTYPE)
    w2b = torch.randn(cfg["experts"], cfg["hidden"], cfg["inter"], device=device, dtype=DTYPE)
    for t in tokens:
        x, w13, w2, tw, ids, experts = moe_case(t, cfg, device)
        fns = {v: functools.partial(fm.fused_moe, x, w13, w2, tw, ids, mcfg, int4=experts)
               for v, mcfg in moe_variant_configs(t, cfg, time_every).items()}
        fns["bf16"] = functools.partial(fm.fused_moe, x, w13b, w2b, tw, ids)  # bf16 experts, the same tiles
        # the int4 bytes of the experts a step reads: at most T * top_k distinct experts' codes and scales
        used = min(cfg["experts"], t * cfg["top_k"])
        int4_bytes = used * (w13[0].numel() + w2[0].numel()) * 4 * (1 + 1 / 32)
        for variant, fn in fns.items():
            row = dict(shape="V2-Lite experts", m=t, variant=variant)
            if elapsed() > VARIANTS_DEADLINE_S:
                speed.append(row | dict(skipped=True))
                continue
            us = time_us(fn)
            speed.append(row | dict(us=us, gbs=int4_bytes * (4 if variant == "bf16" else 1) / us / 1e3,
                                    tflops=6 * t * cfg["top_k"] * cfg["hidden"] * cfg["inter"] / us / 1e6))
        print(f"{'V2-Lite experts':>16} T={t:<5} " + " ".join(f"{r['variant']}={r['us']:.1f}" for r in speed
                                                          if r["m"] == t and "us" in r), flush=True)
    return checks, speed


def run_variant_correctness(shapes: dict, ms: tuple, device, one_of_each: bool = False) -> list[dict]:
    """Every variant at every (shape, M) it is timed at, groups of 128; act order and 8-bit on one shape
    (one_of_each: one variant of each kind in groups of 128 too, one_of_each_kind)."""
    rows = []
    formats = [("g128", 4, 128, False)]
    for i, (name, (n, k)) in enumerate(shapes.items()):
        for fmt, bits, group, act_order in formats + ([("act-order", 4, 128, True), ("8-bit", 8, 128, False)]
                                                      if i == 0 else []):
            qw, s, z, g = weights(n, k, bits, group, act_order, device, seed=n + k + bits)
            w = ref.dequantize(qw, s, z, bits, group, g).to(DTYPE).float()  # [N, K]
            for m in ms:
                x = torch.randn(m, k, device=device, dtype=DTYPE)
                want = torch.nn.functional.linear(x.float(), w)
                configs = variant_configs(m, n, k, every=fmt == "g128")
                if one_of_each:
                    configs = one_of_each_kind(configs, variant_configs(m, n, k, every=False))
                for variant, cfg in configs.items():
                    row = dict(shape=name, variant=f"{variant} {fmt}", m=m)
                    try:
                        row |= errors(int4.w4a16_matmul(x, qw, s, z, bits, group, g, config=cfg), want)
                        row["ok"] = ok(row)
                    except Exception as exc:
                        row |= dict(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
                        traceback.print_exc()
                    rows.append(row)
                    if not row["ok"]:
                        print(_check_line(row), flush=True)
    print(f"variant correctness: {sum(r['ok'] for r in rows)}/{len(rows)} ok ({elapsed():.0f} s)", flush=True)
    return rows


def run_variant_speed(shapes: dict, ms: tuple, device, every: bool = True) -> list[dict]:
    """Every variant timed at each M (every False: one of each kind, as --smoke runs it)."""
    rows = []
    for name, (n, k) in shapes.items():
        qw, s, z, _ = weights(n, k, 4, 128, False, device, seed=7)
        w = ref.dequantize(qw, s, z, 4, 128).to(DTYPE)
        int4_bytes = qw.numel() * 4 + 2 * s.numel() * 2  # codes, scales and zeros
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=DTYPE)
            flop = 2 * m * n * k
            fns = {v: functools.partial(int4.w4a16_matmul, x, qw, s, z, 4, 128, config=cfg)
                   for v, cfg in variant_configs(m, n, k, every).items()}
            fns["bf16"] = functools.partial(torch.nn.functional.linear, x, w)
            for variant, fn in fns.items():
                row = dict(shape=name, n=n, k=k, m=m, variant=variant)
                if elapsed() > VARIANTS_DEADLINE_S:
                    rows.append(row | dict(skipped=True))
                    continue
                us = time_us(fn)
                weight_bytes = n * k * 2 if variant == "bf16" else int4_bytes
                rows.append(row | dict(us=us, gbs=weight_bytes / us / 1e3, tflops=flop / us / 1e6))
            done = [r for r in rows if r["shape"] == name and r["m"] == m and "us" in r]
            if done:
                print(f"{name:>16} M={m:<5} " + " ".join(f"{r['variant']}={r['us']:.1f}" for r in done), flush=True)
    return rows


def print_variant_tables(report: dict) -> bool:
    rows, speed = report["variant_checks"], report["variant_speed"]
    failed = [r for r in rows if not r.get("ok")]
    print("\n==== W4A16 variants: correctness against the dequantized weight in fp32 ====")
    print(f"{len(rows) - len(failed)}/{len(rows)} cases ok; worst max_rel "
          f"{max((r.get('max_rel', 0) for r in rows), default=0):.2e} (tolerance {TOLERANCE['max_rel']})")
    for r in failed:
        print("FAILED", _check_line(r))
    graphs = report["variant_graph"]
    print(f"CUDA graph capture (each variant at M = 1 or 1024, the expert GEMVs at T = 1): "
          f"{sum(g.get('ok', False) for g in graphs.values())}/{len(graphs)} ok")
    for name, g in graphs.items():
        if not g.get("ok"):
            print("FAILED graph", name, g)
    print("\n==== W4A16 variants: best per (shape, M), median us, L2 flushed; GB/s of int4 bytes read ====")
    if not torch.cuda.is_available():
        print("(CPU, Triton's interpreter: these times say nothing about the GPU)")
    print("today: the default int4 kernel (tile; the MoE's tiles); bf16: F.linear (cuBLAS) on the dequantized "
          "weight, the MoE: fused_moe with bf16 experts; M is T for the MoE")
    print(f"{'shape':>16} {'M':>5} {'best int4 variant':<26} {'us':>8} {'GB/s':>6} {'TFLOP/s':>7} {'today us':>8} "
          f"{'bf16 us':>8} {'bf16/best':>9}")
    won: dict[str, set] = {"gemv": set(), "dequant+cublas": set(), "moe gemv": set()}
    for (name, m) in dict.fromkeys((r["shape"], r["m"]) for r in speed):
        timed = {r["variant"]: r for r in speed if r["shape"] == name and r["m"] == m and "us" in r}
        int4_rows = [r for v, r in timed.items() if v != "bf16"]
        if not int4_rows:
            continue
        best = min(int4_rows, key=lambda r: r["us"])
        today = timed.get("tile", timed.get("moe tiles", {})).get("us", float("nan"))  # the default kernel
        bf16 = timed.get("bf16", {}).get("us", float("nan"))
        print(f"{name:>16} {m:>5} {best['variant']:<26} {best['us']:8.1f} {best['gbs']:6.0f} {best['tflops']:7.1f} "
              f"{today:8.1f} {bf16:8.1f} {bf16 / best['us']:9.2f}")
        kind = next((k for k in ("gemv", "moe gemv") if best["variant"].startswith(k)), best["variant"])
        won.get(kind, set()).add(m)
    skipped = [r for r in speed if r.get("skipped")]
    print(f"\nthe GEMV was best at M in {sorted(won['gemv'])}; dequantize + cuBLAS at M in "
          f"{sorted(won['dequant+cublas'])} (DEEPSERVE_INT4_GEMV_MAX_M / DEEPSERVE_INT4_CUBLAS_MIN_M; "
          "defaults 0 and 64)")
    print(f"the expert GEMVs were best at T in {sorted(won['moe gemv'])} (DEEPSERVE_INT4_MOE_GEMV_MAX_TOKENS; 0 = off)")
    good = not failed and all(v.get("ok", True) for v in report["variant_graph"].values())
    print(f"wall {elapsed():.0f} s; {len(skipped)} timings skipped past {VARIANTS_DEADLINE_S:.0f} s; "
          + ("ALL CORRECT" if good else "CORRECTNESS FAILURES"))
    return good


def run_variant_graphs(device) -> dict:
    """Each variant's launch captured in a CUDA graph and replayed: no host sync, same result."""
    if device.type != "cuda":
        return {}
    qw, s, z, _ = weights(4096, 4096, 4, 128, False, device, seed=3)
    out = {}
    for m in (1, 1024):
        x = torch.randn(m, 4096, device=device, dtype=DTYPE)
        for variant, cfg in variant_configs(m, 4096, 4096).items():
            try:
                want = int4.w4a16_matmul(x, qw, s, z, 4, 128, config=cfg)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    got = int4.w4a16_matmul(x, qw, s, z, 4, 128, config=cfg)
                graph.replay()
                torch.cuda.synchronize()
                out[f"{variant} M={m}"] = dict(ok=bool(torch.equal(got, want)))
            except Exception as exc:
                out[f"{variant} M={m}"] = dict(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
    x, w13, w2, tw, ids, experts = moe_case(1, MOE, device)
    try:  # the expert GEMVs at one token
        want = fm.fused_moe(x, w13, w2, tw, ids, Int4GemvConfig(), int4=experts)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = fm.fused_moe(x, w13, w2, tw, ids, Int4GemvConfig(), int4=experts)
        graph.replay()
        torch.cuda.synchronize()
        out["moe gemv T=1"] = dict(ok=bool(torch.equal(got, want)))
    except Exception as exc:
        out["moe gemv T=1"] = dict(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
    return out


def run_variants(args, device) -> int:
    shapes = SMOKE_VARIANTS["shapes"] if args.smoke else VARIANT_SHAPES
    # --ms / --moe-tokens: time (and check) only these, e.g. the decode GEMVs at one token
    check_ms = args.ms or (SMOKE_VARIANTS["check_ms"] if args.smoke else VARIANT_CHECK_MS)
    time_ms = args.ms or (SMOKE_VARIANTS["ms"] if args.smoke else VARIANT_MS)
    moe_tokens = args.moe_tokens or ((1,) if args.smoke else MOE_VARIANT_TOKENS)
    report = dict(env=bench_env.environment(device))
    report["variant_checks"] = run_variant_correctness(shapes, check_ms, device, args.one_of_each)
    report["variant_graph"] = run_variant_graphs(device)
    moe_checks, moe_speed = run_moe_variants(SMOKE["moe"] if args.smoke else MOE, args.moe_tokens or (
        (1, 3) if args.smoke else MOE_VARIANT_CHECK_TOKENS), moe_tokens, device, time_every=not args.smoke,
        one_of_each=args.one_of_each)
    report["variant_checks"] += moe_checks
    report["variant_speed"] = run_variant_speed(shapes, time_ms, device, every=not args.smoke)
    report["variant_speed"] += moe_speed
    report["wall_s"] = elapsed()
    report["timed_in_graphs"] = f"{sum(TIMED_IN_GRAPHS)} of {len(TIMED_IN_GRAPHS)}"
    print(f"timings from CUDA-graph replays: {report['timed_in_graphs']}")
    good = print_variant_tables(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0 if good else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    parser.add_argument("--variants", action="store_true",
                        help="check and time every GEMM variant (tile, GEMV, dequantize + cuBLAS) instead")
    parser.add_argument("--ms", type=lambda v: tuple(int(m) for m in v.split(",")),
                        help="with --variants: only these token counts, e.g. 1,2")
    parser.add_argument("--moe-tokens", type=lambda v: tuple(int(m) for m in v.split(",")),
                        help="with --variants: only these token counts for the fused MoE")
    parser.add_argument("--one-of-each", action="store_true",
                        help="with --variants: check one variant of each kind (not each tile of a kind); the "
                             "CPU smoke test's budget, as the interpreter runs every config")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.variants:
        return run_variants(args, device)
    shapes = SMOKE["shapes"] if args.smoke else SHAPES
    ms = SMOKE["ms"] if args.smoke else CHECK_MS
    moe_cfg = SMOKE["moe"] if args.smoke else MOE
    report = dict(env=bench_env.environment(device))
    report["gemm"] = run_gemm_correctness(shapes, ms, device)
    report["moe"] = run_moe_correctness(moe_cfg, SMOKE["moe_tokens"] if args.smoke else MOE_TOKENS, device)
    report["graph"] = run_graph_check(device)
    time_shapes = shapes if args.smoke else {s: SHAPES[s] for s in TIME_SHAPES}
    report["gemm_speed"] = run_gemm_speed(time_shapes, SMOKE["ms"] if args.smoke else TIME_MS, device)
    report["moe_speed"] = run_moe_speed(moe_cfg, (1,) if args.smoke else (1, 8, 64), device)
    report["wall_s"] = elapsed()
    report["timed_in_graphs"] = f"{sum(TIMED_IN_GRAPHS)} of {len(TIMED_IN_GRAPHS)}"
    print(f"timings from CUDA-graph replays: {report['timed_in_graphs']}")
    good = print_tables(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
