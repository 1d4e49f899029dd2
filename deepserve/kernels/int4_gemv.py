"""The decode W4A16 kernel: a split-K GEMV that streams the packed codes with no tensor cores and no
register relayout (kernels/int4.py's tile kernel feeds tl.dot, whose smallest row tile is 16 tokens).

Each program owns BLOCK_N output rows, BLOCK_M tokens (1 by default) and one split of K. It loads the
rows' packed int32 words as a [BLOCK_N, BLOCK_K / pack] tile (consecutive words of a row are consecutive
in memory: our layout, int4_ref.py, so every row reads whole cache lines), then for each of the `pack`
bit fields shifts the codes out and multiplies them by the tokens' inputs k = word * pack + field
(int4_tile.gemv_rows; gemv_rows_block for BLOCK_M > 1). With one token everything stays in the one 2-D
layout of the loaded tile; the tile is summed along K once, after the loop.

The programs of one N tile (its token blocks) are adjacent in the grid: they read the same weight tile
at about the same time, so HBM serves it once and L2 the rest (each program unpacks the tile again,
which is why BLOCK_M > 1 exists and why the GEMV is meant for small M). Split-K partials are summed in
order in the kernel by the program that completes each tile (split_k.store_split), or by split_k.sum_splits
under DEEPSERVE_SPLIT_K_FUSED_SUM=0 (the same sum; deterministic either way).

Three numerics (constexprs FACTORED, MAGIC):
  exact     w = q * s - z * s per element (exact in fp32, int4_tile.py), rounded to x's dtype like
            int4_ref.w4a16_linear_ref, times x: the reference's weight exactly.
  factored  where a word lies in one group (no act order, groups a multiple of pack):
            sum_k x_k (q_k - z) s = s (sum_k x_k q_k - z sum_k x_k) per word: per element one fma after
            the code's unpacking instead of two and the rounding; the weight is not rounded to x's dtype,
            so the result differs from the reference by about bf16 rounding (tested within the bf16
            tolerance). Elsewhere (act order, groups that split words) exact is used.
  magic     factored, one token a program, 4-bit codes, bf16 / fp16 inputs: each code becomes the float
            2 + q / 64 by one byte permute (int4_tile._magic_tile, inline PTX: sm_90's SASS for a 64 x 128
            tile's loop is 311 instructions a thread against the factored loop's 455,
            bench/results/2026-12-03c/sass-loop-counts.txt). On by default (DEEPSERVE_INT4_GEMV_MAGIC):
            on one H200 the one-token GEMVs of a DeepSeek-LLM-7B step took 2,478 µs against 2,826
            (bench/gemv_probe.py, same machine); the int4 gate passed with it (LLM-7B AWQ W2 TPOT 3.50 ms;
            3.84 in the previous gate, another machine and tree). The expert GEMV (int4_moe_gemv.py) and
            several tokens a program do not take it.
Codes become floats through the fp32 mantissa (int4_tile._codes_to_float), not an int-to-float convert.
No wrapper reads a device value on the host: every call can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepserve import envs
from deepserve.kernels.int4_tile import gemv_rows, gemv_rows_block
from deepserve.kernels.split_k import fused_sum, store_split, store_tile, sum_splits

# Read once, at import (a launch must not reread the environment): the one-token GEMV's numerics.
FACTORED_ONE_TOKEN = envs.DEEPSERVE_INT4_GEMV_FACTORED
MAGIC_ONE_TOKEN = envs.DEEPSERVE_INT4_GEMV_MAGIC
PROGRAMS_PER_SM = 4  # enough resident programs per SM to keep loads in flight while others unpack


@dataclass(frozen=True)
class Int4GemvConfig:
    block_n: int = 32
    block_k: int = 256  # a power of two, a multiple of pack (and of the group where the group is 128)
    block_m: int = 1  # tokens per program (a power of two): > 1 unpacks each weight tile once for them all
    split_k: int = 0  # 0: chosen by gemv_split_count
    num_warps: int = 4
    num_stages: int = 3
    factored: bool = False
    magic: bool = False  # with factored, block_m 1: codes made floats by a byte permute (int4_tile._magic_tile)
    prefetch: bool = False  # load the next K tile before unpacking this one (int4_tile.gemv_rows; block_m 1 only)
    programs_per_sm: int = PROGRAMS_PER_SM  # with split_k 0: the split count aims at this many programs an SM


def default_gemv_config(m: int) -> Int4GemvConfig:
    """The GEMV's tiles by token count (taken only where DEEPSERVE_INT4_GEMV_MAX_M lets the GEMV run). One
    token: 64 rows x 128 inputs a program, about 8 programs an SM, prefetching. On the H200
    (bench/check_int4.py --variants --ms 1, bench/RESULTS.md) the tile shape and the program count did most
    of it: 7B gate_up 113 µs with the old default (n32 k256, 4 an SM), 53.7 with n64 k128, 49.2 at 8 an SM,
    48.4 with the prefetch; the factored numerics read 42.3 (DEEPSERVE_INT4_GEMV_FACTORED, on by default since
    an engine run: a 7B AWQ step 3.68 ms of graph replay against 4.18). More tokens: up
    to 16 a program on narrower tiles (the 3-D product holds block_m x block_n x block_k / pack fp32 values a
    program); prefetch applies to one token a program only."""
    if m <= 1:
        return Int4GemvConfig(block_n=64, block_k=128, prefetch=True, programs_per_sm=8,
                              factored=FACTORED_ONE_TOKEN, magic=FACTORED_ONE_TOKEN and MAGIC_ONE_TOKEN)
    return Int4GemvConfig(block_n=16, block_k=128, block_m=min(16, triton.next_power_of_2(m)))


def gemv_split_count(m: int, n: int, k: int, cfg: Int4GemvConfig, num_sms: int) -> int:
    """Splits along K that bring the programs to about cfg.programs_per_sm per SM, rounded so every split
    gets the same number of K tiles (an empty split would still write its zero partial)."""
    k_tiles = triton.cdiv(k, cfg.block_k)
    programs = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    want = max(1, min(k_tiles, triton.cdiv(cfg.programs_per_sm * num_sms, programs)))
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
    if cfg.block_m < 1 or cfg.block_m & (cfg.block_m - 1):
        raise ValueError(f"int4: gemv block_m {cfg.block_m} must be a power of two")
    split = cfg.split_k or gemv_split_count(m, n, k, cfg, num_sms)
    partial = split > 1
    c = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if partial else out
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    # one split: the kernel writes out itself; more: the partials are summed in the kernel or by sum_splits
    locks, fused = fused_sum(x.device, tiles, c, split=partial)
    _w4a16_gemv_kernel[(tiles, split)](
        x, qweight, scales, zeros, out if g_idx is None else g_idx, c, out, out if bias is None else bias,
        locks, m, n, k, split, x.stride(0), qweight.stride(0), scales.stride(0),
        BITS=bits, GROUP=group, HAS_G_IDX=g_idx is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, FACTORED=cfg.factored, MAGIC=cfg.magic, PREFETCH=cfg.prefetch, PARTIAL=partial,
        HAS_BIAS=bias is not None, **fused, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if partial and not fused["FUSED_SUM"]:
        sum_splits(c, out, bias)
    return out


# M changes every step: one compile serves all of them.
@triton.jit(do_not_specialize=["M", "split_k"])
def _w4a16_gemv_kernel(
    a_ptr, q_ptr, s_ptr, z_ptr, g_ptr, c_ptr, out_ptr, bias_ptr, lock_ptr, M, N, K, split_k, stride_am, stride_qn,
    stride_sn, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FACTORED: tl.constexpr,
    MAGIC: tl.constexpr, PREFETCH: tl.constexpr, PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr, FUSED_SUM: tl.constexpr,
    INTERPRETED: tl.constexpr, MAX_SPLITS: tl.constexpr,
):
    # c[row, n] = sum_k a[row, k] * w[n, k], w[n, k] = (code(n, k) - z[n, g]) * s[n, g], g = g_idx[k] or
    # k // GROUP. Rows past M and N wrap around (modulo) so every load is in bounds; the store masks them.
    pid = tl.program_id(0)
    m_blocks = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % m_blocks, pid // m_blocks
    split = tl.program_id(1)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, split_k)
    first, last = split * per_split, tl.minimum((split + 1) * per_split, k_tiles)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n64 = (cols % N).to(tl.int64)
    q_cols, s_cols, z_cols = q_ptr + n64 * stride_qn, s_ptr + n64 * stride_sn, z_ptr + n64 * stride_sn
    if BLOCK_M == 1:
        out = gemv_rows(a_ptr + pid_m.to(tl.int64) * stride_am, q_cols, s_cols, z_cols, g_ptr, first, last, K,
                        BITS, GROUP, HAS_G_IDX, BLOCK_N, BLOCK_K, EVEN_K, FACTORED, PREFETCH, MAGIC,
                        not INTERPRETED)[None, :]
    else:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        out = gemv_rows_block(a_ptr + (rows % M).to(tl.int64) * stride_am, q_cols, s_cols, z_cols, g_ptr, first,
                              last, K, BITS, GROUP, HAS_G_IDX, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, FACTORED)
    if FUSED_SUM:  # c is the workspace; the tile's last program writes out (split_k.store_split)
        store_split(c_ptr, out_ptr, bias_ptr, lock_ptr, out, pid, pid_m * BLOCK_M + tl.arange(0, BLOCK_M), cols,
                    split, split_k, M, N, HAS_BIAS, FUSED_SUM, INTERPRETED, MAX_SPLITS)
    else:  # c: the workspace when PARTIAL, else out [M, N]
        store_tile(c_ptr, bias_ptr, out, pid_m, pid_n, split, M, N, N, BLOCK_M, BLOCK_N, PARTIAL, HAS_BIAS)


def default_moe_gemv_config() -> Int4GemvConfig:
    """The expert GEMVs' tiles (kernels/int4_moe_gemv.py; taken up to DEEPSERVE_INT4_MOE_GEMV_MAX_TOKENS
    tokens, 0 by default): each program streams one expert's rows over the whole K (no split), so the grid is
    small at decode. The fastest exact config of the H200 variants at T = 1 and 2 (V2-Lite experts, µs):
    n16 k128 prefetching 54.7 and 71.5, against the fused MoE tiles' 55.7 and 78.1 and n32 k256 without the
    prefetch 64.6 and 102.9 (bench/RESULTS.md)."""
    return Int4GemvConfig(block_n=16, block_k=128, prefetch=True)
