"""The FP8 decode GEMVs, kernel by kernel, as the engine's graph runs them: the tensor-core GEMV
(kernels/fp8_mma_gemv.py) in several launch shapes against the CUDA-core GEMV (kernels/fp8_gemv.py) and,
above one token, the W8A8 path the linears take without it. Weights from HBM (each call's weight copy cycles
out of L2, as in gemv_probe.py), timed by CUDA-graph replay.

  1. checks: the mma GEMV against x times the dequantized weight, 1-8 tokens, bf16 / fp16, per-channel and
     128 x 128 block scales, bias, N not a multiple of 16, each launch shape, and the same result twice;
  2. DeepSeek-LLM-7B's four shapes with per-channel scales (what `-q fp8` makes), one token: µs a call,
     a step's sum (30 layers) and its GB/s;
  3. DeepSeek-V3's dense shapes with 128 x 128 block scales (MLA projections, a dense MLP, a shared expert);
  4. --sweep: 1, 2, 4, 8 tokens on the 7B shapes, the linears' choice without the mma GEMV against it.

    python bench/fp8_gemv_probe.py [--sweep] [--json OUT.json]
    python bench/fp8_gemv_probe.py --checks      # 1. only (bench/gate.sh fp8 runs it)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import bench_env
import torch
from gemv_probe import L2_DEFEAT_BYTES, LAYERS, SHAPES, rel_err

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from deepserve.kernels import fp8, fp8_gemv  # noqa: E402
from deepserve.kernels import fp8_ref as ref  # noqa: E402
from deepserve.kernels.fp8_mma_gemv import Fp8MmaGemvConfig, fp8_mma_gemv, mma_gemv_supported  # noqa: E402

V3_SHAPES = {"q_a": (1536, 7168), "q_b": (24576, 1536), "kv_a": (576, 7168), "kv_b": (32768, 512),
             "o": (7168, 16384), "mlp_gate_up": (36864, 7168), "mlp_down": (7168, 18432),
             "shared_gate_up": (4096, 7168), "shared_down": (7168, 2048)}
BLOCK = (128, 128)


def mma_variants() -> dict[str, Fp8MmaGemvConfig]:
    """label -> config: the default and its runners-up on one H200 (2026-12-03f: call 2 timed 13 launch shapes,
    calls 6 and 7 programmatic dependent launch; 32 warps an SM, 256-input rounds, L2 prefetch ahead and
    PDL were slower overall and are gone)."""
    c = Fp8MmaGemvConfig
    return {"mma (default)": c(),
            "mma no evict-first": c(evict_first=False),
            "mma nw1 pps16": c(num_warps=1, programs_per_sm=16, one_split=False),
            "mma nw4 pps4": c(num_warps=4, programs_per_sm=4, one_split=False),
            "mma words 4": c(words=4),
            "mma no prefetch": c(prefetch=False)}


def weights(n: int, k: int, copies: int, seed: int, block: tuple[int, int] | None) -> list[tuple]:
    torch.manual_seed(seed)
    out = []
    for _ in range(copies):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        out.append(ref.quantize_weight_block(w, block) if block else ref.quantize_weight_per_channel(w))
    return out


def dequantized(w_q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    return ref.dequantize_weight_block(w_q, scale, block).float() if block else w_q.float() * scale.float()[:, None]


def checks() -> list[dict]:
    rows = []
    for m, n, k, block, dtype, bias in ((1, 4096, 4096, None, torch.bfloat16, False),
                                        (2, 4104, 11008, None, torch.bfloat16, True),
                                        (3, 1000, 1024, BLOCK, torch.float16, True),
                                        (8, 22016, 4096, None, torch.bfloat16, False),
                                        (5, 576, 7168, BLOCK, torch.bfloat16, False),
                                        (1, 12288, 4096, None, torch.float16, True),
                                        (4, 32768, 512, BLOCK, torch.bfloat16, True),
                                        (7, 7168, 18432, BLOCK, torch.bfloat16, False),
                                        (5, 512, 384, (128, 256), torch.bfloat16, True)):  # a partial K block
        (w_q, scale), = weights(n, k, 1, m + n, block)
        if m == 7:
            scale = scale.t().contiguous().t()  # column-major block scales: the kernel honours their strides
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
        want = x.float() @ dequantized(w_q, scale, block).T + (b.float() if bias else 0)
        assert mma_gemv_supported(x, w_q, block)
        for label, cfg in mma_variants().items():
            got, again = (fp8_mma_gemv(x, w_q, scale, block, b, cfg) for _ in range(2))
            row = dict(check="fp8 mma", variant=label, m=m, n=n, k=k, block=block, dtype=str(dtype), bias=bias,
                       rel_err=rel_err(got, want), same_twice=bool(torch.equal(got, again)))
            row["ok"] = row["rel_err"] < 4e-3 and row["same_twice"]  # bf16 output rounding ~2e-3
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def timed_rows(shapes: dict, block: tuple[int, int] | None, m: int = 1, with_mma_variants: bool = True) -> list[dict]:
    rows = []
    for name, (n, k) in shapes.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ws = weights(n, k, max(2, -(-L2_DEFEAT_BYTES // (n * k))), 1, block)
        want = x.float() @ dequantized(*ws[0], block).T
        variants = {"fma (fp8_gemv default)" if m == 1 else "without mma (W8A8)": _without_mma(x, ws, block)}
        cfgs = mma_variants() if with_mma_variants else {"mma (default)": Fp8MmaGemvConfig()}
        for label, cfg in cfgs.items():
            variants[label] = [lambda w=w, c=cfg, x=x: fp8_mma_gemv(x, w[0], w[1], block, None, c) for w in ws]
        for label, fns in variants.items():
            err = rel_err(fns[0](), want)
            try:
                us = bench_env.graph_per_call_us(fns, min_calls=2 * len(fns), repeats=20)
            except Exception as exc:  # e.g. a launch the graph capture refuses: reported, not fatal
                print(json.dumps(dict(shape=name, variant=label, error=f"{type(exc).__name__}: {str(exc)[:200]}")))
                us = float("nan")
            w8a8 = label.startswith("without")  # rounds the activations to e4m3: one scale a token per channel
            rows.append(dict(shape=name, n=n, k=k, m=m, block=block, variant=label, us=us, gbs=n * k / us / 1e3,
                             rel_err=err, ok=err < (5e-2 if w8a8 else 4e-3)))
            print(json.dumps(rows[-1]), flush=True)
        del ws, variants
        torch.cuda.empty_cache()
    return rows


def _without_mma(x: torch.Tensor, ws: list[tuple], block: tuple[int, int] | None) -> list:
    """What the linears take with DEEPSERVE_FP8_MMA_GEMV_MAX_M 0: fp8_gemv at one token, W8A8 above."""
    if x.shape[0] == 1:
        return [lambda w=w: fp8_gemv.fp8_gemv(x, w[0], w[1], block) for w in ws]
    if block:
        return [_mma_off(lambda w=w: fp8.block_fp8_linear(x, w[0], w[1], block)) for w in ws]
    return [_mma_off(lambda w=w: fp8.channel_fp8_cuda(x, w[0], w[1])) for w in ws]


def _mma_off(fn):
    """fn run as the linears choose with the tensor-core GEMV switched off (fp8.MMA_GEMV_MAX_M 0)."""
    def call():
        saved, fp8.MMA_GEMV_MAX_M = fp8.MMA_GEMV_MAX_M, 0
        try:
            return fn()
        finally:
            fp8.MMA_GEMV_MAX_M = saved
    return call


def print_table(rows: list[dict], shapes: dict, title: str, layers: int | None) -> None:
    labels = list(dict.fromkeys(r["variant"] for r in rows))
    print(f"\n==== {title} ====")
    print(f"{'variant':>30} " + " ".join(f"{s[:9]:>9}" for s in shapes) + (f" {'step us':>9}" if layers else "")
          + f" {'GB/s':>6} {'max err':>8}")
    for label in labels:
        mine = {r["shape"]: r for r in rows if r["variant"] == label}
        us = [mine[s]["us"] for s in shapes]
        nbytes = sum(n * k for n, k in shapes.values())
        step = f" {layers * sum(us):9.0f}" if layers else ""
        err = max(r["rel_err"] for r in mine.values())
        print(f"{label:>30} " + " ".join(f"{u:9.2f}" for u in us) + step
              + f" {nbytes / sum(us) / 1e3:6.0f} {err:8.1e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--sweep", action="store_true", help="also 1-8 tokens on the 7B shapes")
    ap.add_argument("--checks", action="store_true", help="only the checks (bench/gate.py's FP8 suite)")
    ns = ap.parse_args()
    env = bench_env.environment(torch.device("cuda"))
    print(json.dumps(env), flush=True)
    rows = checks()
    if ns.checks:
        bad = [r for r in rows if not r["ok"]]
        print(f"fp8 mma GEMV checks: {len(rows) - len(bad)} ok, {len(bad)} wrong")
        return 1 if bad else 0
    seven_b = timed_rows(SHAPES, None)
    v3 = timed_rows(V3_SHAPES, BLOCK)
    sweep = []
    if ns.sweep:
        for m in (1, 2, 4, 8):
            sweep += timed_rows(SHAPES, None, m, with_mma_variants=False)
    print_table(seven_b, SHAPES, "DeepSeek-LLM-7B shapes, per-channel FP8, one token, µs a call", LAYERS)
    print_table(v3, V3_SHAPES, "DeepSeek-V3 dense shapes, 128 x 128 blocks, one token, µs a call", None)
    for m in (1, 2, 4, 8) if sweep else ():
        print_table([r for r in sweep if r["m"] == m], SHAPES, f"7B shapes, {m} tokens", LAYERS)
    rows += seven_b + v3 + sweep
    if ns.json:
        ns.json.write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    bad = [r for r in rows if not r["ok"]]
    print(f"checks: {len(rows) - len(bad)} ok, {len(bad)} wrong" +
          "".join(f"\n  {r.get('shape') or r.get('n')}: {r['variant']}: {r['rel_err']}" for r in bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
