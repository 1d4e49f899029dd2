"""Correctness and speed of the fused MoE kernel with block-scaled FP8 experts (W8A8), in one run on one H200.

Shapes: DeepSeek-V3 experts on one GPU (E 256, top-8, H 7168, I 2048), the same under TP8 (I 256) and a
V2-Lite-like model (E 64, top-6, H 2048, I 1408), at T = 1, 8, 64, 256, 1024, 4096 tokens. Weights are
random bf16 (every product O(1)), quantized with fp8_ref.quantize_weight_block into 128 x 128 blocks;
routing is softmax top-K of random logits, renormalized.

1. Correctness: the FP8 kernel (default config, workspaces poisoned with NaN) against fused_moe_fp8_ref
   (bf16 relative error < 2e-2); also its distance from the bf16 kernel on the unquantized weights
   (the quantization error itself, a few percent: a scale misread by kernel and reference alike
   would show up there).
2. Speed, FP8 against the bf16 kernel, both with their default configs: at T <= 256 per call inside a
   CUDA graph cycling through 8 routings (a decode step's cost without launch overhead, and the experts
   change from call to call so the L2 does not serve them; capture also proves there is no host sync);
   above, the median of triton.testing.do_bench (L2 flushed before each run). Effective weight
   bandwidth = bytes of the experts the call touches (fp8 + scales, or bf16) / time; TFLOP/s = 2 T K 3 H I
   / time.
3. Tile variants of the FP8 path (including the other activation-quantization placement) in every case
   until VARIANTS_UNTIL_S, each checked first: to choose default_fp8_config from.

Kernels compile first in a pool of processes (the Triton cache is shared on disk), while the main process
builds the weights: one process would spend most of the budget compiling. The table comes last;
JSON to --json.

    python bench/check_fp8_moe.py --json OUT.json     # the H200 run, < 90 s
    python bench/check_fp8_moe.py --smoke             # tiny shapes; on a CPU-only machine under TRITON_INTERPRET
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

import bench_env
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # --smoke on CPU; must precede the first `import triton`
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import triton  # noqa: E402
import triton.testing  # noqa: E402

from deepserve.kernels import fp8_ref  # noqa: E402
from deepserve.kernels import fused_moe as fm  # noqa: E402

START = time.perf_counter()
VARIANTS_UNTIL_S = 76.0  # variants start only before this (each takes ~1 s); the defaults always run
WARM_TIMEOUT_S = 40.0
BLOCK = (128, 128)
TOLERANCE = 2e-2
MODELS = {"V3": (256, 7168, 2048, 8), "V3-TP8": (256, 7168, 256, 8), "V2-Lite": (64, 2048, 1408, 6)}  # E, H, I, K
TOKENS = (1, 8, 64, 256, 1024, 4096)
SMOKE_MODELS = {"tiny": (8, 200, 96, 2)}
SMOKE_TOKENS = (1, 40)
GRAPH_MAX_TOKENS = 256  # at or below: timed as CUDA-graph replays over ROUTINGS routings
ROUTINGS = 8
VARIANT_TOKEN_ORDER = (1, 4096, 64, 1024, 256, 8)  # which cases get variants first, if time runs short
MC = fm.MoEConfig
# Alternatives to the default, by the default's row tile (its regime). "once": x quantized by a separate
# kernel and act in the gate-up epilogue; the others quantize in every GEMM program.
VARIANTS = {
    16: {"m16n32s4": MC(16, 32, 128, 1, 4, 4), "m16n64s4": MC(16, 64, 128, 1, 4, 4),
         "m16n64s6": MC(16, 64, 128, 1, 4, 6), "m16n128w8s4": MC(16, 128, 128, 1, 8, 4),
         "m16n128w8s4-once": MC(16, 128, 128, 1, 8, 4, prequantize=True)},
    32: {"m16n64s4": MC(16, 64, 128, 1, 4, 4), "m32n64w4s4": MC(32, 64, 128, 4, 4, 4),
         "m32n128w8s3-once": MC(32, 128, 128, 4, 8, 3, prequantize=True),
         "m64n128w8s4-once": MC(64, 128, 128, 8, 8, 4, prequantize=True)},
    64: {"m64n128w8s3-once": MC(64, 128, 128, 8, 8, 3, prequantize=True),
         "m128n128w8s3-once": MC(128, 128, 128, 8, 8, 3, prequantize=True),
         "m64n64w4s3": MC(64, 64, 128, 8, 4, 3), "m128n64w8s3": MC(128, 64, 128, 8, 8, 3),
         "m32n64w8s4": MC(32, 64, 128, 4, 8, 4)},
}


@dataclass
class Experts:
    """One model's routed experts: bf16 w13 [E, 2I, H], w2 [E, H, I] and their FP8 copies with scales."""

    w13: torch.Tensor
    w2: torch.Tensor
    q13: torch.Tensor
    s13: torch.Tensor
    q2: torch.Tensor
    s2: torch.Tensor


