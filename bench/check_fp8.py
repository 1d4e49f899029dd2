"""Correctness and speed of the FP8 W8A8 linear kernels (deepserve/kernels/fp8.py), in one run on one H200.

1. Correctness, every (N, K) of SHAPES at M = 1, 2, 3, 8, 64, 257, 1024, 8192 (fresh random bf16 inputs
   whose activation groups and weight blocks differ in magnitude): quantize_per_token_group bit for bit
   against quantize_per_token_group_ref (mismatched fp8 bytes and scales are counted), block_fp8_linear
   and channel_fp8_linear against an fp32 product of the reference-quantized operands (max relative
   error = max |out - ref| / max |ref|, and the Frobenius ratio); where the linears stream the weight with
   the activations unquantized (fp8.activations_unquantized: M <= fp8.GEMV_MAX_M, 1 by default, or the
   tensor-core GEMV's M <= fp8.MMA_GEMV_MAX_M), judged against that product.
2. Speed at M = 1, 16, 64, 256, 1024, 8192: block_fp8_linear (quantization included), channel_fp8_linear
   and bf16 F.linear, median of triton.testing.do_bench (L2 flushed before each run, so weights come
   from HBM as in a decode step). A CUDA graph captures both fp8 linears once (no host sync).
3. M = N = K = 8192: block_fp8_matmul TFLOP/s (target >= 1000; fp8 dense peak measured 1395), its tile
   variants, torch._scaled_mm row-wise and (where this torch has it) block-wise, and bf16 for scale.
4. Tile variants, split-K on/off, at each M on a few shapes, while the run is young: the fastest per
   (M, shape) is printed, to set default_config from.

Tables come last; JSON to --json. Under 120 s on the H200 (later parts are skipped past DEADLINE_S).
    python bench/check_fp8.py --json OUT.json     # the H200 run
    python bench/check_fp8.py --smoke             # tiny shapes; on a CPU-only machine under TRITON_INTERPRET
"""

from __future__ import annotations

import argparse
import functools
import json
import os
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

import triton  # noqa: E402
import triton.testing  # noqa: E402

from deepserve.kernels import fp8  # noqa: E402
from deepserve.kernels import fp8_ref as ref  # noqa: E402

START = time.perf_counter()
DEADLINE_S = 105.0  # past this, remaining timings and variants are skipped (and listed as skipped)
BLOCK = (128, 128)
SHAPES = {  # name: (N, K)
    "odd": (1000, 328), "V3 q_a": (1536, 7168), "V3 q_b": (24576, 1536), "V3 kv_a": (576, 7168),
    "V3 o": (7168, 16384), "V3 gate_up": (36864, 7168), "V3 down": (7168, 18432),
    "7B qkv/o": (4096, 4096), "7B gate_up": (22016, 4096), "7B down": (4096, 11008),
}
CHECK_MS = (1, 2, 3, 8, 64, 257, 1024, 8192)
TIME_MS = (1, 16, 64, 256, 1024, 8192)
VARIANT_SHAPES = ("V3 kv_a", "V3 o", "V3 gate_up", "7B qkv/o")
SMOKE_SHAPES = {"odd": (200, 328), "even": (130, 256)}
SMOKE_MS = (1, 3, 40)
TOLERANCE = dict(max_rel=2e-2, norm_rel=1e-2)  # bf16 output against fp32
GC = fp8.Fp8GemmConfig
# Alternatives timed next to default_config's pick, by regime. "+split": split_k from split_count.
DECODE_VARIANTS = {
    "m16-n64-s4": GC(16, 64, 128, 1, 4, 4), "m16-n64-s4+split": GC(16, 64, 128, 1, 4, 4, -1),
    "m16-n32-s6+split": GC(16, 32, 128, 1, 4, 6, -1), "m16-n128-s4+split": GC(16, 128, 128, 1, 4, 4, -1),
    "m16-n64-s6+split": GC(16, 64, 128, 1, 4, 6, -1), "m64-n64-s4+split": GC(64, 64, 128, 1, 4, 4, -1),
    "m32-n64-s4+split": GC(32, 64, 128, 1, 4, 4, -1),
}
PREFILL_VARIANTS = {
    "m64-n128-w4-s4": GC(64, 128, 128, 8, 4, 4), "m128-n128-w8-s3": GC(128, 128, 128, 8, 8, 3),
    "m128-n128-w8-s4": GC(128, 128, 128, 8, 8, 4), "m128-n128-w8-s5": GC(128, 128, 128, 8, 8, 5),
    "m128-n64-w4-s4": GC(128, 64, 128, 8, 4, 4), "m128-n128-w8-s4-g16": GC(128, 128, 128, 16, 8, 4),
    "m256-n128-w16-s3": GC(256, 128, 128, 8, 16, 3),  # ptxas: a small spill at 128 registers
    "m128-n256-w8-s3": GC(128, 256, 128, 8, 8, 3),  # ptxas: spills (two 128-register accumulators)
}


