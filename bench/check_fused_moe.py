"""Correctness and speed of the fused MoE kernel (deepserve/kernels/fused_moe.py), in one run on one H200.

For every shape (DeepSeek-V2-Lite: E 64, H 2048, I 1408, K 6 at T = 1 .. 8192; V3: E 256, H 7168, I 2048,
K 8 at T = 64, 256) with fresh random bf16 inputs and softmax top-K routing: the kernel's workspaces are
poisoned with NaN first (an unwritten row or a NaN fails), the output is compared with the fp32 torch
reference, then timed with triton.testing.do_bench (median, L2 flushed between runs) next to
  - the batched torch path the model runs without the kernel (RoutedExperts.forward_batched),
  - the same call replayed from a CUDA graph, at decode sizes (T <= 256; capture also proves no host sync),
  - a few alternative launch configs (while the run is young), to tune default_config,
  - the roofline: the weights of the experts actually hit, read once, at 4.2 TB/s, or the FLOPs at
    760 TFLOP/s, whichever takes longer.
Then the router (deepserve/kernels/moe_routing.py): for V2-Lite (64 experts, top-6, greedy softmax) and
V3 (256 experts, 8 groups, top-4 groups, top-8, sigmoid + bias, renormalized, x2.5) at T = 1, 64, 256,
the fused kernel's routing is first checked against the torch `route` on fp32 logits (same experts as
sets per token, weights to 1e-5), then both are timed as the decode step runs them: CALLS calls
captured in one CUDA graph, the replays timed with CUDA events, per call (an eager call at T = 1 would
time Python and the launch, not the kernels). Tokens per program (block_t) other than the default are
timed next to it.

A failing case prints its error and the run goes on. The tables come last (routing last); JSON goes to
$OUT/fused_moe.json when OUT is set.

    python bench/check_fused_moe.py                  # the H200 run, < 3 minutes
    python bench/check_fused_moe.py --routing-only   # the router only, seconds
    python bench/check_fused_moe.py --smoke          # tiny shapes; on a CPU-only machine under TRITON_INTERPRET
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import bench_env
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # --smoke on CPU; must precede the first `import triton`
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import triton  # noqa: E402
import triton.testing  # noqa: E402

from deepserve.kernels import fused_moe as fm  # noqa: E402
from deepserve.kernels import moe_routing as mr  # noqa: E402
from deepserve.layers.moe import RoutedExperts, RoutingConfig, route  # noqa: E402

PEAK_GBS = 4200.0  # copy bandwidth measured on this H200 (BENCHMARKS.md)
PEAK_TFLOPS = 760.0  # bf16 dense matmul measured there
TOLERANCE = 2e-2  # bf16 relative error against the fp32 reference
VARIANTS_UNTIL_S = 110.0  # past this many seconds only the defaults are timed, to stay under 3 minutes
START = time.perf_counter()
MODELS = {"V2-Lite": (64, 2048, 1408, 6), "V3": (256, 7168, 2048, 8)}  # E, H, I, K
CASES = [("V2-Lite", t) for t in (1, 64, 256, 2048, 8192)] + [("V3", t) for t in (64, 256)]
SMOKE_MODELS = {"tiny": (8, 64, 48, 2)}
SMOKE_CASES = [("tiny", 1), ("tiny", 40)]
ROUTERS = {"V2-Lite": RoutingConfig(64, 6),
           "V3": RoutingConfig(256, 8, "noaux_tc", "sigmoid", n_group=8, topk_group=4, norm_topk_prob=True,
                               routed_scaling_factor=2.5)}
ROUTING_CASES = [(model, t) for model in ROUTERS for t in (1, 64, 256)]
SMOKE_ROUTERS = {"tiny": RoutingConfig(16, 4, "noaux_tc", "sigmoid", n_group=4, topk_group=2, norm_topk_prob=True)}
SMOKE_ROUTING_CASES = [("tiny", 1), ("tiny", 5)]
ROUTING_TOLERANCE = 1e-5  # fp32 weights, absolute (they are at most routed_scaling_factor)
BLOCK_T_VARIANTS = (2, 4, 8)  # tokens per program, timed next to the default at T >= 64
CALLS = 50  # calls per captured graph: one replay's launch cost spreads over them
MC = fm.MoEConfig
# Alternatives timed next to the default, by the default's row tile (the regime).
VARIANTS = {
    16: {"m16-n32-k128": MC(16, 32, 128, 1, 4, 3), "m16-n128-k64": MC(16, 128, 64, 1, 4, 4),
         "m16-n64-k64-s6": MC(16, 64, 64, 1, 4, 6), "m16-n64-k256-w8": MC(16, 64, 256, 1, 8, 3)},
    32: {"m16-n64-k128": MC(16, 64, 128, 1, 4, 3), "m32-n64-k128": MC(32, 64, 128, 4, 4, 3),
         "m64-n64-k64": MC(64, 64, 64, 8, 4, 4)},
    64: {"m64-n128-k64-w8": MC(64, 128, 64, 8, 8, 3), "m128-n64-k64-w8": MC(128, 64, 64, 8, 8, 4),
         "m64-n64-k128": MC(64, 64, 128, 8, 4, 3)},
    128: {"m64-n64-k64": MC(64, 64, 64, 8, 4, 4), "m64-n128-k64-w8": MC(64, 128, 64, 8, 8, 3),
          "m128-n128-k32-w8": MC(128, 128, 32, 8, 8, 4)},
}


@dataclass
class Row:
    model: str
    tokens: int
    experts_hit: int = 0
    ok: bool = False
    rel_err: float | None = None
    fused_us: float | None = None
    graph_us: float | None = None
    batched_us: float | None = None
    roofline_us: float | None = None
    config: str = ""
    variants: dict[str, float | str] = field(default_factory=dict)  # name -> us, or the error
    error: str = ""


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Median microseconds."""
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
    start = time.perf_counter()  # --smoke on CPU: one interpreted call, only to exercise the script
    fn()
    return (time.perf_counter() - start) * 1e6


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("nan")  # fails every comparison below
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def poisoned(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    return torch.full((rows, cols), float("nan"), dtype=like.dtype, device=like.device)


def checked_run(args: tuple, ref: torch.Tensor, config: fm.MoEConfig | None) -> float:
    # One call with NaN workspaces -> relative error (NaN when anything is not finite).
    plain, fm._workspace = fm._workspace, poisoned
    try:
        return relative_error(fm.fused_moe(*args, config=config), ref)
    finally:
        fm._workspace = plain


def experts_module(model: str, device: torch.device) -> RoutedExperts:
    e, h, i, _ = (MODELS | SMOKE_MODELS)[model]
    # Allocated straight on the GPU in bf16: V3's experts are 22.5 GB (45 GB more as an fp32 detour).
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            module = RoutedExperts(e, h, i)
    finally:
        torch.set_default_dtype(default_dtype)
    module.w13.data.normal_(0, h**-0.5)  # O(1) activations, like trained weights
    module.w2.data.normal_(0, i**-0.5)
    return module


def routed_inputs(tokens: int, experts: int, k: int, hidden: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    top = torch.randn(tokens, experts, device=device).softmax(-1).topk(k, dim=-1)
    weights = top.values / top.values.sum(-1, keepdim=True)  # [T, K] float32
    return x, weights.contiguous(), top.indices


def roofline_us(row: Row, tokens: int, model: str) -> float:
    _, h, i, k = (MODELS | SMOKE_MODELS)[model]
    weight_bytes = row.experts_hit * 3 * h * i * 2  # w1, w3, w2 of each hit expert, bf16, read once
    flops = 2 * tokens * k * 3 * h * i
    return max(weight_bytes / PEAK_GBS / 1e3, flops / PEAK_TFLOPS / 1e6)


def graph_time(args: tuple, eager: torch.Tensor, device: torch.device) -> float:
    # Capture (fails on a host sync), replay, compare with eager, time the replay.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(*args)
    graph.replay()
    torch.cuda.synchronize()
    if not torch.equal(out, eager):
        raise RuntimeError("CUDA graph replay differs from the eager call")
    return timed(graph.replay, device)


def run_case(model: str, tokens: int, module: RoutedExperts, device: torch.device, variants: bool) -> Row:
    e, h, _, k = (MODELS | SMOKE_MODELS)[model]
    row = Row(model, tokens)
    x, weights, ids = routed_inputs(tokens, e, k, h, device)
    args = (x, module.w13, module.w2, weights, ids)
    row.experts_hit = int(ids.unique().numel())
    row.roofline_us = roofline_us(row, tokens, model)
    ref = fm.fused_moe_ref(*args)
    default = fm.default_config(tokens, k, e, x.dtype)
    row.config = str(default)
    row.rel_err = checked_run(args, ref, None)
    row.ok = row.rel_err < TOLERANCE
    row.fused_us = timed(lambda: fm.fused_moe(*args), device)
    row.batched_us = timed(lambda: module.forward_batched(x, weights, ids), device)
    if device.type == "cuda" and tokens <= 256:
        row.graph_us = guarded(row, "graph", lambda: graph_time(args, fm.fused_moe(*args), device))
    if variants and time.perf_counter() - START < VARIANTS_UNTIL_S:
        for name, cfg in VARIANTS.get(default.block_m, {}).items():
            row.variants[name] = guarded(row, name, lambda cfg=cfg: variant_time(args, ref, cfg, device))
    return row


def variant_time(args: tuple, ref: torch.Tensor, cfg: fm.MoEConfig, device: torch.device) -> float | str:
    err = checked_run(args, ref, cfg)
    if not err < TOLERANCE:
        return f"WRONG err={err:.1e}"
    return timed(lambda: fm.fused_moe(*args, config=cfg), device)


def guarded(row: Row, what: str, fn: Callable[[], float | str]) -> float | str | None:
    # One broken variant or capture must not hide the rest of the case.
    try:
        return fn()
    except Exception as exc:
        traceback.print_exc(limit=2)
        message = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
        row.error += f"[{what}] {message} "
        return message if what != "graph" else None


def run_all(cases: list[tuple[str, int]], device: torch.device, variants: bool) -> list[Row]:
    rows: list[Row] = []
    module, loaded = None, ""
    for model, tokens in cases:
        try:
            if loaded != model:  # one model's experts at a time: V3's alone are 22.5 GB
                module = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                module, loaded = experts_module(model, device), model
            rows.append(run_case(model, tokens, module, device, variants))
        except Exception as exc:  # inputs, the reference or the default launch failed
            traceback.print_exc(limit=3)
            rows.append(Row(model, tokens, error=f"{type(exc).__name__}: {exc}".splitlines()[0][:200]))
        print_row(rows[-1])
    return rows


def print_row(r: Row) -> None:
    variants = " ".join(f"{n}={v:.0f}" if isinstance(v, float) else f"{n}:{v}" for n, v in r.variants.items())
    print(f"  {r.model:8s} T={r.tokens:<5d} {'ok ' if r.ok else 'BAD'} err={r.rel_err or 0:.1e} "
          f"fused={r.fused_us or 0:.1f}us graph={r.graph_us or 0:.1f}us batched={r.batched_us or 0:.1f}us "
          f"{variants} {r.error}", flush=True)


def summary(rows: list[Row]) -> str:
    lines = [f"{'model':8s} {'T':>5s} {'hit':>4s} {'fused us':>9s} {'graph us':>9s} {'torch us':>9s} {'x torch':>7s} "
             f"{'roof us':>8s} {'%roof':>5s} {'err':>7s}  best variant", "-" * 104]
    for r in rows:
        best_us = min([v for v in r.variants.values() if isinstance(v, float)], default=None)
        fastest = min((v for v in (r.fused_us, r.graph_us) if v), default=None)
        best = ""
        if best_us and r.fused_us and best_us < r.fused_us:
            name = next(n for n, v in r.variants.items() if v == best_us)
            best = f"{name} {best_us:.1f} us"
        status = f"{r.rel_err:7.1e}" if r.ok else ("ERROR  " if r.rel_err is None else "WRONG  ")
        speedup = r.batched_us / r.fused_us if r.batched_us and r.fused_us else 0.0
        pct = 100 * r.roofline_us / fastest if r.roofline_us and fastest else 0.0
        lines.append(f"{r.model:8s} {r.tokens:5d} {r.experts_hit:4d} {r.fused_us or 0:9.1f} {r.graph_us or 0:9.1f} "
                     f"{r.batched_us or 0:9.1f} {speedup:7.2f} {r.roofline_us or 0:8.1f} {pct:5.1f} {status}  {best}")
    bad = sum(not r.ok for r in rows)
    lines.append(f"{len(rows)} cases, {bad} failed. %roof = roofline / fastest of fused and graph; roofline = "
                 f"max(hit experts' bf16 weights / {PEAK_GBS:.0f} GB/s, FLOPs / {PEAK_TFLOPS:.0f} TFLOP/s)")
    return "\n".join(lines)


@dataclass
class RouteRow:
    model: str
    tokens: int
    ok: bool = False
    mismatched: int | None = None  # tokens whose expert sets differ
    max_err: float | None = None  # weights of the other tokens, sorted by expert id
    fused_us: float | None = None  # per call, replayed from a CUDA graph (eager on CPU)
    torch_us: float | None = None
    variants: dict[str, float | str] = field(default_factory=dict)  # "bt<block_t>" -> us, or the error
    error: str = ""


def per_call_us(fn: Callable[[], object], device: torch.device, replays: int = 20) -> float:
    """Median microseconds per call of `fn` inside a CUDA graph of CALLS calls (eager time on CPU)."""
    if device.type != "cuda":
        return timed(fn, device)
    return bench_env.graph_per_call_us([fn], CALLS, repeats=replays)


def route_errors(logits: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor, block_t: int | None = None
                 ) -> tuple[int, float]:
    # -> (tokens whose expert sets differ, max weight error over the others).
    got_w, got_ids = mr.fused_route(logits, cfg, bias, block_t=block_t)
    want_w, want_ids = route(logits, cfg, bias)
    got_ids, got_order = got_ids.sort(-1)
    want_ids, want_order = want_ids.sort(-1)
    same = (got_ids == want_ids).all(-1)  # [T]
    diff = (got_w.gather(1, got_order) - want_w.gather(1, want_order)).abs()[same]
    return int((~same).sum()), float(diff.max()) if diff.numel() else 0.0


def run_route_case(model: str, tokens: int, device: torch.device) -> RouteRow:
    cfg = (ROUTERS | SMOKE_ROUTERS)[model]
    row = RouteRow(model, tokens)
    logits = torch.randn(tokens, cfg.num_experts, device=device) * 2.0  # fp32, as MoEGate computes them
    bias = torch.randn(cfg.num_experts, device=device) * 0.3  # read under noaux_tc only
    row.mismatched, row.max_err = route_errors(logits, cfg, bias)
    row.ok = row.mismatched == 0 and row.max_err <= ROUTING_TOLERANCE
    row.fused_us = per_call_us(lambda: mr.fused_route(logits, cfg, bias), device)
    row.torch_us = per_call_us(lambda: route(logits, cfg, bias), device)
    if tokens >= 64 and device.type == "cuda":
        for block_t in BLOCK_T_VARIANTS:
            row.variants[f"bt{block_t}"] = guarded(row, f"bt{block_t}", lambda bt=block_t: block_t_time(
                logits, cfg, bias, bt, device))
    return row


def block_t_time(logits: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor, block_t: int,
                 device: torch.device) -> float | str:
    mismatched, err = route_errors(logits, cfg, bias, block_t)
    if mismatched or err > ROUTING_TOLERANCE:
        return f"WRONG mismatched={mismatched} err={err:.1e}"
    return per_call_us(lambda: mr.fused_route(logits, cfg, bias, block_t=block_t), device)


def run_routing(cases: list[tuple[str, int]], device: torch.device) -> list[RouteRow]:
    rows: list[RouteRow] = []
    for model, tokens in cases:
        try:
            rows.append(run_route_case(model, tokens, device))
        except Exception as exc:
            traceback.print_exc(limit=3)
            rows.append(RouteRow(model, tokens, error=f"{type(exc).__name__}: {exc}".splitlines()[0][:200]))
        r = rows[-1]
        print(f"  route {r.model:8s} T={r.tokens:<4d} {'ok ' if r.ok else 'BAD'} mismatched={r.mismatched} "
              f"err={r.max_err or 0:.1e} fused={r.fused_us or 0:.2f}us torch={r.torch_us or 0:.2f}us "
              f"{' '.join(f'{n}={v:.2f}' if isinstance(v, float) else f'{n}:{v}' for n, v in r.variants.items())} "
              f"{r.error}", flush=True)
    return rows


def routing_summary(rows: list[RouteRow]) -> str:
    lines = [f"{'router':8s} {'T':>5s} {'fused us':>9s} {'torch us':>9s} {'x torch':>7s} {'err':>7s}  "
             "block_t variants (us)", "-" * 80]
    for r in rows:
        status = f"{r.max_err:7.1e}" if r.ok else ("ERROR  " if r.max_err is None else "WRONG  ")
        speedup = r.torch_us / r.fused_us if r.torch_us and r.fused_us else 0.0
        variants = " ".join(f"{n}={v:.2f}" if isinstance(v, float) else f"{n}:{str(v).split()[0]}"
                            for n, v in r.variants.items())
        lines.append(f"{r.model:8s} {r.tokens:5d} {r.fused_us or 0:9.2f} {r.torch_us or 0:9.2f} {speedup:7.2f} "
                     f"{status}  {variants}")
    lines.append(f"{len(rows)} cases, {sum(not r.ok for r in rows)} failed. Per call, in a CUDA graph of {CALLS} "
                 f"calls; err = max weight error (fp32), ok when every token has the same experts")
    return "\n".join(lines)


def environment(device: torch.device) -> dict:
    return bench_env.environment(device, peak_gbs=PEAK_GBS, peak_tflops=PEAK_TFLOPS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to test the script itself")
    parser.add_argument("--no-variants", action="store_true", help="time the default launch configs only")
    parser.add_argument("--routing-only", action="store_true", help="the router only, not the experts")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        parser.error("no CUDA device: only --smoke runs on CPU")
    torch.manual_seed(0)
    rows = [] if args.routing_only else run_all(SMOKE_CASES if args.smoke else CASES, device,
                                                 variants=not args.no_variants)
    route_rows = run_routing(SMOKE_ROUTING_CASES if args.smoke else ROUTING_CASES, device)
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "fused_moe.json"
        path.write_text(json.dumps(dict(env=environment(device), rows=[asdict(r) for r in rows],
                                        routing=[asdict(r) for r in route_rows]), indent=1))
        print(f"wrote {path}")
    if rows:
        print(f"\nFused MoE, bf16, {time.perf_counter() - START:.0f} s\n" + summary(rows))
    print(f"\nMoE routing, fp32 logits, {time.perf_counter() - START:.0f} s\n" + routing_summary(route_rows))
    return 0 if all(r.ok for r in rows + route_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
