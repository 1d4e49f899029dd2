"""The FP8 weight-stream GEMV (deepserve/kernels/fp8_gemv.py) against the product of the activations and
the dequantized weight (fp8_ref's dequantize helpers; the activations are not quantized on this path).

Weights whose 128 x 128 blocks differ in magnitude by up to 10^4 (test_fp8_gemm.py's block_weight), so a
scale read from the wrong block is far outside the tolerance; odd N and K leave partial tiles and blocks.
Both numerics ("dot": a tensor-core row tile; "fma": row by row), split-K fixed and chosen, bias, fp32 and
bf16 activations, block and per-channel scales, and the switch in fp8.py's linear wrappers."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_fp8_gemm import block_weight, rel_err
from tests.kernels.triton_setup import DEVICE, MARKS, import_kernels

fp8 = import_kernels("deepserve.kernels.fp8")
gemv = import_kernels("deepserve.kernels.fp8_gemv")

from deepserve.kernels import fp8_ref as ref  # noqa: E402

pytestmark = MARKS
BLOCK = (128, 128)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ w.float().T
    return out if bias is None else out + bias.float()


@pytest.mark.parametrize("numerics", ["dot", "fma", "fma-prefetch"])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n, k", [(200, 256), (130, 328)])
@pytest.mark.parametrize("split_k", [1, 3, 0])
def test_block_scaled_gemv_equals_the_dequantized_product(numerics, m, n, k, split_k):
    # split 3 over K 256 (4 tiles of 64): 2 + 2 + 0 tiles, the empty split's prefetch still reads in bounds
    w_q, scale = block_weight(n, k, BLOCK, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    bias = torch.randn(n).to(DEVICE) if split_k != 1 else None
    prefetch = numerics.endswith("-prefetch")
    cfg = gemv.Fp8GemvConfig(block_n=32, block_k=64, split_k=split_k, numerics=numerics.removesuffix("-prefetch"),
                             prefetch=prefetch)
    out = gemv.fp8_gemv(x, w_q, scale, BLOCK, bias, cfg)
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert rel_err(out, reference(x, ref.dequantize_weight_block(w_q, scale, BLOCK), bias)) < TOLERANCE[x.dtype]


@pytest.mark.parametrize("block_n", [32, 256])  # 32 divides the 128 scale block (one scale a tile); 256 does not
@pytest.mark.parametrize("n, k", [(200, 256), (130, 328)])
@pytest.mark.parametrize("split_k,prefetch", [(1, False), (3, False), (0, True)])
def test_fma2d_one_row_equals_the_dequantized_product(block_n, n, k, split_k, prefetch):
    w_q, scale = block_weight(n, k, BLOCK, seed=n + k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).to(DEVICE)
    bias = torch.randn(n).to(DEVICE)
    cfg = gemv.Fp8GemvConfig(block_n=block_n, block_k=64, split_k=split_k, numerics="fma2d", prefetch=prefetch)
    out = gemv.fp8_gemv(x, w_q, scale, BLOCK, bias, cfg)
    assert rel_err(out, reference(x, ref.dequantize_weight_block(w_q, scale, BLOCK), bias)) < TOLERANCE[x.dtype]
    with pytest.raises(ValueError, match="one row"):
        gemv.fp8_gemv(torch.cat([x, x]), w_q, scale, BLOCK, bias, cfg)


@pytest.mark.parametrize("numerics,prefetch", [("dot", False), ("fma", False), ("fma", True), ("dot", True),
                                               ("fma2d", False), ("fma2d", True)])
def test_bf16_activations_and_per_channel_scales(numerics, prefetch):
    # K 200: the last K tile of 64 is partial (masked), also in the prefetched load
    n, k = 96, 200
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * torch.logspace(-2, 2, n)[:, None]
    w_q, scale = ref.quantize_weight_per_channel(w.to(DEVICE))
    rows = 1 if numerics == "fma2d" else 2
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
    cfg = gemv.Fp8GemvConfig(block_n=32, block_k=64, numerics=numerics, prefetch=prefetch)
    out = gemv.fp8_gemv(x, w_q, scale, None, None, cfg)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, reference(x, w_q.float() * scale[:, None], None)) < TOLERANCE[torch.bfloat16]


def test_the_linear_wrappers_take_it_up_to_gemv_max_m(monkeypatch):
    # With the switch at 4, M <= 4 gives the GEMV's (unquantized activations) result and M = 5 the
    # W8A8 path's.
    n, k = 200, 256
    w_q, scale = block_weight(n, k, BLOCK, seed=3)
    w = ref.dequantize_weight_block(w_q, scale, BLOCK)
    monkeypatch.setattr(fp8, "GEMV_MAX_M", 4)
    for m in (1, 4, 5):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
        out = fp8.block_fp8_linear(x, w_q, scale, BLOCK)
        exact = rel_err(out, reference(x, w, None))
        assert (exact < 1e-5) if m <= 4 else (1e-5 < exact < 5e-2)  # W8A8 rounds the activations too
    # Per-channel weights: the GPU wrapper's choice, run here through the interpreter.
    cw_q, cscale = ref.quantize_weight_per_channel(w)
    cw = cw_q.float() * cscale[:, None]
    for m in (2, 5):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(9)).to(DEVICE)
        exact = rel_err(fp8.channel_fp8_cuda(x, cw_q, cscale), reference(x, cw, None))
        assert (exact < 1e-5) if m <= 4 else (1e-5 < exact < 5e-2)


def test_one_token_takes_the_gemv_by_default_and_k_blocks_it_cannot_tile_take_w8a8():
    # The default (DEEPSERVE_FP8_GEMV_MAX_M unset) streams one token's weight; a scale block of 96 along K,
    # which the GEMV's 128-wide K tile does not divide (the loader accepts any weight_block_size), takes the
    # W8A8 path instead of raising.
    assert fp8.GEMV_MAX_M >= 1
    n, k = 200, 384
    for block, exact in (((128, 128), True), ((128, 96), False)):
        w_q, scale = block_weight(n, k, block, seed=5)
        w = ref.dequantize_weight_block(w_q, scale, block)
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(4)).to(DEVICE)
        err = rel_err(fp8.block_fp8_linear(x, w_q, scale, block), reference(x, w, None))
        assert (err < 1e-5) if exact else (1e-5 < err < 5e-2)


def test_bad_shapes_are_refused_naming_what_to_pass():
    w_q, scale = block_weight(64, 128, BLOCK, seed=0)
    with pytest.raises(ValueError, match="M <= 16"):
        gemv.fp8_gemv(torch.randn(17, 128).to(DEVICE), w_q, scale, BLOCK)
    with pytest.raises(ValueError, match="scale must be float32"):
        gemv.fp8_gemv(torch.randn(1, 128).to(DEVICE), w_q, scale[:, :0], BLOCK)
    with pytest.raises(ValueError, match="block_k 256 must divide"):
        gemv.fp8_gemv(torch.randn(1, 128).to(DEVICE), w_q, scale, BLOCK, config=gemv.Fp8GemvConfig(block_k=256))


def test_the_default_configs_are_the_sweeps_geometric_mean_winners():
    # bench/fp8_decode_graphs.py's keys are numerics-block_n-block_k-waves-num_warps (GEMV_CONFIGS' order);
    # the defaults must be the configs with the best geometric-mean time of FP8 GEMV sweep 1 (RESULTS.md).
    import json
    import math
    from pathlib import Path

    sweep = Path(__file__).parents[2] / "bench/results/2026-12-01/fp8gemv1-e2bfcbb.json"
    rows = json.loads(sweep.read_text())["gemv"]

    def winner(ms):
        ratios: dict[str, list[float]] = {}
        chosen = [r for r in rows if r["M"] in ms]
        for r in chosen:
            best = min(r["gemv"].values())
            for key, us in r["gemv"].items():
                ratios.setdefault(key, []).append(us / best)
        full = {k: math.exp(sum(map(math.log, v)) / len(v)) for k, v in ratios.items() if len(v) == len(chosen)}
        return min(full, key=full.get)

    for m, ms in ((1, (1,)), (2, (2, 4, 8, 16))):
        numerics, block_n, block_k, waves, warps = winner(ms).split("-")
        cfg = gemv.default_gemv_config(m, 4096, 4096)
        assert (cfg.numerics, cfg.block_n, cfg.block_k, cfg.waves, cfg.num_warps) == (
            numerics, int(block_n), int(block_k), int(waves), int(warps))
