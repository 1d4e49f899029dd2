"""The one int4 / int8 weight-tile dequantization both W4A16 GEMMs share (kernels/int4.py for linear
layers, kernels/fused_moe.py for the routed experts); int4_ref.py has the layout and the numerics."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dequantize_tile(q_cols, s_cols, z_cols, g_ptr, offs_k, k_start, K, BITS: tl.constexpr, GROUP: tl.constexpr,
                    HAS_G_IDX: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """w^T [BLOCK_K, BLOCK_N] in fp32 for inputs offs_k (= k_start + arange(BLOCK_K)) of the BLOCK_N output
    rows whose packed codes start at q_cols and whose scales / zero points (one per group, contiguous) start
    at s_cols / z_cols (all [BLOCK_N] pointers); g_ptr: g_idx [K] under act order. Inputs past K read
    code 0: their activations are 0."""
    PACK: tl.constexpr = 32 // BITS
    q_ptrs = q_cols[None, :] + (offs_k // PACK)[:, None]  # each int32 read PACK times (L1)
    if EVEN_K:
        packed = tl.load(q_ptrs)
    else:
        packed = tl.load(q_ptrs, mask=(offs_k < K)[:, None], other=0)
    codes = (packed >> ((offs_k % PACK) * BITS)[:, None]) & ((1 << BITS) - 1)  # [BLOCK_K, BLOCK_N]
    ONE_GROUP_PER_TILE: tl.constexpr = (not HAS_G_IDX) and GROUP % BLOCK_K == 0
    if ONE_GROUP_PER_TILE:  # the tile's inputs share a group: one scale and zero per output row
        g0 = k_start // GROUP
        s = tl.load(s_cols + g0).to(tl.float32)[None, :]
        z = tl.load(z_cols + g0).to(tl.float32)[None, :]
    else:
        k_in = offs_k % K  # in bounds for the masked tail
        g = tl.load(g_ptr + k_in) if HAS_G_IDX else k_in // GROUP
        s = tl.load(s_cols[None, :] + g[:, None]).to(tl.float32)
        z = tl.load(z_cols[None, :] + g[:, None]).to(tl.float32)
    return (codes.to(tl.float32) - z) * s