@dataclass
class Row:
    model: str
    tokens: int
    hit: float = 0.0  # experts touched per call (mean over the routings timed)
    ok: bool = False
    rel_err: float | None = None  # FP8 kernel vs fused_moe_fp8_ref
    vs_bf16: float | None = None  # FP8 kernel vs the bf16 kernel on the unquantized weights
    fp8_us: float | None = None
    bf16_us: float | None = None
    fp8_gbs: float | None = None
    bf16_gbs: float | None = None
    fp8_tflops: float | None = None
    bf16_tflops: float | None = None
    config: str = ""
    variants: dict[str, float | str] = field(default_factory=dict)  # name -> us, or what went wrong
    error: str = ""


def make_experts(model: str, device: torch.device) -> Experts:
    e, h, i, _ = (MODELS | SMOKE_MODELS)[model]
    w13 = torch.randn(e, 2 * i, h, device=device, dtype=torch.bfloat16) * h**-0.5
    w2 = torch.randn(e, h, i, device=device, dtype=torch.bfloat16) * i**-0.5
    # I is a multiple of bn here, so quantizing w13[e] whole equals quantizing gate and up apart.
    q13, s13 = zip(*(fp8_ref.quantize_weight_block(w13[x], BLOCK) for x in range(e)), strict=True)
    q2, s2 = zip(*(fp8_ref.quantize_weight_block(w2[x], BLOCK) for x in range(e)), strict=True)
    return Experts(w13, w2, torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2))


