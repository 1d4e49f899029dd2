"""The int4 tensor-core decode GEMV with its weights staged through shared memory by the copy engine
(kernels/int4_tma_gemv.py) against the register-loaded kernel it would replace (int4_mma_gemv's tiled layout,
the launch the engine takes today). Why: the register-loaded kernel keeps about one 1 KB round a warp in flight
and streams a 7B step's shapes at ~2-2.4 TB/s; the copy engine can keep STAGES rounds a program in flight.

Every variant is first checked against x @ the dequantized weight (1 / 3 / 4 / 8 tokens, bf16 / fp16, bias,
one split and split-K; exit 1 if one is wrong), then timed as gemv_split_probe.py does (µs a call in a CUDA
graph, weights from HBM) on DeepSeek-LLM-7B's and DeepSeek-V2-Lite's int4 shapes, with per-step sums; also
launched with programmatic dependence (the weights asked for before griddepcontrol.wait), and each GEMV after
a small kernel that writes x, as in the engine. Every shape and token count takes the copy-engine kernel here
(int4_tma_gemv.tma_supported's limits are lifted), so its tables are what those limits were read from.

    python bench/gemv_tma_probe.py [--json OUT.json] [--tokens 1,4] [--stages 2,3,4] [--between-tokens 1]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import bench_env
import torch
from gemv_probe import GROUP, L2_DEFEAT_BYTES, LAYERS, SHAPES, int4_weights, rel_err
from gemv_split_probe import V2_LITE_LAYERS, V2_LITE_SHAPES, print_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from deepserve.kernels import int4_ref, int4_tma_gemv  # noqa: E402
from deepserve.kernels.int4_mma_gemv import (  # noqa: E402
    TILED_CONFIG,
    Int4MmaGemvConfig,
    tile_scales,
    tile_words,
    w4a16_mma_gemv,
)


def variants(stages: list[int]) -> dict[str, Int4MmaGemvConfig]:
    base = replace(TILED_CONFIG, tma_stages=0)
    out = {"registers": base}
    for s in stages:
        out[f"tma s{s}"] = replace(base, tma_stages=s, tma_pdl=0)
        out[f"tma s{s} pdl"] = replace(base, tma_stages=s, tma_pdl=1)
    return out


def calls(x: torch.Tensor, ws: list[tuple], cfg: Int4MmaGemvConfig, bias=None, between: bool = False) -> list:
    """One GEMV a call; between: after a small kernel that writes x (x *= 1), as in the engine, where a GEMV
    follows a norm or an activation that is not launched with programmatic dependence."""
    gemv = [lambda w=w: w4a16_mma_gemv(x, w[0], w[1], None, GROUP, bias, cfg, tiled=True) for w in ws]
    if between:
        return [lambda g=g: (x.mul_(1.0), g()) for g in gemv]
    return gemv


def checks(stages: list[int]) -> list[dict]:
    rows = []
    for m, n, k, dtype, bias in ((1, 2048, 2816, torch.bfloat16, True), (4, 576, 2048, torch.float16, False),
                                 (8, 4096, 11008, torch.bfloat16, False), (3, 1536, 7168, torch.float16, True),
                                 (1, 12288, 4096, torch.bfloat16, False)):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
        (q, s, z), = int4_weights(n, k, 1, m + n)
        want = x.float() @ int4_ref.dequantize(q, s, z, 4, GROUP).float().T + (b.float() if bias else 0)
        tiled = [(tile_words(q), tile_scales(s, z))]
        for label, cfg in variants(stages).items():
            got_fn = calls(x, tiled, cfg, b)[0]
            got, again = got_fn(), got_fn()
            err = rel_err(got, want)
            row = dict(check="int4", variant=label, m=m, n=n, k=k, dtype=str(dtype), bias=bias, rel_err=err,
                       same_twice=bool(torch.equal(got, again)), ok=err < 1e-2 and bool(torch.equal(got, again)))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def timed(shapes: dict, m: int, stages: list[int], between: bool = False) -> list[dict]:
    rows = []
    for name, (n, k) in shapes.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        copies = max(2, -(-L2_DEFEAT_BYTES // (n * k)))
        ws = [(tile_words(q), tile_scales(s, z)) for q, s, z in int4_weights(n, k, copies, 0)]
        for label, cfg in variants(stages).items():
            row = dict(kind="int4", shape=name, n=n, k=k, m=m, variant=label, between=between)
            try:
                fns = calls(x, ws, cfg, between=between)
                row["us"] = bench_env.graph_per_call_us(fns, min_calls=2 * len(fns), repeats=20)
                row["gbs"] = n * k // 2 / row["us"] / 1e3
            except Exception as exc:  # reported, not fatal
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
        del ws
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tokens", default="1,4", help="token counts to time (comma-separated)")
    ap.add_argument("--stages", default="2", help="TMA stage counts to try (comma-separated)")
    ap.add_argument("--between-tokens", default="1", help="token counts to time with a small kernel writing x "
                    "before each GEMV (comma-separated; empty: none)")
    ns = ap.parse_args()
    stages = [int(s) for s in ns.stages.split(",")]
    int4_tma_gemv.TMA_MIN_BYTES, int4_tma_gemv.TMA_MAX_TOKENS = 0, 8  # every shape through the kernel under test
    env = bench_env.environment(torch.device("cuda"))
    print(json.dumps(env), flush=True)
    rows = checks(stages)
    bad = [r for r in rows if not r["ok"]]
    n_checks = len(rows)
    print(f"checks: {n_checks - len(bad)} ok, {len(bad)} wrong", flush=True)
    tables = []
    runs = [(int(t), False) for t in ns.tokens.split(",") if t] + \
        [(int(t), True) for t in ns.between_tokens.split(",") if t]
    for m, between in runs:
        after = ", after x *= 1 (µs a pair)" if between else ", µs a call"
        for shapes, title, layers in ((SHAPES, f"int4 tiled, DeepSeek-LLM-7B, {m} token(s){after}", LAYERS),
                                      (V2_LITE_SHAPES, f"int4 tiled, DeepSeek-V2-Lite, {m} token(s){after}",
                                       V2_LITE_LAYERS)):
            got = timed(shapes, m, stages, between)
            rows += got
            tables.append((got, shapes, title, layers))
    for table in tables:
        print_table(*table)
    if ns.json:
        ns.json.write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    print(f"checks: {n_checks - len(bad)} ok, {len(bad)} wrong" +
          "".join(f"\n  {r['variant']} m{r['m']} n{r['n']} k{r['k']}: {r['rel_err']}" for r in bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
