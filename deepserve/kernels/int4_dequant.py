"""The prefill W4A16 path: dequantize the whole weight into a scratch [N, K] in x's dtype with one Triton
pass, then one cuBLAS GEMM (F.linear) on it.

Large M is compute-bound: cuBLAS's bf16 GEMM on the dequantized weight does the same tensor-core work as
the bf16 model, and the extra traffic is one pass over the weight (0.5 byte read + 2 bytes written and
read back per weight for bf16), small beside the GEMM at M in the thousands. The scratch is freed after
the call (the caching allocator reuses it for the next layer).

The weight is int4_ref.dequantize rounded to x's dtype bit for bit (q * s - z * s is exact in fp32,
int4_tile.py), so the result equals int4_ref.w4a16_linear_ref up to cuBLAS's own summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepserve.kernels.int4_tile import RESHAPE_UNPACK, dequantize_tile, row_starts


@dataclass(frozen=True)
class Int4DequantConfig:
    block_n: int = 64
    block_k: int = 128  # a power of two >= 16, a multiple of pack
    num_warps: int = 4
    reshape_unpack: bool = RESHAPE_UNPACK


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                      group: int, g_idx: torch.Tensor | None, dtype: torch.dtype,
                      cfg: Int4DequantConfig = Int4DequantConfig(), tiled: bool = False) -> torch.Tensor:
    """Our layout (int4_ref.py; tiled: int4_mma_gemv.tile_words' and tile_scales', zeros unused) -> weight
    [N, K] in dtype: int4_ref.dequantize(...).to(dtype)."""
    n, k = qweight.shape[0], qweight.shape[1] * (32 // bits)
    w = torch.empty(n, k, dtype=dtype, device=qweight.device)
    if n == 0 or k == 0:
        return w
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(k, cfg.block_k))
    _dequantize_kernel[grid](
        qweight, scales, scales if tiled else zeros, w if g_idx is None else g_idx, w, n, k, qweight.stride(0),
        scales.stride(0), BITS=bits, GROUP=group, HAS_G_IDX=g_idx is not None, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0, RESHAPE=cfg.reshape_unpack, TILED=tiled,
        num_warps=cfg.num_warps,
    )
    return w


def w4a16_dequant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                         bits: int, group: int, g_idx: torch.Tensor | None, bias: torch.Tensor | None,
                         cfg: Int4DequantConfig, tiled: bool = False) -> torch.Tensor:
    """kernels/int4.w4a16_matmul's contract (inputs already checked there): dequantize, then cuBLAS."""
    w = dequantize_weight(qweight, scales, zeros, bits, group, g_idx, x.dtype, cfg, tiled)
    return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, z_ptr, g_ptr, w_ptr, N, K, stride_qn, stride_sn, BITS: tl.constexpr,
                       GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, RESHAPE: tl.constexpr, TILED: tl.constexpr):
    # Program (n tile, k tile) writes w[n, k] for its BLOCK_N x BLOCK_K block; rows past N wrap around
    # (modulo) for the loads and are masked at the store.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(1) * BLOCK_K
    offs_k = k_start + tl.arange(0, BLOCK_K)
    q_rows, s_rows, z_rows = row_starts((cols % N).to(tl.int64), K, stride_qn, stride_sn, GROUP, TILED)
    wt = dequantize_tile(q_ptr + q_rows, s_ptr + s_rows, z_ptr + z_rows, g_ptr, offs_k, k_start, K, BITS, GROUP,
                         HAS_G_IDX, BLOCK_K, BLOCK_N, EVEN_K, RESHAPE, TILED)
    ptrs = w_ptr + cols.to(tl.int64)[None, :] * K + offs_k[:, None]  # wt is [BLOCK_K, BLOCK_N]
    tl.store(ptrs, wt.to(w_ptr.dtype.element_ty), mask=(cols < N)[None, :] & (offs_k < K)[:, None])