def elapsed() -> float:
    return time.perf_counter() - START


def make_weight(n: int, k: int, device: torch.device, seed: int) -> torch.Tensor:
    """bf16 [N, K], std ~0.02, each 128 x 128 block with its own magnitude (x 10^-1 .. 10^1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    nb, kb = triton.cdiv(n, 128), triton.cdiv(k, 128)
    mag = 10 ** (torch.rand(nb, kb, generator=gen, device=device) * 2 - 1)
    mag = mag.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return (torch.randn(n, k, generator=gen, device=device) * 0.02 * mag).to(torch.bfloat16)


def make_x(m: int, k: int, device: torch.device, seed: int) -> torch.Tensor:
    """bf16 [M, K], each (token, 128-group) with its own magnitude (10^-1 .. 10^1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    mag = 10 ** (torch.rand(m, triton.cdiv(k, 128), generator=gen, device=device) * 2 - 1)
    return (torch.randn(m, k, generator=gen, device=device) * mag.repeat_interleave(128, 1)[:, :k]).bfloat16()


def errors(out: torch.Tensor, expected: torch.Tensor) -> dict:
    diff = (out.float() - expected).abs()
    return dict(max_rel=(diff.max() / expected.abs().max().clamp_min(1e-30)).item(),
                norm_rel=(diff.norm() / expected.norm().clamp_min(1e-30)).item(), nan=bool(out.isnan().any()))


def check_quant(x: torch.Tensor) -> dict:
    q, s = fp8.quantize_per_token_group(x, BLOCK[1])
    q_ref, s_ref = ref.quantize_per_token_group_ref(x, BLOCK[1])
    q_bad = int((q.view(torch.uint8) != q_ref.view(torch.uint8)).sum())
    s_bad = int((s != s_ref).sum())
    return dict(q_mismatch=q_bad, scale_mismatch=s_bad, max_scale_rel=((s - s_ref).abs() / s_ref).max().item())


def check_block(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, w_deq: torch.Tensor) -> dict:
    """w_deq: ref.dequantize_weight_block(w_q, w_s, BLOCK), fp32 [N, K]. Where the linear streams the weight
    with the activations unquantized (a GEMV), it is judged on that product."""
    if fp8.activations_unquantized(x, w_q, BLOCK):
        return errors(fp8.block_fp8_linear(x, w_q, w_s, BLOCK), x.float() @ w_deq.T)
    x_q, x_s = ref.quantize_per_token_group_ref(x, BLOCK[1])
    expected = ref.dequantize_per_token_group(x_q, x_s, BLOCK[1]) @ w_deq.T
    return errors(fp8.block_fp8_linear(x, w_q, w_s, BLOCK), expected)


def check_channel(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, w_float: torch.Tensor) -> dict:
    """w_float: w_q.float(), [N, K]; the GEMV's tokens as in check_block (on CUDA: on a CPU channel_fp8_linear
    is the quantizing reference at every M)."""
    if x.is_cuda and fp8.activations_unquantized(x, w_q, None):
        return errors(fp8.channel_fp8_linear(x, w_q, w_s), (x.float() @ w_float.T) * w_s[None, :])
    x_q, x_s = ref.quantize_per_token_group_ref(x, x.shape[1])
    expected = (x_q.float() @ w_float.T) * x_s * w_s[None, :]
    return errors(fp8.channel_fp8_linear(x, w_q, w_s), expected)


def error_text(exc: Exception) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def run_correctness(shapes: dict, ms: tuple, device: torch.device) -> list[dict]:
    rows = []
    for name, (n, k) in shapes.items():
        w = make_weight(n, k, device, seed=n + k)
        (bw_q, bw_s), (cw_q, cw_s) = ref.quantize_weight_block(w, BLOCK), ref.quantize_weight_per_channel(w)
        del w
        bw_deq, cw_float = ref.dequantize_weight_block(bw_q, bw_s, BLOCK), cw_q.float()  # [N, K] fp32 each
        for m in ms:
            row = dict(shape=name, n=n, k=k, m=m)
            if elapsed() > DEADLINE_S:
                rows.append(row | dict(ok=False, error="skipped: past the deadline"))
                continue
            try:
                x = make_x(m, k, device, seed=m)
                row |= dict(quant=check_quant(x), block=check_block(x, bw_q, bw_s, bw_deq),
                            channel=check_channel(x, cw_q, cw_s, cw_float))
                row["ok"] = (row["quant"]["q_mismatch"] == 0 and row["quant"]["scale_mismatch"] == 0
                             and all(_within(row[p]) for p in ("block", "channel")))
            except Exception as exc:  # a failing case is recorded and the run goes on
                row |= dict(ok=False, error=error_text(exc))
                traceback.print_exc()
            rows.append(row)
            print(_correctness_line(row), flush=True)
        del bw_deq, cw_float
    return rows


def _within(err: dict) -> bool:
    return not err["nan"] and err["max_rel"] <= TOLERANCE["max_rel"] and err["norm_rel"] <= TOLERANCE["norm_rel"]


def _correctness_line(row: dict) -> str:
    if "error" in row:
        return f"{row['shape']:>11} M={row['m']:<5} ERROR {row['error']}"
    q, b, c = row["quant"], row["block"], row["channel"]
    return (f"{row['shape']:>11} M={row['m']:<5} quant q/scale mismatches {q['q_mismatch']}/{q['scale_mismatch']}"
            f"  block max_rel {b['max_rel']:.2e}  channel max_rel {c['max_rel']:.2e}  {'ok' if row['ok'] else 'FAIL'}")


def time_us(fn) -> float:
    """Median microseconds of fn (L2 flushed before each run); one plain run on CPU (--smoke)."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    return triton.testing.do_bench(fn, warmup=10, rep=30, return_mode="median") * 1e3


def tflops(m: int, n: int, k: int, us: float) -> float:
    return 2 * m * n * k / us / 1e6


def run_speed(shapes: dict, ms: tuple, device: torch.device) -> list[dict]:
    rows = []
    for name, (n, k) in shapes.items():
        w = make_weight(n, k, device, seed=n + k)
        (bw_q, bw_s), (cw_q, cw_s) = ref.quantize_weight_block(w, BLOCK), ref.quantize_weight_per_channel(w)
        for m in ms:
            row = dict(shape=name, n=n, k=k, m=m)
            if elapsed() > DEADLINE_S:
                rows.append(row | dict(skipped=True))
                continue
            x = make_x(m, k, device, seed=m)
            try:
                row |= dict(config=str(fp8.default_config(m, n, k, BLOCK, _sms(device))),
                            block_us=time_us(functools.partial(fp8.block_fp8_linear, x, bw_q, bw_s, BLOCK)),
                            channel_us=time_us(functools.partial(fp8.channel_fp8_linear, x, cw_q, cw_s)),
                            bf16_us=time_us(functools.partial(torch.nn.functional.linear, x, w)))
            except Exception as exc:
                row["error"] = error_text(exc)
                traceback.print_exc()
            rows.append(row)
            print(_speed_line(row), flush=True)
    return rows


def _speed_line(row: dict) -> str:
    if "error" in row or "block_us" not in row:
        return f"{row['shape']:>11} M={row['m']:<5} {row.get('error', 'skipped')}"
    return (f"{row['shape']:>11} M={row['m']:<5} block {row['block_us']:9.1f} us  channel {row['channel_us']:9.1f} us"
            f"  bf16 {row['bf16_us']:9.1f} us  block {tflops(row['m'], row['n'], row['k'], row['block_us']):7.1f}"
            f" TFLOP/s  ({row['config']})")


def run_graph_check(device: torch.device) -> dict:
    """Both fp8 linears at M = 1 on kv_a, captured in a CUDA graph: proves no host sync; per-call
    microseconds with no launch overhead (weights L2-resident: a floor, not a decode time)."""
    if device.type != "cuda":
        return {}
    n, k = SHAPES["V3 kv_a"]
    w = make_weight(n, k, device, seed=1)
    (bw_q, bw_s), (cw_q, cw_s) = ref.quantize_weight_block(w, BLOCK), ref.quantize_weight_per_channel(w)
    x = make_x(1, k, device, seed=1)
    try:
        return dict(block_us=bench_env.graph_per_call_us([lambda: fp8.block_fp8_linear(x, bw_q, bw_s, BLOCK)], 20, 10),
                    channel_us=bench_env.graph_per_call_us([lambda: fp8.channel_fp8_linear(x, cw_q, cw_s)], 20, 10))
    except Exception as exc:
        traceback.print_exc()
        return dict(error=error_text(exc))


def run_peak(device: torch.device, size: int) -> dict:
    """TFLOP/s at M = N = K = size: our GEMM (default and prefill variants), the fp8 linear with its
    quantization, torch._scaled_mm row-wise and block-wise, bf16."""
    x, w = make_x(size, size, device, seed=3), make_weight(size, size, device, seed=4)
    x_q, x_s = fp8.quantize_per_token_group(x, BLOCK[1])
    w_q, w_s = ref.quantize_weight_block(w, BLOCK)
    cx_q, cx_s = fp8.quantize_per_token_group(x, size)
    cw_q, cw_s = ref.quantize_weight_per_channel(w)
    bf16 = torch.bfloat16
    candidates = {"block_fp8_matmul default": lambda: fp8.block_fp8_matmul(x_q, x_s, w_q, w_s, BLOCK, bf16)}
    candidates |= {f"block_fp8_matmul {label}": (lambda c=cfg: fp8.block_fp8_matmul(x_q, x_s, w_q, w_s, BLOCK, bf16,
                                                                                     config=c))
                   for label, cfg in PREFILL_VARIANTS.items()}
    candidates |= {
        "block_fp8_linear (with quant)": lambda: fp8.block_fp8_linear(x, w_q, w_s, BLOCK),
        "torch._scaled_mm rowwise": lambda: torch._scaled_mm(cx_q, cw_q.t(), scale_a=cx_s, scale_b=cw_s.view(1, -1),
                                                             out_dtype=bf16),
        # cuBLAS 1x128 (activations, outer-dim-major) x 128x128 (weights) block scaling, where torch has it.
        "torch._scaled_mm blockwise": lambda: torch._scaled_mm(x_q, w_q.t(), scale_a=x_s.t().contiguous().t(),
                                                               scale_b=w_s.t(), out_dtype=bf16),
        "bf16 F.linear": lambda: torch.nn.functional.linear(x, w),
    }
    result = {}
    for label, fn in candidates.items():
        if elapsed() > DEADLINE_S + 5:
            result[label] = dict(skipped=True)
            continue
        try:
            us = time_us(fn)
            result[label] = dict(us=us, tflops=tflops(size, size, size, us))
        except Exception as exc:  # e.g. a torch without block-wise _scaled_mm
            result[label] = dict(error=error_text(exc))
        print(f"{size}^3 {label:>40}: {_peak_cell(result[label])}", flush=True)
    if "us" in result["torch._scaled_mm blockwise"]:  # the same numerics, another implementation: compare
        ours = fp8.block_fp8_matmul(x_q, x_s, w_q, w_s, BLOCK, torch.float32)
        result["torch._scaled_mm blockwise"]["vs_triton"] = errors(candidates["torch._scaled_mm blockwise"](), ours)
    return result


def _peak_cell(res: dict) -> str:
    if "tflops" in res:
        return f"{res['tflops']:7.1f} TFLOP/s ({res['us']:.0f} us)"
    return res.get("error", "skipped")


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def resolve(cfg: fp8.Fp8GemmConfig, m: int, n: int, k: int, sms: int) -> fp8.Fp8GemmConfig:
    """split_k -1 (a variant's "+split"): the split default_config's rule would give this tile."""
    if cfg.split_k != -1:
        return cfg
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    return replace(cfg, split_k=fp8.split_count(tiles, triton.cdiv(k, cfg.block_k), sms))


def variant_configs(m: int, n: int, k: int, sms: int) -> dict[str, fp8.Fp8GemmConfig]:
    default = fp8.default_config(m, n, k, BLOCK, sms)
    found = {"default": default, "default-nosplit": replace(default, split_k=1)}
    for label, cfg in (DECODE_VARIANTS if m <= 64 else PREFILL_VARIANTS).items():
        found[label] = resolve(cfg, m, n, k, sms)
    unique: dict[fp8.Fp8GemmConfig, str] = {}
    for label, cfg in found.items():
        unique.setdefault(cfg, label)  # the first label of a config that appears twice
    return {label: cfg for cfg, label in unique.items()}


def run_variants(shapes: dict, ms: tuple, device: torch.device) -> list[dict]:
    rows = []
    for name, (n, k) in shapes.items():
        w_q, w_s = ref.quantize_weight_block(make_weight(n, k, device, seed=n + k), BLOCK)
        for m in ms:
            if elapsed() > DEADLINE_S:
                rows.append(dict(shape=name, m=m, skipped=True))
                continue
            x_q, x_s = fp8.quantize_per_token_group(make_x(m, k, device, seed=m), BLOCK[1])
            times, configs = {}, variant_configs(m, n, k, _sms(device))
            for label, cfg in configs.items():
                if elapsed() > DEADLINE_S + 5:
                    break
                try:
                    times[label] = time_us(functools.partial(fp8.block_fp8_matmul, x_q, x_s, w_q, w_s, BLOCK,
                                                             torch.bfloat16, config=cfg))
                except Exception as exc:
                    print(f"variant {label} at M={m} {name}: {error_text(exc)}", flush=True)
            best = min(times, key=times.get) if times else None
            rows.append(dict(shape=name, m=m, times_us=times, best=best,
                             configs={label: str(cfg) for label, cfg in configs.items()},
                             default_over_best=times.get("default", float("nan")) / times[best] if best else None))
            print(_variant_line(rows[-1]), flush=True)
    return rows


def _variant_line(row: dict) -> str:
    if row.get("skipped") or not row.get("best"):
        return f"{row['shape']:>11} M={row['m']:<5} variants skipped"
    cells = "  ".join(f"{label} {us:.1f}" for label, us in sorted(row["times_us"].items(), key=lambda kv: kv[1]))
    slower = row["default_over_best"]
    return f"{row['shape']:>11} M={row['m']:<5} fastest {row['best']} (default x{slower:.2f} slower)  {cells}"


def print_tables(report: dict) -> None:
    rows = report["correctness"]
    failed = [r for r in rows if not r.get("ok")]
    print("\n==== correctness ====")
    exact = sum(1 for r in rows if "quant" in r and r["quant"]["q_mismatch"] + r["quant"]["scale_mismatch"] == 0)
    print(f"{len(rows) - len(failed)}/{len(rows)} cases ok; quantization bit-exact in {exact}")
    for part in ("block", "channel"):
        worst = max((r[part]["max_rel"] for r in rows if part in r), default=float("nan"))
        print(f"worst {part} max relative error {worst:.3e} (tolerance {TOLERANCE['max_rel']})")
    for r in failed:
        print("FAILED", _correctness_line(r))
    print("\n==== speed (us, median; L2 flushed) ====")
    print(f"{'shape':>11} {'M':>5} {'block fp8':>10} {'channel fp8':>12} {'bf16':>9} {'bf16/block':>10} "
          f"{'bf16/chan':>10}")
    for r in report["speed"]:
        if "block_us" in r:
            print(f"{r['shape']:>11} {r['m']:>5} {r['block_us']:10.1f} {r['channel_us']:12.1f} {r['bf16_us']:9.1f} "
                  f"{r['bf16_us'] / r['block_us']:10.2f} {r['bf16_us'] / r['channel_us']:10.2f}")
    print(f"\ngraph (M=1 kv_a, us per call): {report['graph']}")
    print(f"\n==== {report['peak_size']}^3 TFLOP/s (target >= 1000, fp8 peak measured 1395) ====")
    for label, res in report["peak"].items():
        print(f"{label:>40}: {_peak_cell(res)}")
    print("\n==== fastest tile per (M, shape) ====")
    for r in report["variants"]:
        print(_variant_line(r))
    print(f"\nwall {elapsed():.0f} s; " + ("ALL CORRECT" if not failed else f"{len(failed)} CORRECTNESS FAILURES"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references are fp32
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    report = dict(env=bench_env.environment(device), peak_size=256 if args.smoke else 8192)
    # Most wanted first: later parts give way to the deadline.
    report["correctness"] = run_correctness(shapes, SMOKE_MS if args.smoke else CHECK_MS, device)
    report["graph"] = run_graph_check(device)
    report["peak"] = run_peak(device, report["peak_size"])
    report["speed"] = run_speed(shapes, SMOKE_MS if args.smoke else TIME_MS, device)
    variant_shapes = {"even": shapes["even"]} if args.smoke else {s: SHAPES[s] for s in VARIANT_SHAPES}
    report["variants"] = run_variants(variant_shapes, SMOKE_MS if args.smoke else TIME_MS, device)
    report["wall_s"] = elapsed()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str))
    print_tables(report)
    return 0 if all(r.get("ok") for r in report["correctness"]) else 1


if __name__ == "__main__":
    sys.exit(main())
