"""FP8 weights at decode sizes as a weight stream: x [M, K] (bf16 / fp16 / fp32, not quantized) times an
FP8 weight [N, K], the weight widened in registers and scaled by its block or channel factor.

Why (bench/RESULTS.md, FP8): at M <= 16 the W8A8 path (quantize the activations, fp8 tensor-core GEMM,
split-K sum) streamed 7B's qkv weight at 1.7-2.4 TB/s against bf16 cuBLAS's 3.6, so FP8 decode was no
faster than bf16 for half the bytes. A decode step is a weight stream: what matters is many programs each
reading long contiguous runs of the weight, and no extra launch for the activations.

Numerics: the product of x and the dequantized weight (fp8_ref.dequantize_weight_block / the per-channel
scale), accumulated in fp32; not the W8A8 reference (which also rounds the activations to fp8), so this
path is more exact than the one it replaces. Two ways to multiply, chosen by the config:
  "dot"  tl.dot over a row tile of 16 (rows past M read as zeros): the weight tile widened to x's dtype
         (bf16 / fp16; fp32 x multiplies in fp32) after its scale, tensor cores.
  "fma"  each of the M rows multiplied and summed across K on the CUDA cores (no tensor cores, no padding):
         for M of 1-4.
  "fma2d" one row (M = 1): the products accumulate elementwise in a [BLOCK_N, BLOCK_K] fp32 tile across the
         split's K tiles and are summed along K once, after the loop ("fma" sums every K tile across the
         threads that hold it); a block scale that is one number for the whole tile (BLOCK_N divides the
         scale block) multiplies the tile's inputs instead of every weight. Not timed on a GPU yet.
Triton's interpreter (CPU tests) gives wrong products for a bf16 tl.dot whose operand was widened from
fp8 (seen with triton 3.x: the same dot in fp32 is right), so there the dot runs in fp32; the H200 check
(bench/fp8_decode_graphs.py --gemv-s) covers the bf16 dot. Split-K: programs along K write fp32 partials,
added in order (+ bias) by the program that completes each tile (split_k.store_split) or, with
DEEPSERVE_SPLIT_K_FUSED_SUM=0, by split_k.sum_splits. Taken for one token by default (fp8.GEMV_MAX_M,
DEEPSERVE_FP8_GEMV_MAX_M = 1): timed per GEMM by bench/fp8_decode_graphs.py --gemv-s and in the engine
(W2 TPOT DeepSeek-LLM-7B -q fp8 3.39 ms, V3 8-layer slice 2.68 ms; bench/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepserve.kernels.fp8 import GEMV_BLOCK_K, INTERPRET
from deepserve.kernels.split_k import fused_sum, sm_count, store_split, sum_splits

NUMERICS = ("dot", "fma", "fma2d")


@dataclass(frozen=True)
class Fp8GemvConfig:
    block_n: int = 64  # output features per program
    block_k: int = GEMV_BLOCK_K  # a power of two dividing the weight's scale block along K (128 for DeepSeek)
    split_k: int = 0  # programs along K; 0: enough for about `waves` programs per SM
    numerics: str = "dot"
    num_warps: int = 4
    num_stages: int = 4
    waves: int = 4  # with split_k 0: programs per SM to aim for
    prefetch: bool = False  # load the next K tile before multiplying this one (see the kernel)


def default_gemv_config(m: int, n: int, k: int) -> Fp8GemvConfig:
    """The configs with the best geometric-mean time over the 7B and V3 shapes on the H200
    (bench/results/2026-12-01/fp8gemv1-e2bfcbb.json; its keys are numerics-block_n-block_k-waves-warps):
    one row on the CUDA cores with 128-wide N tiles, 4 waves (fma-128-128-4-4: 1.07x the per-shape best;
    the old guess, 32-wide, 1.19x), more rows on the tensor cores with 64-wide tiles and 2 waves
    (dot-64-128-2-4: 1.06x at M = 2, 1.05x at M = 4-16; fma-32 was 1.46x at M = 2). Against the W8A8 Triton
    path this config took 0.64-0.99x its time at M = 1 (every shape), 0.82-1.11x at M = 2 and up to 1.36x
    above, hence DEEPSERVE_FP8_GEMV_MAX_M = 1 (the default since the engine runs of 2026-12-02)."""
    if m == 1:
        return Fp8GemvConfig(numerics="fma", block_n=128, waves=4, num_warps=4)
    return Fp8GemvConfig(numerics="dot", block_n=64, waves=2, num_warps=4)


def gemv_splits(n: int, k: int, config: Fp8GemvConfig, num_sms: int) -> int:
    """Splits along K (whole block_k tiles each): config.split_k, or enough that the N tiles times the
    splits give about `waves` programs per SM, each split keeping at least 4 tiles of K."""
    k_tiles = triton.cdiv(k, config.block_k)
    if config.split_k:
        return max(1, min(config.split_k, k_tiles))
    tiles = triton.cdiv(n, config.block_n)
    want = triton.cdiv(config.waves * num_sms, tiles)
    return max(1, min(want, k_tiles // 4 or 1, 64))


def fp8_gemv(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
             bias: torch.Tensor | None = None, config: Fp8GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype. block (bn, bk): scale is the weight's scale_inv [ceil(N / bn),
    ceil(K / bk)]; block None: scale is per output channel [N]. M at most 16."""
    (n, k), m = w_q.shape, x.shape[0]
    _check(x, w_q, scale, block, bias, m)
    cfg = config or default_gemv_config(m, n, k)
    if cfg.numerics not in NUMERICS:
        raise ValueError(f"fp8 gemv: numerics must be one of {NUMERICS}, got {cfg.numerics!r}")
    group_n, group_k = block if block is not None else (1, 1)  # unread per channel: no compile per K
    if block is not None and group_k % cfg.block_k:
        raise ValueError(f"fp8 gemv: block_k {cfg.block_k} must divide the weight's scale block {group_k}")
    splits = gemv_splits(n, k, cfg, sm_count(x.device))
    k_tiles = triton.cdiv(k, cfg.block_k)
    tiles_per_split = triton.cdiv(k_tiles, splits)
    partials = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    if cfg.numerics == "fma2d" and m != 1:
        raise ValueError(f"fp8 gemv: numerics 'fma2d' takes one row, got {m}")
    block_m = 16 if cfg.numerics == "dot" else triton.next_power_of_2(m)
    scale2 = scale.view(-1, 1) if block is None else scale
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    locks, fused = fused_sum(x.device, triton.cdiv(n, cfg.block_n), partials)
    _fp8_gemv_kernel[(triton.cdiv(n, cfg.block_n), splits)](
        x, w_q, scale2, partials, out, out if bias is None else bias, locks,
        m, n, k, tiles_per_split, x.stride(0), w_q.stride(0),
        scale2.stride(0), scale2.stride(1), GROUP_N=group_n, GROUP_K=group_k, PER_CHANNEL=block is None,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT=cfg.numerics == "dot",
        FMA2D=cfg.numerics == "fma2d", TILE_SCALE=block is not None and group_n % cfg.block_n == 0,
        IEEE=x.dtype == torch.float32 or INTERPRET, EVEN_K=k % cfg.block_k == 0, PREFETCH=cfg.prefetch,
        HAS_BIAS=bias is not None, **fused, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if not fused["FUSED_SUM"]:
        sum_splits(partials, out, bias)
    return out


def _check(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
           bias: torch.Tensor | None, m: int) -> None:
    (n, k) = w_q.shape
    if not 1 <= m <= 16 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"fp8 gemv: x must be [M <= 16, {k}], got {tuple(x.shape)}")
    if x.stride(1) != 1 or w_q.stride(1) != 1:
        raise ValueError("fp8 gemv: x and the weight must be contiguous along K")
    want = (n,) if block is None else (triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
    if tuple(scale.shape) != want or scale.dtype != torch.float32:
        raise ValueError(f"fp8 gemv: the scale must be float32 {want}, got {scale.dtype} {tuple(scale.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"fp8 gemv: bias must be [{n}]")


# M changes every step: one compile serves every M up to the row tile.
@triton.jit(do_not_specialize=["M", "tiles_per_split"])
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, ws_ptr, out_ptr, bias_ptr, lock_ptr, M, N, K, tiles_per_split,
                     stride_xm, stride_wn, stride_sn, stride_sk, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                     PER_CHANNEL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
                     PREFETCH: tl.constexpr, HAS_BIAS: tl.constexpr, FUSED_SUM: tl.constexpr,
                     INTERPRETED: tl.constexpr, MAX_SPLITS: tl.constexpr, FMA2D: tl.constexpr,
                     TILE_SCALE: tl.constexpr):
    # Program (n tile, split): out[:, n tile] partial over its split's K tiles, into ws[split]; with
    # FUSED_SUM the tile's last program also writes out (split_k.store_split).
    # Columns past N wrap (modulo) so weight loads need no N mask; rows past M read x as zeros.
    # PREFETCH: the next K tile's weights are loaded before this tile is multiplied (Triton pipelines
    # loads that feed tl.dot; the fma path's are not, and a one-token GEMV is all weight loads). The
    # lookahead stays inside the split (its last step reloads its own last tile). Off by default.
    pid_n, split = tl.program_id(0), tl.program_id(1)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_m = tl.arange(0, BLOCK_M)
    k_tiles = tl.cdiv(K, BLOCK_K)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, k_tiles)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FMA2D:  # one row; the products summed along K once, after the loop (module docstring)
        tile_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        block_row = (pid_n * BLOCK_N // GROUP_N) * stride_sn  # TILE_SCALE: the tile's one scale row
        if PREFETCH:
            w = _load_weight_tile(w_rows, tl.minimum(first, k_tiles - 1), K, BLOCK_K, EVEN_K)
            for t in range(first, last):
                following = _load_weight_tile(w_rows, tl.minimum(t + 1, last - 1), K, BLOCK_K, EVEN_K)
                tile_acc = _fma2d_tile(tile_acc, w, t, x_ptr, s_ptr, offs_n, block_row, K, stride_sn, stride_sk,
                                       GROUP_N, GROUP_K, PER_CHANNEL, TILE_SCALE, BLOCK_K)
                w = following
        else:
            for t in range(first, last):
                w = _load_weight_tile(w_rows, t, K, BLOCK_K, EVEN_K)
                tile_acc = _fma2d_tile(tile_acc, w, t, x_ptr, s_ptr, offs_n, block_row, K, stride_sn, stride_sk,
                                       GROUP_N, GROUP_K, PER_CHANNEL, TILE_SCALE, BLOCK_K)
        acc += tl.sum(tile_acc, axis=1)[None, :]
    elif PREFETCH:
        w = _load_weight_tile(w_rows, tl.minimum(first, k_tiles - 1), K, BLOCK_K, EVEN_K)
        for t in range(first, last):
            following = _load_weight_tile(w_rows, tl.minimum(t + 1, last - 1), K, BLOCK_K, EVEN_K)
            acc = _gemv_tile(acc, w, t, x_ptr, s_ptr, offs_n, offs_m, M, K, stride_xm, stride_sn, stride_sk,
                             GROUP_N, GROUP_K, PER_CHANNEL, BLOCK_M, BLOCK_K, DOT, IEEE)
            w = following
    else:
        for t in range(first, last):
            w = _load_weight_tile(w_rows, t, K, BLOCK_K, EVEN_K)
            acc = _gemv_tile(acc, w, t, x_ptr, s_ptr, offs_n, offs_m, M, K, stride_xm, stride_sn, stride_sk,
                             GROUP_N, GROUP_K, PER_CHANNEL, BLOCK_M, BLOCK_K, DOT, IEEE)
    if PER_CHANNEL:  # constant along K: applied once
        acc = acc * tl.load(s_ptr + offs_n * stride_sn)[None, :]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    store_split(ws_ptr, out_ptr, bias_ptr, lock_ptr, acc, pid_n, offs_m, cols, split, tl.num_programs(1), M, N,
                HAS_BIAS, FUSED_SUM, INTERPRETED, MAX_SPLITS)


@triton.jit
def _fma2d_tile(tile_acc, w, t, x_ptr, s_ptr, offs_n, block_row, K, stride_sn, stride_sk, GROUP_N: tl.constexpr,
                GROUP_K: tl.constexpr, PER_CHANNEL: tl.constexpr, TILE_SCALE: tl.constexpr, BLOCK_K: tl.constexpr):
    """tile_acc [BLOCK_N, BLOCK_K] + K tile t's weights w [BLOCK_N, BLOCK_K] (fp8) times row 0 of x, elementwise."""
    ks = t * BLOCK_K + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
    wf = w.to(tl.float32)
    if PER_CHANNEL:  # applied once, after the loop
        return tile_acc + wf * x[None, :]
    k_block = (t * BLOCK_K // GROUP_K) * stride_sk
    if TILE_SCALE:  # one scale for the whole tile: it scales the tile's BLOCK_K inputs, not every weight
        return tile_acc + wf * (x * tl.load(s_ptr + block_row + k_block))[None, :]
    s = tl.load(s_ptr + (offs_n // GROUP_N) * stride_sn + k_block)
    return tile_acc + (wf * s[:, None]) * x[None, :]


@triton.jit
def _load_weight_tile(w_rows, t, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # [BLOCK_N, BLOCK_K] fp8 of K tile t; inputs past K read as 0
    ks = t * BLOCK_K + tl.arange(0, BLOCK_K)
    if EVEN_K:
        return tl.load(w_rows + ks[None, :])
    return tl.load(w_rows + ks[None, :], mask=(ks < K)[None, :], other=0.0)


@triton.jit
def _gemv_tile(acc, w, t, x_ptr, s_ptr, offs_n, offs_m, M, K, stride_xm, stride_sn, stride_sk,
               GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, PER_CHANNEL: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_K: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] + x[:, K tile t] times the tile's weights w [BLOCK_N, BLOCK_K] (fp8)."""
    ks = t * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    m_ok = offs_m < M
    wf = w.to(tl.float32)
    if not PER_CHANNEL:  # one scale per (row block, K block): BLOCK_K divides GROUP_K
        s = tl.load(s_ptr + (offs_n // GROUP_N) * stride_sn + (t * BLOCK_K // GROUP_K) * stride_sk)
        wf = wf * s[:, None]
    if DOT:
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
        x = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        if IEEE:  # fp32 activations (fp32 models), or the interpreter: an fp32 product, no tf32 rounding
            acc += tl.dot(x.to(tl.float32), tl.trans(wf), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(wf.to(x.dtype)), out_dtype=tl.float32)
    else:
        for r in tl.static_range(BLOCK_M):  # row r of x, read straight from memory (it stays in cache)
            row_ok = (ks * 0 + r) < M  # as a tensor: a mask must be one
            xr = tl.load(x_ptr + r * stride_xm + ks, mask=k_ok & row_ok, other=0.0).to(tl.float32)
            part = tl.sum(wf * xr[None, :], axis=1)  # [BLOCK_N]
            acc += tl.where(offs_m[:, None] == r, part[None, :], 0.0)
    return acc
