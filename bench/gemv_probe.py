"""The one-token GEMVs of a decode step (int4 W4A16 and FP8 per-channel), variant by variant, as the engine's
graph runs them: for each of DeepSeek-LLM-7B's four linear shapes, one CUDA graph of calls that cycle
through enough copies of the weight that L2 (50 MB) holds none of them (each call streams its weight from
HBM, as a step's 30 layers do), timed by replay (bench_env.graph_per_call_us). Every variant is first checked
against a torch reference on the same weights (exit 1 if one is wrong). The table ends with the per-step sum
(30 layers x the four shapes) and the streamed GB/s.

    python bench/gemv_probe.py [--json OUT.json]
    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \\
        python bench/gemv_probe.py --ncu       # one call of each variant on the gate_up shape, profiled
    python bench/gemv_probe.py --prefill       # the prefill kernels (M 32, 1,024), row vs tiled layout

--ncu compiles and runs every variant first, then runs each once more between cudaProfilerStart / Stop
and prints the launch order, so Nsight Compute's kernels can be matched to the variants.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import bench_env
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from deepserve.kernels import fp8_gemv, int4  # noqa: E402
from deepserve.kernels import int4_ref as ref  # noqa: E402
from deepserve.kernels.fp8_ref import quantize_weight_per_channel  # noqa: E402
from deepserve.kernels.int4_gemv import default_gemv_config  # noqa: E402
from deepserve.kernels.int4_mma_gemv import (  # noqa: E402
    TILED_CONFIG,
    Int4MmaGemvConfig,
    tile_scales,
    tile_words,
    w4a16_mma_gemv,
)

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
LAYERS = 30
L2_DEFEAT_BYTES = 256 << 20  # weight copies per shape: at least this many bytes, 5x the H200's L2
GROUP = 128


def int4_variants() -> dict:
    magic = default_gemv_config(1)  # magic numerics, 64 x 128 tiles, register prefetch
    return {"int4 magic (default)": magic}


def mma_variants() -> dict:
    """label -> (config, tiled): the row layout's default (2 warps, 8 programs an SM, prefetching) and runner-up,
    and the tiled layout's default (tile_words / tile_scales: one-warp programs, 16 an SM)."""
    return {"int4 mma (default)": (Int4MmaGemvConfig(), False),
            "int4 mma w4 pps4": (Int4MmaGemvConfig(num_warps=4, programs_per_sm=4, one_split=False), False),
            "int4 mma tiled (default)": (TILED_CONFIG, True),
            "int4 mma tiled w2 pps8": (Int4MmaGemvConfig(one_split=False), True)}


def mma_call(x, w: tuple, group: int, bias, cfg: Int4MmaGemvConfig, tiled: bool):
    """A call of the mma GEMV on row-layout weights w, rearranged first (untimed) where tiled."""
    if tiled:
        w = tile_words(w[0]), tile_scales(w[1], w[2]), None
    return lambda: w4a16_mma_gemv(x, *w, group, bias, cfg, tiled)


def fp8_variants() -> dict:
    return {"fp8 fma (default)": fp8_gemv.default_gemv_config(1, 4096, 4096)}