def routings(tokens: int, experts: int, k: int, count: int, device: torch.device
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """count routings: (topk_weights [T, K] float32, topk_ids [T, K])."""
    out = []
    for _ in range(count):
        top = torch.randn(tokens, experts, device=device).softmax(-1).topk(k, dim=-1)
        out.append(((top.values / top.values.sum(-1, keepdim=True)).contiguous(), top.indices))
    return out


def fp8_moe(ex: Experts, x: torch.Tensor, route: tuple[torch.Tensor, torch.Tensor],
            config: fm.MoEConfig | None = None) -> torch.Tensor:
    return fm.fused_moe(x, ex.q13, ex.q2, *route, config=config, w13_scale=ex.s13, w2_scale=ex.s2, block=BLOCK)


def bf16_moe(ex: Experts, x: torch.Tensor, route: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return fm.fused_moe(x, ex.w13, ex.w2, *route)


def timed_us(call: Callable[[tuple], object], routes: list, tokens: int, device: torch.device) -> float:
    """Median microseconds per call (module docstring, 2)."""
    if device.type != "cuda":  # --smoke: one interpreted call, only to exercise the script
        start = time.perf_counter()
        call(routes[0])
        return (time.perf_counter() - start) * 1e6
    if tokens <= GRAPH_MAX_TOKENS:
        fns = [lambda r=r: call(r) for r in routes]
        return bench_env.graph_per_call_us(fns, min_calls=len(fns), repeats=5)
    return triton.testing.do_bench(lambda: call(routes[0]), warmup=5, rep=25, return_mode="median") * 1e3


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("nan")  # fails every comparison
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def poisoned(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    return torch.full((rows, cols), float("nan"), device=like.device).to(like.dtype)


def checked_error(ex: Experts, x: torch.Tensor, route: tuple, ref: torch.Tensor, config: fm.MoEConfig | None
                  ) -> float:
    # One call with NaN workspaces -> relative error against the reference (NaN if anything is not finite).
    plain, fm._workspace = fm._workspace, poisoned
    try:
        return relative_error(fp8_moe(ex, x, route, config), ref)
    finally:
        fm._workspace = plain


def weight_bytes(model: str, hit: float, fp8: bool) -> float:
    _, h, i, _ = (MODELS | SMOKE_MODELS)[model]
    if not fp8:
        return hit * 3 * h * i * 2
    (bn, bk), cdiv = BLOCK, triton.cdiv
    scales = 2 * cdiv(i, bn) * cdiv(h, bk) + cdiv(h, bn) * cdiv(i, bk)  # float32 each
    return hit * (3 * h * i + 4 * scales)


def run_case(model: str, tokens: int, ex: Experts, device: torch.device) -> tuple[Row, tuple]:
    """The defaults: correctness, then FP8 and bf16 timings. -> (row, what run_variants needs)."""
    e, h, i, k = (MODELS | SMOKE_MODELS)[model]
    row = Row(model, tokens)
    x = torch.randn(tokens, h, device=device, dtype=torch.bfloat16)
    routes = routings(tokens, e, k, ROUTINGS if tokens <= GRAPH_MAX_TOKENS else 1, device)
    row.hit = sum(int(ids.unique().numel()) for _, ids in routes) / len(routes)
    row.config = str(fm.default_fp8_config(tokens, k, e, BLOCK[1]))
    ref = fm.fused_moe_fp8_ref(x, ex.q13, ex.s13, ex.q2, ex.s2, *routes[0], BLOCK)
    row.rel_err = checked_error(ex, x, routes[0], ref, None)
    row.ok = row.rel_err < TOLERANCE
    row.vs_bf16 = relative_error(fp8_moe(ex, x, routes[0]), bf16_moe(ex, x, routes[0]))
    row.fp8_us = timed_us(lambda r: fp8_moe(ex, x, r), routes, tokens, device)
    row.bf16_us = timed_us(lambda r: bf16_moe(ex, x, r), routes, tokens, device)
    flops = 2 * tokens * k * 3 * h * i
    row.fp8_gbs, row.bf16_gbs = (weight_bytes(model, row.hit, fp8) / us / 1e3
                                 for fp8, us in ((True, row.fp8_us), (False, row.bf16_us)))
    row.fp8_tflops, row.bf16_tflops = flops / row.fp8_us / 1e6, flops / row.bf16_us / 1e6
    return row, (x, routes, ref)


def run_variants(row: Row, ex: Experts, inputs: tuple, device: torch.device) -> None:
    x, routes, ref = inputs
    e, _, _, k = (MODELS | SMOKE_MODELS)[row.model]
    default = fm.default_fp8_config(row.tokens, k, e, BLOCK[1])
    for name, cfg in VARIANTS[default.block_m].items():
        if cfg == default or time.perf_counter() - START > VARIANTS_UNTIL_S:
            continue
        try:
            err = checked_error(ex, x, routes[0], ref, cfg)
            row.variants[name] = (timed_us(lambda r, cfg=cfg: fp8_moe(ex, x, r, cfg), routes, row.tokens, device)
                                  if err < TOLERANCE else f"WRONG err={err:.1e}")
        except Exception as exc:  # a config the compiler rejects (shared memory, registers) is not fatal
            row.variants[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:120]


def warm_jobs(models: dict) -> list[tuple]:
    """(model, kind, config, tokens) for every GEMM launch config the run will use ("fp8", "bf16"), and
    (model, "align", block_m, tokens) for the alignment kernel at each decode size."""
    jobs = set()
    for model, (e, _, _, k) in models.items():
        for tokens in TOKENS:
            fp8_cfg, bf16_cfg = fm.default_fp8_config(tokens, k, e, BLOCK[1]), fm.default_config(tokens, k, e,
                                                                                                     torch.bfloat16)
            configs = [fp8_cfg, *VARIANTS[fp8_cfg.block_m].values()]
            jobs |= {(model, "fp8", cfg, 0) for cfg in configs} | {(model, "bf16", bf16_cfg, 0)}
            if tokens * k <= fm.ALIGN_KERNEL_MAX:  # larger sizes align with torch ops
                jobs |= {(model, "align", cfg.block_m, tokens) for cfg in [*configs, bf16_cfg]}
    return sorted(jobs, key=lambda job: (job[1] == "align", job[0], str(job[2]), job[3]))


def warm_one(job: tuple, device: str = "cuda") -> str:
    """In a pool process: launch job's kernels once on one expert (same constexprs and specializations as
    the real shapes, so the real run finds them in Triton's cache). -> '' or the error."""
    model, kind, cfg, tokens = job
    e, h, i, k = (MODELS | SMOKE_MODELS)[model]
    dev = torch.device(device)
    try:
        if kind == "align":
            fm.moe_align(torch.zeros(tokens, k, dtype=torch.int64, device=dev), e, cfg)
        else:
            x = torch.zeros(1, h, dtype=torch.bfloat16, device=dev)
            route = (torch.ones(1, k, device=dev), torch.zeros(1, k, dtype=torch.int64, device=dev))
            if kind == "fp8":
                w13 = torch.zeros(1, 2 * i, h, dtype=torch.uint8, device=dev).view(fp8_ref.FP8)
                w2 = torch.zeros(1, h, i, dtype=torch.uint8, device=dev).view(fp8_ref.FP8)
                s13 = torch.ones(1, 2 * triton.cdiv(i, BLOCK[0]), triton.cdiv(h, BLOCK[1]), device=dev)
                s2 = torch.ones(1, triton.cdiv(h, BLOCK[0]), triton.cdiv(i, BLOCK[1]), device=dev)
                fm.fused_moe(x, w13, w2, *route, config=cfg, w13_scale=s13, w2_scale=s2, block=BLOCK)
            else:
                fm.fused_moe(x, torch.zeros(1, 2 * i, h, dtype=torch.bfloat16, device=dev),
                             torch.zeros(1, h, i, dtype=torch.bfloat16, device=dev), *route, config=cfg)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return ""
    except Exception as exc:
        return f"{job[:2]} {job[2]}: {type(exc).__name__}: {exc}".splitlines()[0][:200]


def start_warming(models: dict) -> tuple[ProcessPoolExecutor, list]:
    workers = max(1, min(12, (os.cpu_count() or 2) - 2))
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    jobs = warm_jobs(models)
    print(f"compiling {len(jobs)} launch kinds in {workers} processes", flush=True)
    return pool, [pool.submit(warm_one, job) for job in jobs]


def finish_warming(pool: ProcessPoolExecutor, futures: list) -> None:
    done, pending = wait(futures, timeout=WARM_TIMEOUT_S)
    # A failed warm-up only costs time: the run compiles what is missing itself.
    errors = [repr(f.exception()) if f.exception() else f.result() for f in done]
    errors = [message for message in errors if message]
    for message in errors:
        print("  warm:", message)
    print(f"warm-up: {len(done)} done, {len(pending)} still compiling (left to the run), "
          f"{len(errors)} failed, {time.perf_counter() - START:.0f} s", flush=True)
    pool.shutdown(wait=False, cancel_futures=True)


def fmt(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def summary(rows: list[Row]) -> str:
    lines = [f"{'model':8s} {'T':>5s} {'hit':>5s} {'fp8 us':>8s} {'bf16 us':>8s} {'x bf16':>6s} {'fp8 GB/s':>8s} "
             f"{'bf16 GB/s':>9s} {'fp8 TF/s':>8s} {'bf16 TF/s':>9s} {'err':>7s} {'vs bf16':>7s}  best variant",
             "-" * 118]
    for r in rows:
        timed = {n: v for n, v in r.variants.items() if isinstance(v, float)}
        best = min(timed, key=timed.get, default=None)
        best_text = f"{best} {timed[best]:.1f} us" if best and r.fp8_us and timed[best] < r.fp8_us else ""
        status = f"{r.rel_err:7.1e}" if r.ok else ("ERROR  " if r.rel_err is None else "WRONG  ")
        speedup = r.bf16_us / r.fp8_us if r.bf16_us and r.fp8_us else None
        lines.append(f"{r.model:8s} {r.tokens:5d} {r.hit:5.1f} {fmt(r.fp8_us, '8.1f')} {fmt(r.bf16_us, '8.1f')} "
                     f"{fmt(speedup, '6.2f')} {fmt(r.fp8_gbs, '8.0f')} {fmt(r.bf16_gbs, '9.0f')} "
                     f"{fmt(r.fp8_tflops, '8.1f')} {fmt(r.bf16_tflops, '9.1f')} {status} {fmt(r.vs_bf16, '7.1e')}  "
                     f"{best_text}")
    lines.append(f"{len(rows)} cases, {sum(not r.ok for r in rows)} failed. GB/s: bytes of the experts touched "
                 f"(fp8 + scales, or bf16) / time. T <= {GRAPH_MAX_TOKENS}: per call in a CUDA graph over "
                 f"{ROUTINGS} routings;\nlarger T: do_bench medians. err: vs fused_moe_fp8_ref; vs bf16: FP8 "
                 "vs the bf16 kernel on the unquantized weights (the quantization error).")
    return "\n".join(lines)


def print_row(r: Row) -> None:
    variants = " ".join(f"{n}={v:.1f}" if isinstance(v, float) else f"{n}:{v}" for n, v in r.variants.items())
    print(f"  {r.model:8s} T={r.tokens:<5d} {'ok ' if r.ok else 'BAD'} err={fmt(r.rel_err, '.1e')} "
          f"vs_bf16={fmt(r.vs_bf16, '.1e')} fp8={fmt(r.fp8_us, '.1f')}us bf16={fmt(r.bf16_us, '.1f')}us "
          f"{variants} {r.error}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to test the script itself")
    parser.add_argument("--no-variants", action="store_true", help="time the default configs only")
    parser.add_argument("--no-warm", action="store_true", help="compile in this process only")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        parser.error("no CUDA device: only --smoke runs on CPU")
    models, tokens_list = (SMOKE_MODELS, SMOKE_TOKENS) if args.smoke else (MODELS, TOKENS)
    warming = start_warming(models) if device.type == "cuda" and not args.no_warm and not args.smoke else None
    torch.manual_seed(0)
    experts = {model: make_experts(model, device) for model in models}  # all resident: ~40 GB
    if warming:
        finish_warming(*warming)
    rows, inputs = [], {}
    for model in models:
        for tokens in tokens_list:
            try:
                row, inputs[model, tokens] = run_case(model, tokens, experts[model], device)
            except Exception as exc:
                traceback.print_exc(limit=3)
                row = Row(model, tokens, error=f"{type(exc).__name__}: {exc}".splitlines()[0][:200])
            rows.append(row)
            print_row(row)
    if not args.no_variants:
        order = [t for t in VARIANT_TOKEN_ORDER if t in tokens_list] + [t for t in tokens_list
                                                                          if t not in VARIANT_TOKEN_ORDER]
        for tokens in order:
            for row in [r for r in rows if r.tokens == tokens and (r.model, tokens) in inputs]:
                run_variants(row, experts[row.model], inputs[row.model, tokens], device)
    if args.json:
        env = bench_env.environment(device, elapsed_s=round(time.perf_counter() - START, 1))
        Path(args.json).write_text(json.dumps(dict(env=env, rows=[asdict(r) for r in rows]), indent=1))
        print(f"wrote {args.json}")
    print(f"\nFused MoE, FP8 (W8A8, 128 x 128 blocks) vs bf16, {time.perf_counter() - START:.0f} s\n" + summary(rows))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
