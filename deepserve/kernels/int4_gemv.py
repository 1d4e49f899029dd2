"""The decode W4A16 kernel: a split-K GEMV that streams the packed codes with no tensor cores and no
register relayout (kernels/int4.py's tile kernel feeds tl.dot, whose smallest row tile is 16 tokens).

Each program owns BLOCK_N output rows, one token, and one split of K. It loads the rows' packed int32
words as a [BLOCK_N, BLOCK_K / pack] tile (consecutive words of a row are consecutive in memory: our
layout, int4_ref.py, so every row reads whole cache lines), then for each of the `pack` bit fields
shifts the codes out and multiplies them by the token's inputs k = word * pack + field. Everything stays
in the one 2-D layout of the loaded tile; the tile is summed along K once, after the loop.

The M programs of one N tile are adjacent in the grid: they read the same weight tile at about the same
time, so HBM serves it once and L2 the rest (a GEMV per token costs M times the unpacking, which is why
it is meant for small M). Split-K partials are summed in order by fp8.py's second pass (deterministic).

Two numerics (a constexpr, FACTORED):
  exact     w = q * s - z * s per element (exact in fp32, int4_tile.py), rounded to x's dtype like
            int4_ref.w4a16_linear_ref, times x: the reference's weight exactly.
  factored  where a word lies in one group (no act order, groups a multiple of pack):
            sum_k x_k (q_k - z) s = s (sum_k x_k q_k - z sum_k x_k) per word, one fma per element instead of
            two and two conversions; the weight is not rounded to x's dtype, so the result differs from the
            reference by about bf16 rounding (tested within the bf16 tolerance). Elsewhere (act order,
            groups that split words) exact is used.
No wrapper reads a device value on the host: every call can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepserve.kernels.int4_tile import gemv_rows

PROGRAMS_PER_SM = 4  # enough resident programs per SM to keep loads in flight while others unpack


@dataclass(frozen=True)
class Int4GemvConfig:
    block_n: int = 32
    block_k: int = 256  # a power of two, a multiple of pack (and of the group where the group is 128)
    split_k: int = 0  # 0: chosen by gemv_split_count
    num_warps: int = 4
    num_stages: int = 3
    factored: bool = False


def gemv_split_count(m: int, n: int, k: int, cfg: Int4GemvConfig, num_sms: int) -> int:
    """Splits along K that bring the programs to about PROGRAMS_PER_SM per SM, rounded so every split
    gets the same number of K tiles (an empty split would still write its zero partial)."""
    k_tiles = triton.cdiv(k, cfg.block_k)
    programs = m * triton.cdiv(n, cfg.block_n)
    want = max(1, min(k_tiles, triton.cdiv(PROGRAMS_PER_SM * num_sms, programs)))
    return triton.cdiv(k_tiles, triton.cdiv(k_tiles, want))


def w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
               group: int, g_idx: torch.Tensor | None, bias: torch.Tensor | None, cfg: Int4GemvConfig,
               num_sms: int) -> torch.Tensor:
    """kernels/int4.w4a16_matmul's contract (inputs already checked there) through the GEMV kernel."""
    (m, k), n = x.shape, qweight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    pack = 32 // bits
    if cfg.block_k < 16 or cfg.block_k & (cfg.block_k - 1) or cfg.block_k % pack:
        raise ValueError(f"int4: gemv block_k {cfg.block_k} must be a power of two >= 16")
    split = cfg.split_k or gemv_split_count(m, n, k, cfg, num_sms)
    partial = split > 1
    c = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if partial else out
    grid = (m * triton.cdiv(n, cfg.block_n), split)
    _w4a16_gemv_kernel[grid](
        x, qweight, scales, zeros, out if g_idx is None else g_idx, c, out if bias is None else bias,
        m, n, k, split, x.stride(0), qweight.stride(0), scales.stride(0),
        BITS=bits, GROUP=group, HAS_G_IDX=g_idx is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, FACTORED=cfg.factored, PARTIAL=partial, HAS_BIAS=bias is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if partial:
        from deepserve.kernels.fp8 import _sum_splits  # here: fp8 imports fused_moe, which imports this module

        _sum_splits(c, out, bias)
    return out


# M changes every step: one compile serves all of them.
@triton.jit(do_not_specialize=["M", "split_k"])
def _w4a16_gemv_kernel(
    a_ptr, q_ptr, s_ptr, z_ptr, g_ptr, c_ptr, bias_ptr, M, N, K, split_k, stride_am, stride_qn, stride_sn,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FACTORED: tl.constexpr, PARTIAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    # c[row, n] = sum_k a[row, k] * w[n, k], w[n, k] = (code(n, k) - z[n, g]) * s[n, g], g = g_idx[k] or
    # k // GROUP. Rows past N wrap around (modulo) so every load is in bounds; the store masks them.
    pid = tl.program_id(0)
    row, pid_n = pid % M, pid // M
    split = tl.program_id(1)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, split_k)
    first, last = split * per_split, tl.minimum((split + 1) * per_split, k_tiles)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n64 = (cols % N).to(tl.int64)
    out = gemv_rows(a_ptr + row.to(tl.int64) * stride_am, q_ptr + n64 * stride_qn, s_ptr + n64 * stride_sn,
                    z_ptr + n64 * stride_sn, g_ptr, first, last, K, BITS, GROUP, HAS_G_IDX, BLOCK_N, BLOCK_K,
                    EVEN_K, FACTORED)
    ok = cols < N
    offsets = row.to(tl.int64) * N + cols
    if PARTIAL:
        tl.store(c_ptr + split.to(tl.int64) * M * N + offsets, out, mask=ok)
    else:
        if HAS_BIAS:
            out += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(c_ptr + offsets, out.to(c_ptr.dtype.element_ty), mask=ok)