def int4_weights(n: int, k: int, copies: int, seed: int, group: int = GROUP) -> list[tuple]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(copies):
        codes = torch.randint(0, 16, (n, k), device="cuda", generator=g, dtype=torch.int32)
        qweight = ref.pack_rows(codes, 4)
        scales = (torch.rand(n, k // group, device="cuda", generator=g) * 0.02 + 0.001).half()
        zeros = torch.randint(0, 16, (n, k // group), device="cuda", generator=g, dtype=torch.int32).half()
        out.append((qweight, scales, zeros))
    return out


def fp8_weights(n: int, k: int, copies: int, seed: int) -> list[tuple]:
    torch.manual_seed(seed)
    return [quantize_weight_per_channel(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
            for _ in range(copies)]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def shape_rows(name: str, n: int, k: int, ncu: bool) -> list[dict]:
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    copies = 1 if ncu else max(2, -(-L2_DEFEAT_BYTES // (n * k)))  # fp8 bytes; int4 then 128+ MB
    q4, q8 = int4_weights(n, k, copies, 0), fp8_weights(n, k, copies, 1)
    bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(1, copies // 2))]
    w4 = ref.dequantize(*q4[0], 4, GROUP).to(torch.bfloat16).float()
    want4 = x.float() @ w4.T
    want8 = x.float() @ (q8[0][0].float() * q8[0][1][:, None]).T
    variants = {}
    for label, cfg in int4_variants().items():
        variants[label] = ([lambda w=w, c=cfg: int4.w4a16_matmul(x, *w, 4, GROUP, config=c) for w in q4], want4,
                           n * k // 2)
    for label, (cfg, tiled) in mma_variants().items():
        variants[label] = ([mma_call(x, w, GROUP, None, cfg, tiled) for w in q4], want4, n * k // 2)
    for label, cfg in fp8_variants().items():
        variants[label] = ([lambda w=w, c=cfg: fp8_gemv.fp8_gemv(x, w[0], w[1], None, None, c) for w in q8], want8,
                           n * k)
    variants["bf16 cuBLAS"] = ([lambda w=w: torch.nn.functional.linear(x, w) for w in bf16], None, n * k * 2)
    rows = []
    for label, (fns, want, nbytes) in variants.items():
        row = dict(shape=name, n=n, k=k, variant=label)
        try:
            got = fns[0]()
            if want is not None:
                row["rel_err"] = rel_err(got, want)
                row["ok"] = row["rel_err"] < 1e-2
            if not ncu:
                row["us"] = bench_env.graph_per_call_us(fns, min_calls=2 * len(fns), repeats=20)
                row["gbs"] = nbytes / row["us"] / 1e3
        except Exception as exc:  # a variant that does not compile is reported, not fatal
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            row["ok"] = False
        rows.append(row)
        print(json.dumps(row), flush=True)
    if ncu:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for i, (label, (fns, _, _)) in enumerate(variants.items()):
            fns[0]()
            print(f"ncu launch order {i}: {label}", flush=True)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    return rows


def print_table(rows: list[dict]) -> None:
    labels = list(dict.fromkeys(r["variant"] for r in rows))
    print("\n==== one-token GEMVs, µs per call (weights from HBM), DeepSeek-LLM-7B shapes ====")
    print(f"{'variant':>26} " + " ".join(f"{s:>9}" for s in SHAPES) + f" {'step us':>9} {'GB/s':>6} {'max err':>8}")
    for label in labels:
        mine = {r["shape"]: r for r in rows if r["variant"] == label}
        us = [mine.get(s, {}).get("us") for s in SHAPES]
        cells = " ".join(f"{u:9.2f}" if u else f"{'-':>9}" for u in us)
        step = LAYERS * sum(us) if all(us) else None
        nbytes = sum(n * k for n, k in SHAPES.values()) * (0.5 if "int4" in label else 1 if "fp8" in label else 2)
        gbs = f"{LAYERS * nbytes / step / 1e3:6.0f}" if step else "     -"
        errs = [r.get("rel_err") for r in mine.values() if r.get("rel_err") is not None]
        err = f"{max(errs):8.1e}" if errs else "       -"
        print(f"{label:>26} {cells} {step or 0:9.0f} {gbs} {err}")


def mma_checks() -> list[dict]:
    """The tensor-core int4 GEMV against x @ the dequantized weight: 1-8 tokens, fp16 and bf16, bias, N not
    a multiple of 16 (row layout only), groups of 128 and 256, K with a split that is not a multiple of the
    warps; each variant in its layout."""
    rows = []
    for m, n, k, group, dtype, bias in ((1, 4096, 4096, 128, torch.bfloat16, False),
                                        (2, 4104, 11008, 128, torch.bfloat16, True),
                                        (3, 1000, 1024, 256, torch.float16, True),
                                        (8, 22016, 4096, 128, torch.bfloat16, False),
                                        (5, 80, 640, 128, torch.float16, False),
                                        (1, 12288, 4096, 128, torch.float16, True),
                                        (4, 96, 1280, 256, torch.bfloat16, True)):
        (qweight, scales, zeros), = int4_weights(n, k, 1, m + n, group)
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
        want = x.float() @ ref.dequantize(qweight, scales, zeros, 4, group).float().T + (b.float() if bias else 0)
        for label, (cfg, tiled) in mma_variants().items():
            if tiled and n % 16:
                continue  # whole tiles only (tiles_apply)
            call = mma_call(x, (qweight, scales, zeros), group, b, cfg, tiled)
            got, again = call(), call()
            row = dict(check="mma", variant=label, m=m, n=n, k=k, group=group, dtype=str(dtype), bias=bias,
                       rel_err=rel_err(got, want), same_twice=bool(torch.equal(got, again)))
            row["ok"] = row["rel_err"] < 1e-2 and row["same_twice"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def token_sweep() -> list[dict]:
    """Per-step µs at M = 1, 2, 4, 8 tokens: the int4 dispatch without the mma GEMV (int4.choose_config: the
    CUDA-core GEMV at one token, the tile kernel above) against the mma GEMV's defaults in the row and the
    tiled layout, weights from HBM as in shape_rows."""
    rows = []
    labels = ("default", "mma", "mma tiled")
    for m in (1, 2, 4, 8):
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            q4 = int4_weights(n, k, max(2, -(-L2_DEFEAT_BYTES // (n * k))), 0)
            before = int4.choose_config(m, n, k)
            calls = ([lambda w=w, x=x, c=before: int4.w4a16_matmul(x, *w, 4, GROUP, config=c) for w in q4],
                     [mma_call(x, w, GROUP, None, Int4MmaGemvConfig(), False) for w in q4],
                     [mma_call(x, w, GROUP, None, TILED_CONFIG, True) for w in q4])
            for label, fns in zip(labels, calls, strict=True):
                us = bench_env.graph_per_call_us(fns, min_calls=2 * len(fns), repeats=20)
                rows.append(dict(sweep=label, m=m, shape=name, us=us))
            del q4, calls
            torch.cuda.empty_cache()
    print("\n==== tokens a step: int4 dispatch without the mma GEMV, mma (row layout), mma (tiled), step µs ====")
    for m in (1, 2, 4, 8):
        steps = [LAYERS * sum(r["us"] for r in rows if r["m"] == m and r["sweep"] == label) for label in labels]
        print(f"M={m}: " + "  ".join(f"{label} {us:8.0f}" for label, us in zip(labels, steps, strict=True)))
    return rows


def prefill_rows() -> list[dict]:
    """The int4 prefill kernels on the row and the tiled layout (the tiled one must be no slower): at M = 32
    (the tile kernel) and 1,024 (dequantize + cuBLAS), each of the four shapes, µs a call inside a CUDA graph;
    each tiled result checked against the row layout's."""
    rows = []
    for m in (32, 1024):
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            q4 = int4_weights(n, k, 2, 0)
            tiled = [(tile_words(q), tile_scales(s, z)) for q, s, z in q4]
            row_fns = [lambda w=w, x=x: int4.w4a16_matmul(x, *w, 4, GROUP) for w in q4]
            tiled_fns = [lambda w=w, x=x: int4.w4a16_matmul(x, w[0], w[1], None, 4, GROUP, tiled=True)
                         for w in tiled]
            err = rel_err(tiled_fns[0](), row_fns[0]().float())
            for label, fns in (("row", row_fns), ("tiled", tiled_fns)):
                us = bench_env.graph_per_call_us(fns, min_calls=4, repeats=10)
                rows.append(dict(prefill=label, m=m, shape=name, us=us, ok=err < 1e-3, rel_err=err))
                print(json.dumps(rows[-1]), flush=True)
            del q4, tiled, row_fns, tiled_fns
            torch.cuda.empty_cache()
    print("\n==== int4 prefill kernels, row vs tiled layout, step µs (30 layers x 4 shapes) ====")
    for m in (32, 1024):
        steps = [LAYERS * sum(r["us"] for r in rows if r["m"] == m and r["prefill"] == label)
                 for label in ("row", "tiled")]
        print(f"M={m}: row {steps[0]:8.0f}  tiled {steps[1]:8.0f}  ratio {steps[1] / steps[0]:5.2f}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--sweep", action="store_true", help="also time 1-8 tokens: default dispatch vs mma")
    ap.add_argument("--ncu", action="store_true", help="the gate_up shape once per variant, for Nsight Compute")
    ap.add_argument("--prefill", action="store_true", help="only the prefill kernels, row vs tiled layout")
    ns = ap.parse_args()
    env = bench_env.environment(torch.device("cuda"))
    print(json.dumps(env), flush=True)
    if ns.prefill:
        rows = prefill_rows()
        bad = [r for r in rows if not r["ok"]]
        print(f"prefill checks: {len(rows) - len(bad)} ok, {len(bad)} wrong")
        return 1 if bad else 0
    rows = mma_checks()
    for name, (n, k) in SHAPES.items():
        if ns.ncu and name != "gate_up":
            continue
        rows += shape_rows(name, n, k, ns.ncu)
        torch.cuda.empty_cache()
    bad = [r for r in rows if r.get("ok") is False]
    if ns.sweep:
        rows += token_sweep()
    checked = [r for r in rows if r.get("check")]
    print(f"mma checks: {sum(1 for r in checked if r['ok'])} ok of {len(checked)}")
    if not ns.ncu:
        print_table([r for r in rows if "shape" in r and "variant" in r])
    if ns.json:
        ns.json.write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    print(f"checks: {len(rows) - len(bad)} ok, {len(bad)} wrong or failed" +
          "".join(f"\n  {r.get('shape') or r}: {r['variant']}: {r.get('error') or r.get('rel_err')}" for r in bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
