"""Where torch._scaled_mm's block-wise FP8 scaling (cuBLAS, DeepSeek's 1 x 128 activation and 128 x 128 weight
scales) is correct, and how fast it is against our Triton block-scaled GEMM. One H200 call.

In gate FP8 run 2 block-wise _scaled_mm raised CUBLAS_STATUS_NOT_SUPPORTED at M = 257 and returned wrong
products for K = 11,008 (86 scale groups). Each (N, K, M) is judged against the float32 product of the
dequantized operands, three ways:
  plain   scale_a = x_s.t().contiguous().t()  ([M, G], stride (1, M)),  scale_b = w_s.t()  (stride (1, G))
  padded  block_fp8_linear's cuBLAS path: quantize_per_token_group(cublas_layout=True) (M rounded up to a
          multiple of 4 with zero rows, scales [M4, G] with stride (1, M4)), scale_b = w_s.t(), out[:M]
  triton  fp8.block_fp8_matmul
(The first run, session of 2026-12-04 call 1, had "padded" as scale tensors with padded strides, M rows:
torch refused every one, "Invalid scaling configuration".)
Then TFLOP/s at 8192^3 and on prefill-sized DeepSeek shapes (L2 flushed, triton.testing.do_bench median).
Table last; JSON to --json.
    python bench/cublas_blockwise_probe.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_env  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402
from check_fp8 import errors, make_weight, make_x  # noqa: E402

from deepserve.kernels import fp8  # noqa: E402
from deepserve.kernels import fp8_ref as ref  # noqa: E402

BLOCK = (128, 128)
SHAPES = {  # name: (N, K); K / 128 in brackets where it is not a multiple of 4
    "8192^2": (8192, 8192), "V3 q_a": (1536, 7168), "V3 q_b": (24576, 1536), "V3 kv_a": (576, 7168),
    "V3 kv_b": (32768, 512), "V3 o": (7168, 16384), "V3 gate_up": (36864, 7168), "V3 down": (7168, 18432),
    "V3 shared gate_up": (4096, 7168), "V3 shared down": (7168, 2048),
    "7B qkv": (12288, 4096), "7B gate_up": (22016, 4096), "7B down [86]": (4096, 11008),
    "odd K [13]": (4096, 1664), "odd K [3]": (256, 384), "odd N": (1000, 1024), "V2-Lite down [11]": (2048, 1408),
}
CHECK_MS = (16, 64, 200, 257, 260, 1024, 1040, 4097)
BIG_M_SHAPES = ("8192^2", "V3 gate_up", "V3 down", "7B down [86]")
TOLERANCE = 2e-2  # max |out - ref| / max |ref|, bf16 output
TIME_CASES = [("8192^2", 8192), ("V3 gate_up", 8192), ("V3 down", 8192), ("V3 o", 8192), ("V3 q_b", 8192),
              ("V3 kv_a", 8192), ("7B gate_up", 8192), ("7B down [86]", 8192), ("V3 gate_up", 1024),
              ("V3 o", 1024), ("7B qkv", 512)]


def round_up(v: int, to: int) -> int:
    return (v + to - 1) // to * to


def scales_plain(x_s: torch.Tensor, w_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x_s.t().contiguous().t(), w_s.t()




def cublas(x_q, w_q, scale_a, scale_b) -> torch.Tensor:
    return torch._scaled_mm(x_q, w_q.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)


def cublas_plain(x_q, x_s, w_q, w_s) -> torch.Tensor:
    return cublas(x_q, w_q, *scales_plain(x_s, w_s))


def cublas_padded(x_q, x_s, w_q, w_s, m) -> torch.Tensor:
    return cublas(x_q, w_q, x_s, w_s.t())[:m]


def judge(fn, expected: torch.Tensor) -> dict:
    try:
        out = fn()
        torch.cuda.synchronize()
    except Exception as exc:  # cuBLAS refusals arrive as RuntimeError; record whatever comes
        return dict(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    err = errors(out, expected)
    return err | dict(ok=err["max_rel"] <= TOLERANCE and not err["nan"])


def run_checks(device: torch.device) -> list[dict]:
    rows = []
    for name, (n, k) in SHAPES.items():
        w_q, w_s = ref.quantize_weight_block(make_weight(n, k, device, seed=n + k), BLOCK)
        w_deq = ref.dequantize_weight_block(w_q, w_s, BLOCK)
        for m in CHECK_MS + ((8192,) if name in BIG_M_SHAPES else ()):
            x = make_x(m, k, device, seed=m)
            x_q, x_s = fp8.quantize_per_token_group(x, BLOCK[1])
            x_q2, x_s2 = fp8.quantize_per_token_group(x, BLOCK[1], cublas_layout=True)
            expected = ref.dequantize_per_token_group(x_q, x_s, BLOCK[1]) @ w_deq.t()
            row = dict(shape=name, n=n, k=k, m=m, token_major_scales_equal=bool(
                torch.equal(x_q.view(torch.uint8), x_q2[:m].view(torch.uint8)) and torch.equal(x_s, x_s2[:m])
                and x_s2.stride() == (1, round_up(m, 4)) and not x_q2[m:].float().any()))
            row["plain"] = judge(partial(cublas_plain, x_q, x_s, w_q, w_s), expected)
            row["padded"] = judge(partial(cublas_padded, x_q2, x_s2, w_q, w_s, m), expected)
            row["triton"] = judge(partial(fp8.block_fp8_matmul, x_q, x_s, w_q, w_s, BLOCK, torch.bfloat16), expected)
            rows.append(row)
            print(check_line(row), flush=True)
            del expected
    return rows


def cell(res: dict) -> str:
    if "error" in res:
        return "ERR " + res["error"][:40]
    return f"{'ok ' if res['ok'] else 'BAD'} {res['max_rel']:.1e}"


def check_line(row: dict) -> str:
    return (f"{row['shape']:>18} M={row['m']:<5} plain {cell(row['plain']):<48} padded {cell(row['padded']):<14} "
            f"triton {cell(row['triton'])}")


def time_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def run_timings(device: torch.device) -> list[dict]:
    rows = []
    for name, m in TIME_CASES:
        n, k = SHAPES[name]
        w_q, w_s = ref.quantize_weight_block(make_weight(n, k, device, seed=n + k), BLOCK)
        x = make_x(m, k, device, seed=7)
        x_q, x_s = fp8.quantize_per_token_group(x, BLOCK[1])
        xq_pad, xs_pad = fp8.quantize_per_token_group(x, BLOCK[1], cublas_layout=True)
        fns = {
            "triton": partial(fp8.block_fp8_matmul, x_q, x_s, w_q, w_s, BLOCK, torch.bfloat16),
            "cublas padded": partial(cublas_padded, xq_pad, xs_pad, w_q, w_s, m),
            "quant + triton": partial(fp8.block_fp8_linear, x, w_q, w_s, BLOCK),
            "quant + cublas": partial(quant_then_cublas, x, w_q, w_s),
        }
        row = dict(shape=name, m=m, n=n, k=k)
        for label, fn in fns.items():
            try:
                us = time_us(fn)
                row[label] = dict(us=us, tflops=2 * m * n * k / us / 1e6)
            except Exception as exc:
                row[label] = dict(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        rows.append(row)
        print(time_line(row), flush=True)
    return rows


def quant_then_cublas(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
    # block_fp8_linear's cuBLAS path without its shape gate
    x_q, x_s = fp8.quantize_per_token_group(x, BLOCK[1], cublas_layout=True)
    return cublas_padded(x_q, x_s, w_q, w_s, x.shape[0])


def time_line(row: dict) -> str:
    cells = []
    for label in ("triton", "cublas padded", "quant + triton", "quant + cublas"):
        res = row[label]
        cells.append(f"{label} " + (f"{res['us']:8.1f} us {res['tflops']:6.0f}" if "us" in res else res["error"][:40]))
    return f"{row['shape']:>14} M={row['m']:<5} " + " | ".join(cells)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    start = time.perf_counter()
    report = dict(env=bench_env.environment(device, cuda=torch.version.cuda))
    report["checks"] = run_checks(device)
    report["timings"] = run_timings(device)
    report["seconds"] = time.perf_counter() - start
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print("\n== correctness (max rel error vs fp32 of the dequantized operands; ok <= 2e-2) ==")
    for variant in ("plain", "padded", "triton"):
        bad = [f"{r['shape']} M={r['m']}" for r in report["checks"] if not r[variant].get("ok")]
        print(f"{variant:>7}: {len(report['checks']) - len(bad)}/{len(report['checks'])} ok; not ok: {bad}")
    unequal = [f"{r['shape']} M={r['m']}" for r in report["checks"] if not r["token_major_scales_equal"]]
    print(f"token-major activation scales equal to the row-major ones (codes too): all but {unequal}")
    print("\n== TFLOP/s ==")
    for row in report["timings"]:
        print(time_line(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
