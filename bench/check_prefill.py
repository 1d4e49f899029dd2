"""Prefill attention on one GPU, for W1's prompt lengths: per-sequence SDPA with SDPA's own backend
choice (as main ran from 34b42fb to 08e66c9; cuDNN on the H200), the same held to flash, and
deepserve's one call over the ragged batch (flash's varlen kernel, `varlen_attention`).

Per model shape, one 8,192-token prefill step of fresh prompts (lengths drawn as W1 draws them:
random.seed(0), randint(100, 1024), as many as fit), plus one chunk of 1,024 new tokens after a
3,072-token cached prefix. Each variant's output is compared with an fp32 explicit softmax, then timed
(median of CUDA-event timings of 20 calls after 3 warm-ups: the per-layer attention cost of the step;
x layers = the step's). The table comes last; JSON to $OUT/prefill.json when OUT is set.

    python bench/check_prefill.py           # the H200 run, well under a minute
    python bench/check_prefill.py --smoke   # tiny shapes, on CPU: checks the script and the math
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from deepserve.kernels.mla_attention import mla_varlen_attention  # noqa: E402
from deepserve.kernels.paged_attention import fused_sdpa  # noqa: E402

# name: (query heads, key heads, key head dim, value head dim, layers)
MODELS = {"DeepSeek-LLM-7B": (32, 32, 128, 128, 30), "R1-Distill-Qwen-7B": (28, 4, 128, 128, 28),
          "V2-Lite (expanded MLA)": (16, 16, 192, 128, 27)}
SMOKE_MODELS = {"tiny-gqa": (4, 2, 16, 16, 2), "tiny-mla": (4, 4, 24, 16, 2)}


def w1_lengths(budget: int, lo: int = 100, hi: int = 1024) -> list[int]:
    random.seed(0)
    lengths = []
    while True:
        n = random.randint(lo, hi)
        if sum(lengths) + n > budget:
            return lengths
        lengths.append(n)


def sdpa_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, group: int) -> torch.Tensor:
    """Per sequence, 4-D SDPA with SDPA's own backend choice (how main ran from 34b42fb: cuDNN on the H200)."""
    dv = v.shape[-1]
    if dv < q.shape[-1]:  # as MLA's expanded form does
        v = F.pad(v, (0, q.shape[-1] - dv))
    return fused_sdpa(q, k, v, scale, group)[..., :dv]


def sdpa_flash_path(q, k, v, scale: float, group: int) -> torch.Tensor:
    """The same with SDPA held to its flash backend (what cuDNN off measured in BENCHMARKS.md)."""
    backends = [SDPBackend.FLASH_ATTENTION] if q.is_cuda else [SDPBackend.MATH]
    with sdpa_kernel(backends):
        return sdpa_path(q, k, v, scale, group)


def packed_varlen(qs, ks, vs, strided: bool = False):
    """deepserve's prefill, all sequences in one call (`mla_varlen_attention` pads MLA's value head; on
    CUDA flash's varlen kernel, elsewhere the per-sequence reference), with its inputs packed here,
    outside the timed call, as prepare_inputs and the projections hand them over. strided: q, k, v are
    views of one fused [T, H + 2 Hkv, D] tensor, as a model's split qkv projection gives them (rows
    strided, heads contiguous)."""
    lens_q, lens_k = [t.shape[0] for t in qs], [t.shape[0] for t in ks]
    cu_q, cu_k = _offsets(lens_q), _offsets(lens_k)
    device = qs[0].device
    if strided:
        heads, kv_heads = qs[0].shape[1], ks[0].shape[1]
        fused = torch.cat([torch.cat(qs), torch.cat(ks), torch.cat(vs)], dim=1)
        q, k, v = fused.split([heads, kv_heads, kv_heads], dim=1)
    else:
        q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    cu_q_t = torch.tensor(cu_q, dtype=torch.int32, device=device)
    cu_k_t = torch.tensor(cu_k, dtype=torch.int32, device=device)
    return lambda scale: mla_varlen_attention(q, k, v, cu_q_t, cu_k_t, cu_q, cu_k, scale)


def _offsets(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, group: int) -> torch.Tensor:
    n, length = q.shape[0], k.shape[0]
    k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
    s = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    s = s.masked_fill(torch.arange(length, device=q.device)[None] > torch.arange(length - n, length,
                                                                                 device=q.device)[:, None],
                      float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


def timed(fn, device: str, reps: int) -> float:
    """Median ms of one call."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def case(name: str, shape: tuple, lengths: list[int], cached: int, device: str, dtype: torch.dtype,
         reps: int) -> dict:
    heads, kv_heads, dk, dv, layers = shape
    group, scale = heads // kv_heads, dk ** -0.5
    gen = torch.Generator(device=device).manual_seed(0)
    qs = [torch.randn(n, heads, dk, device=device, dtype=dtype, generator=gen) for n in lengths]
    ks = [torch.randn(n + cached, kv_heads, dk, device=device, dtype=dtype, generator=gen) for n in lengths]
    vs = [torch.randn(n + cached, kv_heads, dv, device=device, dtype=dtype, generator=gen) for n in lengths]
    row = {"model": name, "seqs": len(lengths), "new_tokens": sum(lengths), "cached": cached, "layers": layers}
    ref = [explicit(q, k, v, scale, group) for q, k, v in zip(qs, ks, vs, strict=True)]

    def per_seq(path):
        return [path(q, k, v, scale, group) for q, k, v in zip(qs, ks, vs, strict=True)]

    varlen = packed_varlen(qs, ks, vs)
    variants = {"sdpa auto": lambda: per_seq(sdpa_path), "sdpa flash": lambda: per_seq(sdpa_flash_path),
                "flash varlen": lambda: varlen(scale)}
    if cached == 0 and dk == dv:
        strided = packed_varlen(qs, ks, vs, strided=True)
        variants["varlen strided"] = lambda: strided(scale)
    for label, fn in variants.items():
        out = fn()
        out = list(out.split(lengths)) if isinstance(out, torch.Tensor) else out
        err = max(((o.float() - r).abs().max() / r.abs().max()).item() for o, r in zip(out, ref, strict=True))
        ms = timed(fn, device, reps)
        row[label] = {"ms_per_layer": round(ms, 3), "ms_per_step": round(ms * layers, 2), "max_rel_err": err}
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    models = SMOKE_MODELS if args.smoke else MODELS
    budget, chunk, prefix = (64, 8, 24) if args.smoke else (8192, 1024, 3072)
    reps = 3 if args.smoke else 20
    rows = []
    for name, shape in models.items():
        rows.append(case(name, shape, w1_lengths(budget, *((4, 20) if args.smoke else ())), 0, device, dtype, reps))
        rows.append(case(name, shape, [chunk], prefix, device, dtype, reps))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "prefill.json").write_text(json.dumps(rows, indent=1))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"\nprefill attention, {gpu}, torch {torch.__version__}")
    print(f"{'model':24} {'seqs':>4} {'new':>6} {'cached':>6}  {'variant':12} {'ms/layer':>9} {'ms/step':>8} "
          f"{'err':>8}")
    bad = 0
    for r in rows:
        for label in ("sdpa auto", "sdpa flash", "flash varlen", "varlen strided"):
            if label in r:
                v = r[label]
                flag = "" if v["max_rel_err"] < tol else "  MISMATCH"
                bad += bool(flag)
                print(f"{r['model']:24} {r['seqs']:>4} {r['new_tokens']:>6} {r['cached']:>6}  {label:12} "
                      f"{v['ms_per_layer']:>9.3f} {v['ms_per_step']:>8.2f} {v['max_rel_err']:>8.1e}{flag}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
