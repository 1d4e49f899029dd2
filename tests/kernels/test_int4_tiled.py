"""The int4 weights in the tensor-core GEMV's tiled layout (kernels/int4_mma_gemv.tile_words / tile_scales):
the layout itself, and the other int4 kernels reading it (the tile kernel, dequantize + cuBLAS), against the
torch reference on the row-major weights they were made from. The mma GEMV's own reading of it is replayed in
tests/kernels/test_int4_mma_gemv.py (and checked on the H200 by bench/gemv_probe.py)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_int4_gemm import TOLERANCE, random_weights, rel_err
from tests.kernels.triton_setup import DEVICE, MARKS, import_kernels

int4 = import_kernels("deepserve.kernels.int4")

from deepserve.kernels import int4_dequant, int4_mma_gemv, int4_ref  # noqa: E402

pytestmark = MARKS


def test_tile_words_puts_each_lanes_words_where_the_kernel_reads_them():
    n, k = 48, 512
    qweight = random_weights(n, k, 4, 128, False, seed=1)[0]
    flat = int4_mma_gemv.tile_words(qweight).flatten()
    codes = int4_ref.unpack_rows(qweight, 4)  # [N, K]
    for tile, block, half, g, t, j in ((0, 0, 0, 0, 0, 0), (2, 3, 1, 7, 3, 3), (1, 2, 0, 5, 1, 2)):
        # the kernel's address of lane (g, t)'s word j of block `block`, rows g (half 0) or g + 8 (half 1)
        word = int(flat[tile * (k // 8 * 16) + block * 256 + half * 128 + (4 * g + t) * 4 + j]) & 0xFFFFFFFF
        row, first = tile * 16 + half * 8 + g, block * 128 + (4 * t + j) * 8
        nibbles = [(word >> (4 * p)) & 0xF for p in range(8)]
        # nibble p holds code NIBBLE_CODES[p]: pairs (q_2i, q_2i+1) under nibbles (i, i + 4)
        assert [nibbles[p] for p in range(8)] == [int(codes[row, first + c]) for c in (0, 2, 4, 6, 1, 3, 5, 7)]


def test_tile_scales_gives_each_lane_its_two_rows():
    scales, zeros = torch.randn(32, 4).half(), torch.randn(32, 4).half()
    tiled = int4_mma_gemv.tile_scales(scales, zeros)
    assert tiled.shape == (2, 4, 8, 4)
    assert tiled[1, 2, 3].tolist() == [scales[19, 2], scales[27, 2], zeros[19, 2], zeros[27, 2]]


def test_tiles_apply_only_to_what_the_mma_gemv_reads():
    assert int4_mma_gemv.tiles_apply(4, 128, None, 4096, 4096)
    assert not int4_mma_gemv.tiles_apply(8, 128, None, 4096, 4096)
    assert not int4_mma_gemv.tiles_apply(4, 64, None, 4096, 4096)
    assert not int4_mma_gemv.tiles_apply(4, 128, torch.zeros(4096), 4096, 4096)
    assert not int4_mma_gemv.tiles_apply(4, 128, None, 4104, 4096)  # no partial tiles
    assert not int4_mma_gemv.tiles_apply(4, 256, None, 4096, 384)  # no partial groups
    assert not int4_mma_gemv.tiles_apply(4, 4096, None, 4096, 2048)  # a group wider than K


@pytest.mark.parametrize("config", [int4.Int4GemmConfig(16, 32, 32, 2, 4, 2),
                                    int4.Int4GemmConfig(16, 32, 64, 1, 4, 2, reshape_unpack=False),
                                    int4.Int4GemmConfig(16, 32, 128, 1, 4, 2, split_k=2),
                                    int4_dequant.Int4DequantConfig(block_n=16, block_k=64),
                                    None])
@pytest.mark.parametrize("group, dtype", [(128, torch.float32), (256, torch.float32), (128, torch.bfloat16),
                                          (256, torch.float16)])
def test_the_other_kernels_read_the_tiled_layout(config, group, dtype):
    # None: w4a16_matmul's own choice at M = 1 (the CUDA-core GEMV, which cannot read it: the tile kernel)
    m, n, k = (1 if config is None else 3), 48, 512
    qweight, scales, zeros, _ = (t.to(DEVICE) if t is not None else None
                                 for t in random_weights(n, k, 4, group, False, seed=group))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    # the weight rounded to x's dtype, as every kernel (and a model on the dequantized weights) holds it
    w = int4_ref.dequantize(qweight, scales, zeros, 4, group).to(dtype).float()
    want = torch.nn.functional.linear(x.float(), w, bias.float())
    tiled = (int4_mma_gemv.tile_words(qweight), int4_mma_gemv.tile_scales(scales, zeros))
    got = int4.w4a16_matmul(x, tiled[0], tiled[1], None, 4, group, None, bias, config=config, tiled=True)
    assert got.dtype == dtype and rel_err(got, want) < TOLERANCE[dtype]
    # two tiles' words swapped: the rows of both come out wrong (the check can fail)
    swapped = torch.cat([tiled[0][16:32], tiled[0][:16], tiled[0][32:]])
    bad = int4.w4a16_matmul(x, swapped, tiled[1], None, 4, group, None, bias, config=config, tiled=True)
    assert rel_err(bad, want) > 10 * TOLERANCE[dtype]


def test_tiled_weights_are_refused_where_they_cannot_be():
    qweight, scales, zeros, _ = random_weights(40, 256, 4, 128, False, seed=0)
    x = torch.randn(1, 256)
    with pytest.raises(ValueError, match="N a multiple of 16"):
        int4.w4a16_matmul(x.to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE), None, 4, 128, tiled=True)
    q48, s48, z48, _ = random_weights(48, 256, 4, 128, False, seed=0)
    q48, tiled_s48 = int4_mma_gemv.tile_words(q48).to(DEVICE), int4_mma_gemv.tile_scales(s48, z48).to(DEVICE)
    with pytest.raises(ValueError, match="tile_scales"):
        int4.w4a16_matmul(x.to(DEVICE), q48, s48.to(DEVICE), None, 4, 128, tiled=True)
    with pytest.raises(ValueError, match="4-bit codes, no g_idx"):  # act order cannot be tiled
        int4.w4a16_matmul(x.to(DEVICE), q48, tiled_s48, None, 4, 128, torch.zeros(256, dtype=torch.int32).to(DEVICE),
                          tiled=True)
    with pytest.raises(ValueError, match="does not read the tiled layout"):  # asked for the CUDA-core GEMV
        int4.w4a16_matmul(x.to(DEVICE), q48, tiled_s48, None, 4, 128, config=int4.default_gemv_config(1),
                          tiled=True)
