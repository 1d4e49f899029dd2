"""The tensor-core decode GEMVs (int4 tiled, FP8) with one K split a tile, its warps splitting K inside the
program, against the default split-K launch (programs summed through a workspace, a fence and a counter).
Why: a line through the GEMVs' times reads ~6 µs a call on top of the streaming (kernels/fp8_mma_gemv.py),
and V2-Lite's and 7B's small projections are mostly that fixed cost; a launch of one split stores its tile
itself (mma_gemv_common.store_tile_split's DIRECT), so the partials' round trip through L2 goes.

Every variant is first checked against x @ the dequantized weight (1 and 4 tokens, bias, fp16; exit 1 if one
is wrong); then µs a call inside a CUDA graph, weights from HBM (gemv_probe.py's method), for DeepSeek-LLM-7B's
shapes (int4 AWQ-like and FP8 per channel), DeepSeek-V2-Lite's int4 shapes and V3's FP8 128 x 128 shapes, with
per-step sums (7B: 30 layers; V2-Lite: 26 MoE layers' MLA and shared-expert projections).

    python bench/gemv_split_probe.py [--json OUT.json] [--tokens 1,4]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import bench_env
import torch
from fp8_gemv_probe import BLOCK, V3_SHAPES, dequantized
from fp8_gemv_probe import weights as fp8_weights
from gemv_probe import GROUP, L2_DEFEAT_BYTES, LAYERS, SHAPES, int4_weights, rel_err

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from deepserve.kernels import int4_ref  # noqa: E402
from deepserve.kernels.fp8_mma_gemv import Fp8MmaGemvConfig, fp8_mma_gemv  # noqa: E402
from deepserve.kernels.int4_mma_gemv import (  # noqa: E402
    TILED_CONFIG,
    Int4MmaGemvConfig,
    tile_scales,
    tile_words,
    w4a16_mma_gemv,
)

# DeepSeek-V2-Lite's int4 decode GEMVs (MLA without q_lora, two shared experts of 1,408), a MoE layer's
V2_LITE_SHAPES = {"q": (3072, 2048), "kv_a": (576, 2048), "o": (2048, 2048), "sh_gate_up": (5632, 2048),
                  "sh_down": (2048, 2816)}
V2_LITE_LAYERS = 26
WARPS = (1, 2, 4, 8, 16, 32)


def int4_variants() -> dict[str, Int4MmaGemvConfig]:
    out = {"default": TILED_CONFIG, "split-K (before)": replace(TILED_CONFIG, one_split=False)}
    for w in WARPS:
        out[f"1 split w{w}"] = Int4MmaGemvConfig(num_warps=w, programs_per_sm=16, split_k=1)
    out["1 split w16 no prefetch"] = Int4MmaGemvConfig(num_warps=16, split_k=1, prefetch=False)
    out["2 splits w8"] = Int4MmaGemvConfig(num_warps=8, split_k=2)
    return out


def fp8_variants() -> dict[str, Fp8MmaGemvConfig]:
    out = {"default": Fp8MmaGemvConfig(), "split-K (before)": Fp8MmaGemvConfig(one_split=False)}
    for w in WARPS:
        out[f"1 split w{w}"] = Fp8MmaGemvConfig(num_warps=w, split_k=1)
    out["1 split w16 no prefetch"] = Fp8MmaGemvConfig(num_warps=16, split_k=1, prefetch=False)
    out["2 splits w8"] = Fp8MmaGemvConfig(num_warps=8, split_k=2)
    return out


def int4_calls(x: torch.Tensor, ws: list[tuple], cfg: Int4MmaGemvConfig, bias=None) -> list:
    return [lambda w=w: w4a16_mma_gemv(x, w[0], w[1], None, GROUP, bias, cfg, tiled=True) for w in ws]


def fp8_calls(x: torch.Tensor, ws: list[tuple], cfg: Fp8MmaGemvConfig, block, bias=None) -> list:
    return [lambda w=w: fp8_mma_gemv(x, w[0], w[1], block, bias, cfg) for w in ws]


def checks() -> list[dict]:
    """Each variant against the dequantized product: 1 / 4 / 8 tokens, bf16 / fp16, bias, K splits that are
    not a multiple of the warps, per-channel and block scales; and the same result twice."""
    rows = []
    for m, n, k, dtype, bias in ((1, 2048, 2816, torch.bfloat16, True), (4, 576, 2048, torch.float16, False),
                                 (8, 4096, 11008, torch.bfloat16, False), (3, 1536, 7168, torch.float16, True)):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
        (q, s, z), = int4_weights(n, k, 1, m + n)
        want4 = x.float() @ int4_ref.dequantize(q, s, z, 4, GROUP).float().T + (b.float() if bias else 0)
        tiled = [(tile_words(q), tile_scales(s, z))]
        for label, cfg in int4_variants().items():
            rows.append(_check("int4", label, int4_calls(x, tiled, cfg, b)[0], want4, m, n, k, dtype, bias))
        for block in (None, BLOCK):
            w8 = fp8_weights(n, k, 1, m + k, block)
            want8 = x.float() @ dequantized(*w8[0], block).T + (b.float() if bias else 0)
            for label, cfg in fp8_variants().items():
                rows.append(_check(f"fp8 {'block' if block else 'channel'}", label,
                                   fp8_calls(x, w8, cfg, block, b)[0], want8, m, n, k, dtype, bias))
    return rows


def _check(kind, label, call, want, m, n, k, dtype, bias) -> dict:
    got, again = call(), call()
    err = rel_err(got, want)
    row = dict(check=kind, variant=label, m=m, n=n, k=k, dtype=str(dtype), bias=bias, rel_err=err,
               same_twice=bool(torch.equal(got, again)), ok=err < 1e-2 and bool(torch.equal(got, again)))
    print(json.dumps(row), flush=True)
    return row


def timed(kind: str, shapes: dict, m: int) -> list[dict]:
    rows = []
    for name, (n, k) in shapes.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        copies = max(2, -(-L2_DEFEAT_BYTES // (n * k)))  # fp8 bytes; int4: half of that, still 128+ MB
        if kind == "int4":
            ws = [(tile_words(q), tile_scales(s, z)) for q, s, z in int4_weights(n, k, copies, 0)]
            variants = {label: int4_calls(x, ws, cfg) for label, cfg in int4_variants().items()}
            nbytes = n * k // 2
        else:
            block = None if kind == "fp8 channel" else BLOCK
            ws = fp8_weights(n, k, copies, 1, block)
            variants = {label: fp8_calls(x, ws, cfg, block) for label, cfg in fp8_variants().items()}
            nbytes = n * k
        for label, fns in variants.items():
            row = dict(kind=kind, shape=name, n=n, k=k, m=m, variant=label)
            try:
                row["us"] = bench_env.graph_per_call_us(fns, min_calls=2 * len(fns), repeats=20)
                row["gbs"] = nbytes / row["us"] / 1e3
            except Exception as exc:  # e.g. a launch too large for the GPU: reported, not fatal
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
        del ws, variants
        torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict], shapes: dict, title: str, layers: int | None) -> None:
    labels = list(dict.fromkeys(r["variant"] for r in rows))
    print(f"\n==== {title} ====")
    print(f"{'variant':>24} " + " ".join(f"{s[:10]:>10}" for s in shapes) + (f" {'step us':>8}" if layers else ""))
    for label in labels:
        mine = {r["shape"]: r.get("us") for r in rows if r["variant"] == label}
        us = [mine.get(s) for s in shapes]
        cells = " ".join(f"{u:10.2f}" if u else f"{'-':>10}" for u in us)
        step = (f" {layers * sum(us):8.0f}" if all(us) else f" {'-':>8}") if layers else ""
        print(f"{label:>24} {cells}{step}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tokens", default="1,4", help="token counts to time (comma-separated)")
    ap.add_argument("--only", default="", help="variants to time, comma-separated labels (default: all)")
    ns = ap.parse_args()
    env = bench_env.environment(torch.device("cuda"))
    print(json.dumps(env), flush=True)
    rows = checks()
    bad = [r for r in rows if not r["ok"]]
    n_checks = len(rows)
    print(f"checks: {n_checks - len(bad)} ok, {len(bad)} wrong", flush=True)
    tables = []
    for m in (int(t) for t in ns.tokens.split(",")):
        for kind, shapes, title, layers in (
                ("int4", SHAPES, f"int4 tiled, DeepSeek-LLM-7B, {m} token(s), µs a call", LAYERS),
                ("int4", V2_LITE_SHAPES, f"int4 tiled, DeepSeek-V2-Lite, {m} token(s), µs a call", V2_LITE_LAYERS),
                ("fp8 channel", SHAPES, f"FP8 per channel, DeepSeek-LLM-7B, {m} token(s), µs a call", LAYERS),
                ("fp8 block", V3_SHAPES, f"FP8 128 x 128, DeepSeek-V3 dense shapes, {m} token(s), µs a call", None)):
            got = timed(kind, shapes, m)
            rows += got
            tables.append((got, shapes, title, layers))
    for table in tables:
        print_table(*table)
    if ns.json:
        ns.json.write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    print(f"checks: {n_checks - len(bad)} ok, {len(bad)} wrong" +  # the checks only, not the timed rows
          "".join(f"\n  {r['check']} {r['variant']} m{r['m']} n{r['n']} k{r['k']}: {r['rel_err']}" for r in bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
