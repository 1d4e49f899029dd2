"""FP8 W8A8 linear layers: activations quantized per token and group on the fly, then a GEMM with fp32
accumulation. fp8_ref.py fixes the numerics (and is the CPU path); this file must equal it.

  quantize_per_token_group  x [M, K] -> x_q [M, K] fp8, scale [M, G] float32, G = ceil(K / group); Triton,
                            bit-exact with quantize_per_token_group_ref on the same device.
  block_fp8_matmul          DeepSeek-V3's block-scaled weights: each BLOCK_K slice of the dot product is
                            scaled by its activation and weight factors before it joins the fp32 sum.
                            Hopper's fp8 tensor cores accumulate a dot in reduced precision; a slice of at
                            most 128 before each fp32 promotion keeps that error small (as DeepSeek does).
  block_fp8_linear          x [..., K] bf16 -> quantize + block_fp8_matmul -> [..., N] in x's dtype; 1-16
                            tokens the GEMVs (fp8_mma_gemv, fp8_gemv), prefill sizes cuBLAS's block-wise
                            scaling where it is correct (cublas_blockwise_shape).
  channel_fp8_linear        per-channel weights: torch._scaled_mm with row-wise scales on CUDA.

No wrapper reads a device value on the host, so every call can be captured in a CUDA graph.
Shapes: M tokens, N output features, K input features, (bn, bk) the weight's scale block.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from deepserve import envs
from deepserve.kernels.fp8_mma_gemv import fp8_mma_gemv, mma_gemv_supported
from deepserve.kernels.fp8_ref import AMAX_FLOOR, FP8, FP8_MAX, INV_FP8_MAX, channel_fp8_linear_ref
from deepserve.kernels.fused_moe import _tile_ids  # the same grouped tile order as the MoE GEMMs
from deepserve.kernels.split_k import sm_count, split_count, store_tile, sum_splits

# Triton decides at decoration, when the module is imported; a launch must not reread the environment.
INTERPRET = envs.TRITON_INTERPRET
QUANT_ELEMENTS = 1024  # elements of one row per quantization program: 8 per thread, 16-byte loads of bf16
QUANT_MAX_CHUNK = 4096  # wider groups (one scale per token) are read in chunks of this, twice
USE_SPLIT_K = True  # split K when the output tiles cannot fill the GPU (decode); bench/check_fp8.py times both
CHANNEL_BK = 128  # K slice of the Triton per-channel fallback (its scales are constant along K)


@dataclass(frozen=True)
class Fp8GemmConfig:
    """One launch of the block-scaled GEMM."""

    block_m: int
    block_n: int
    block_k: int  # a power of two dividing the weight's bk: every tile sees one pair of scales
    group_m: int  # consecutive row tiles that take each weight tile in turn (read from L2 by all of them)
    num_warps: int
    num_stages: int
    split_k: int = 1  # > 1: programs along K write fp32 partials that a second kernel sums in order


def default_config(m: int, n: int, k: int, block: tuple[int, int], num_sms: int = 132) -> Fp8GemmConfig:
    """Tiles by token count, guessed for the H200 (132 SMs) and to be set from bench/check_fp8.py.

    Decode (M <= 64) streams the weight: the smallest row tile that holds M wastes the least, narrow N
    tiles give many programs, and split-K adds programs when N alone cannot fill the SMs (kv_a: N 576).
    Prefill is compute-bound: 128 x 128 tiles over two warpgroups (fp8 wgmma); BLOCK_N 256 would need a
    second 128-register accumulator per thread for the scaled partial dot and spill."""
    block_k = math.gcd(block[1], 128)
    if m <= 64:
        cfg = Fp8GemmConfig(max(16, triton.next_power_of_2(m)), 64, block_k, 1, 4, 4)
    elif m <= 256:
        cfg = Fp8GemmConfig(64, 128, block_k, 8, 4, 4)
    else:
        cfg = Fp8GemmConfig(128, 128, block_k, 8, 8, 4)
    if not USE_SPLIT_K:
        return cfg
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    return replace(cfg, split_k=split_count(tiles, triton.cdiv(k, block_k), num_sms))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"fp8: {message}")


# --- activation quantization -------------------------------------------------------------------------


def quantize_per_token_group(x: torch.Tensor, group: int,
                             cublas_layout: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (fp32/fp16/bf16, last dim contiguous) -> (x_q [M, K] fp8, scale [M, ceil(K/group)] fp32),
    x ~= x_q * scale per group of `group` columns, the last group possibly partial; group == K gives
    one scale per token. Equal to quantize_per_token_group_ref bit for bit.
    cublas_layout: what cuBLAS's block-wise scaling takes (torch._scaled_mm refuses M % 4 != 0 and wants the
    scales token-fastest): M rounded up to a multiple of 4, the added rows all zero codes (their scales
    AMAX_FLOOR / FP8_MAX), scale [M4, G] with strides (1, M4)."""
    _require(x.dim() == 2 and x.stride(1) == 1, f"x must be [M, K] with a contiguous last dim, got {tuple(x.shape)}")
    _require(x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"unsupported dtype {x.dtype}")
    _require(group > 0, f"group must be positive, got {group}")
    m, k = x.shape
    rows = _round_up(m, 4) if cublas_layout else m
    groups = triton.cdiv(k, group)
    x_q = torch.empty(rows, k, dtype=FP8, device=x.device)
    if cublas_layout:
        scale = torch.empty(groups, rows, dtype=torch.float32, device=x.device).t()
    else:
        scale = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows == 0 or k == 0:
        return x_q, scale
    block_c = min(triton.next_power_of_2(group), QUANT_MAX_CHUNK)
    per_program = max(1, min(triton.next_power_of_2(groups), QUANT_ELEMENTS // block_c))
    _quantize_group_kernel[(rows, triton.cdiv(groups, per_program))](
        x, x_q, scale, m, k, groups, x.stride(0), rows,
        GROUP=group, GROUPS_PER_PROGRAM=per_program, BLOCK_C=block_c, NUM_CHUNKS=triton.cdiv(group, block_c),
        PAD_ROWS=rows != m, TOKEN_MAJOR=cublas_layout, SCALE_BY_RECIPROCAL=x.is_cuda, ROUND_IN_FP32=INTERPRET,
        FP8_MAX=FP8_MAX, INV_FP8_MAX=INV_FP8_MAX, AMAX_FLOOR=AMAX_FLOOR, num_warps=4,
    )
    return x_q, scale


# M and the token-major scales' row count change with every prefill: one compile serves them all.
@triton.jit(do_not_specialize=["M", "scale_rows"])
def _quantize_group_kernel(x_ptr, q_ptr, scale_ptr, M, K, num_groups, stride_xm, scale_rows,
                           GROUP: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr, BLOCK_C: tl.constexpr,
                           NUM_CHUNKS: tl.constexpr, PAD_ROWS: tl.constexpr, TOKEN_MAJOR: tl.constexpr,
                           SCALE_BY_RECIPROCAL: tl.constexpr,
                           ROUND_IN_FP32: tl.constexpr, FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr,
                           AMAX_FLOOR: tl.constexpr):
    # One program: GROUPS_PER_PROGRAM groups of one row, each read in NUM_CHUNKS chunks of BLOCK_C columns
    # (one chunk for DeepSeek's 128-wide groups; one-scale-per-token groups take several, read twice).
    # PAD_ROWS: rows from M on read as zeros (the padding of cublas_layout). TOKEN_MAJOR: scale [G, scale_rows]
    # (cublas_layout), else [M, G].
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)  # [P]
    x_row, q_row = x_ptr + row * stride_xm, q_ptr + row * K
    if NUM_CHUNKS == 1:
        cols, ok = _chunk(groups, 0, K, GROUP, BLOCK_C)
        x = tl.load(x_row + cols, mask=_live(ok, cols, row, M, K, PAD_ROWS), other=0.0).to(tl.float32)  # [P, C]
        scale = _group_scale(tl.max(tl.abs(x), axis=1), SCALE_BY_RECIPROCAL, FP8_MAX, INV_FP8_MAX, AMAX_FLOOR)
        tl.store(q_row + cols, _to_fp8(x, scale, FP8_MAX, ROUND_IN_FP32), mask=ok)
    else:
        amax = tl.zeros([GROUPS_PER_PROGRAM], dtype=tl.float32)
        for c in tl.static_range(NUM_CHUNKS):
            cols, ok = _chunk(groups, c, K, GROUP, BLOCK_C)
            x = tl.load(x_row + cols, mask=_live(ok, cols, row, M, K, PAD_ROWS), other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        scale = _group_scale(amax, SCALE_BY_RECIPROCAL, FP8_MAX, INV_FP8_MAX, AMAX_FLOOR)
        for c in tl.static_range(NUM_CHUNKS):
            cols, ok = _chunk(groups, c, K, GROUP, BLOCK_C)
            x = tl.load(x_row + cols, mask=_live(ok, cols, row, M, K, PAD_ROWS), other=0.0).to(tl.float32)
            tl.store(q_row + cols, _to_fp8(x, scale, FP8_MAX, ROUND_IN_FP32), mask=ok)
    if TOKEN_MAJOR:
        tl.store(scale_ptr + groups * scale_rows + row, scale, mask=groups < num_groups)
    else:
        tl.store(scale_ptr + row * num_groups + groups, scale, mask=groups < num_groups)


@triton.jit
def _live(ok, cols, row, M, K, PAD_ROWS: tl.constexpr):
    # The load mask: ok, and with PAD_ROWS nothing in rows from M on (they quantize zeros).
    mask = ok
    if PAD_ROWS:
        mask = ok & (cols < tl.where(row < M, K, 0))
    return mask


@triton.jit
def _chunk(groups, c, K, GROUP: tl.constexpr, BLOCK_C: tl.constexpr):
    # Columns [P, C] of chunk c of each group, and which of them exist: inside the group (BLOCK_C may
    # overhang a group that is not a power of two) and inside the row (the last group may be partial).
    offs = c * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    cols = groups[:, None] * GROUP + offs
    return cols, (offs < GROUP) & (cols < K)


@triton.jit
def _group_scale(amax, SCALE_BY_RECIPROCAL: tl.constexpr, FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr,
                 AMAX_FLOOR: tl.constexpr):
    amax = tl.maximum(amax, AMAX_FLOOR)
    if SCALE_BY_RECIPROCAL:
        return amax * INV_FP8_MAX
    return tl.math.div_rn(amax, FP8_MAX)


@triton.jit
def _to_fp8(x, scale, FP8_MAX: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    # div_rn: Triton's `/` is an approximate division for fp32; torch divides exactly. The GPU converts
    # with round-to-nearest-even (cvt.rn.satfinite), as torch does.
    v = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX)
    if ROUND_IN_FP32:
        v = _round_to_e4m3(v)
    return v.to(tl.float8e4nv)


@triton.jit
def _round_to_e4m3(v):
    # Interpreter only: its fp32 -> fp8 conversion rounds half up and loses the carry into the exponent
    # (124.3 -> 64), but converts representable values exactly. So round here, to nearest even: normal
    # e4m3 (|v| >= 2^-6) keeps 3 of fp32's 23 mantissa bits; subnormals are multiples of 2^-9, which
    # adding and removing 1.5 * 2^14 (whose ulp is 2^-9) rounds to. The sign is kept apart (-0 stays -0).
    bits = v.to(tl.int32, bitcast=True)
    sign = bits & -2147483648  # 0x80000000
    mag = bits & 0x7FFFFFFF
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & -1048576  # 0xFFF00000: drop 20 bits, ties to even
    a = mag.to(tl.float32, bitcast=True)
    subnormal = ((a + 24576.0) - 24576.0).to(tl.int32, bitcast=True)
    return (tl.where(a < 0.015625, subnormal, normal) | sign).to(tl.float32, bitcast=True)


# --- block-scaled GEMM ------------------------------------------------------------------------------


def block_fp8_matmul(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor,
                     block: tuple[int, int], out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                     config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """x_q [M, K] fp8, x_scale [M, ceil(K/bk)] fp32, w_q [N, K] fp8 (row-major, as checkpoints store it),
    w_scale_inv [ceil(N/bn), ceil(K/bk)] fp32, bias [N] or None -> [M, N] in out_dtype:
        out[m, n] = sum_g (x_q[m, g] . w_q[n, g]) * x_scale[m, g] * w_scale_inv[n // bn, g]  (+ bias[n])
    with g the bk-column groups, in fp32. Scales may be broadcast views (stride 0)."""
    _check_gemm_inputs(x_q, x_scale, w_q, w_scale_inv, block, bias)
    (m, k), n = x_q.shape, w_q.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return out
    cfg = config or default_config(m, n, k, block, sm_count(x_q.device))
    _require(block[1] % cfg.block_k == 0 and cfg.block_k & (cfg.block_k - 1) == 0 and cfg.block_k >= 16,
             f"block_k {cfg.block_k} must be a power of two >= 16 dividing bk {block[1]}")
    partial = cfg.split_k > 1
    c = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x_q.device) if partial else out
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.split_k)
    _block_fp8_gemm_kernel[grid](
        x_q, w_q, c, x_scale, w_scale_inv, out if bias is None else bias,
        m, n, k, cfg.split_k, x_q.stride(0), w_q.stride(0), n,
        x_scale.stride(0), x_scale.stride(1), w_scale_inv.stride(0), w_scale_inv.stride(1),
        GROUP_N=block[0], GROUP_K=block[1], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, EVEN_K=k % cfg.block_k == 0, PARTIAL=partial, HAS_BIAS=bias is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if partial:
        sum_splits(c, out, bias)
    return out


def _check_gemm_inputs(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor,
                       block: tuple[int, int], bias: torch.Tensor | None) -> None:
    _require(x_q.dim() == 2 and w_q.dim() == 2 and x_q.shape[1] == w_q.shape[1],
             f"x_q [M, K] and w_q [N, K] do not match: {tuple(x_q.shape)}, {tuple(w_q.shape)}")
    _require(x_q.dtype == FP8 and w_q.dtype == FP8, f"x_q and w_q must be {FP8}, got {x_q.dtype}, {w_q.dtype}")
    _require(x_q.stride(1) == 1 and w_q.stride(1) == 1, "x_q and w_q need a contiguous last dim")
    (m, k), n, (bn, bk) = x_q.shape, w_q.shape[0], block
    _require(bk % 16 == 0, f"the scale block's K side must be a multiple of 16, got {block}")
    groups = triton.cdiv(k, bk)
    _require(tuple(x_scale.shape) == (m, groups), f"x_scale must be {(m, groups)}, got {tuple(x_scale.shape)}")
    want = (triton.cdiv(n, bn), groups)
    _require(tuple(w_scale_inv.shape) == want, f"w_scale_inv must be {want} for {block} blocks, "
             f"got {tuple(w_scale_inv.shape)}")
    _require(x_scale.dtype == torch.float32 and w_scale_inv.dtype == torch.float32, "scales must be float32")
    _require(bias is None or (bias.shape == (n,) and bias.is_contiguous()), "bias must be contiguous [N]")
    tensors = [x_q, x_scale, w_q, w_scale_inv] + ([bias] if bias is not None else [])
    _require(len({t.device for t in tensors}) == 1, "all inputs must be on one device")


# M changes every step and the scale strides with every shape: one compile serves all of them (their
# loads are a few bytes a tile; the operand strides stay specialized, for vector loads).
@triton.jit(do_not_specialize=["M", "split_k", "stride_asm", "stride_asg", "stride_bsn", "stride_bsg"])
def _block_fp8_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr,
    M, N, K, split_k, stride_am, stride_bn, stride_cm, stride_asm, stride_asg, stride_bsn, stride_bsg,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PARTIAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    # c = a [M, K] @ b [N, K]^T, each BLOCK_K slice scaled by a_scale[m, g] * b_scale[n // GROUP_N, g],
    # g = k // GROUP_K. Program (tile, split) sums split's share of the K tiles. Rows and columns past M
    # and N wrap around (modulo), so every load is in bounds and unmasked along them; the store masks.
    pid_m, pid_n = _tile_ids(tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    split = tl.program_id(1)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, split_k)
    first, last = split * per_split, tl.minimum((split + 1) * per_split, k_tiles)  # may be empty: stores zeros
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + (first * BLOCK_K + offs_k)[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + (first * BLOCK_K + offs_k)[:, None]
    a_scales = a_scale_ptr + offs_m * stride_asm  # [BLOCK_M]
    # The weight's scale is one number per tile when its N block holds whole tiles (DeepSeek: 128 / 128).
    SCALAR_B_SCALE: tl.constexpr = GROUP_N % BLOCK_N == 0
    if SCALAR_B_SCALE:
        b_scales = b_scale_ptr + (pid_n * BLOCK_N // GROUP_N) * stride_bsn
    else:
        b_scales = b_scale_ptr + (offs_n // GROUP_N) * stride_bsn  # [BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(first, last):
        if EVEN_K:
            a, b = tl.load(a_ptrs), tl.load(b_ptrs)
        else:
            k_ok = offs_k < K - t * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        g = t * BLOCK_K // GROUP_K
        a_s = tl.load(a_scales + g * stride_asg)  # [BLOCK_M]
        b_s = tl.load(b_scales + g * stride_bsg)  # scalar or [BLOCK_N]
        if SCALAR_B_SCALE:
            acc += tl.dot(a, b) * (a_s * b_s)[:, None]
        else:
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    store_tile(c_ptr, bias_ptr, acc, pid_m, pid_n, split, M, N, stride_cm, BLOCK_M, BLOCK_N, PARTIAL, HAS_BIAS)


# --- linear layers ----------------------------------------------------------------------------------


# Which GEMM a call takes, by token count M (measured on the H200, bench/RESULTS.md, FP8): one token takes
# the weight-stream GEMV (GEMV_MAX_M below), other decode batches (CUDA graphs, M <= max_num_seqs) the
# Triton kernels — torch._scaled_mm row-wise took 24.7 us for V3's kv_a at M = 1 in a graph where the
# per-channel Triton path took 14.1 — and per-channel prefill-sized calls cuBLAS's row-wise
# torch._scaled_mm (1,360 TFLOP/s at 8192^3 against Triton's 893).
# Block-scaled prefill-sized calls take cuBLAS's block-wise scaling (torch._scaled_mm) on the shapes it
# computes correctly (cublas_blockwise_shape): on the H200, GEMM alone 1,309 TFLOP/s at 8192^3 against the
# Triton kernel's 891, 1,085 with the activation quantization (bench/RESULTS.md, 2026-12-04); V3 8-layer
# slice W1 and TPOT unchanged. DEEPSERVE_FP8_CUBLAS_BLOCKWISE=0 keeps them on Triton.
CUBLAS_MIN_M = int(envs.DEEPSERVE_FP8_CUBLAS_MIN_M)
CUBLAS_BLOCKWISE = envs.DEEPSERVE_FP8_CUBLAS_BLOCKWISE
# Decode sizes as a weight stream, activations unquantized (fp8_gemv.py); 1 by default (bench/RESULTS.md:
# faster than W8A8 at one token on every shape, W2 TPOT LLM-7B -q fp8 3.39 ms with it), 0: off.
GEMV_MAX_M = min(16, int(envs.DEEPSERVE_FP8_GEMV_MAX_M))
GEMV_BLOCK_K = 128  # fp8_gemv's K tile, which must divide a block-scaled weight's K block
# Up to this many tokens the tensor-core GEMV (fp8_mma_gemv.py) goes first where it applies (Hopper, bf16 /
# fp16, K a multiple of 128); 8 by default (bench/RESULTS.md, sixth session of 2026-12-03: 18-30 % less
# time than the W8A8 path at 2-8 tokens on LLM-7B's shapes, 12 % less than fp8_gemv at one token on V3's).
MMA_GEMV_MAX_M = min(8, int(envs.DEEPSERVE_FP8_MMA_GEMV_MAX_M))


def _mma_gemv(x2: torch.Tensor, w_q: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether x2 [M, K] takes fp8_mma_gemv: M within MMA_GEMV_MAX_M and what the kernel needs
    (mma_gemv_supported: a Hopper GPU, bf16 / fp16, aligned rows, K a multiple of 128, fitting blocks)."""
    return 0 < x2.shape[0] <= MMA_GEMV_MAX_M and mma_gemv_supported(x2, w_q, block)


def _gemv(x2: torch.Tensor, block_k: int | None = None) -> bool:
    """Whether x2 [M, K] takes fp8_gemv: M within GEMV_MAX_M (off at 0, an empty x included), rows contiguous,
    and a block-scaled weight's K block (block_k; None per channel) a multiple of its K tile (other blocks,
    e.g. 96, take the W8A8 path)."""
    fits = block_k is None or block_k % GEMV_BLOCK_K == 0
    return 0 < x2.shape[0] <= GEMV_MAX_M and x2.stride(1) == 1 and fits


def activations_unquantized(x2: torch.Tensor, w_q: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether a linear call on x2 [M, K] takes one of the GEMVs, which do not round the activations to e4m3
    (what a check compares it with; block None: per-channel weights, on CUDA)."""
    return _mma_gemv(x2, w_q, block) or _gemv(x2, None if block is None else block[1])


def block_fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: block_fp8_linear_ref's contract, activations quantized
    per token and bk-group by quantize_per_token_group; up to MMA_GEMV_MAX_M tokens fp8_mma_gemv's where it
    applies (_mma_gemv), up to GEMV_MAX_M (_gemv) fp8_gemv's, activations not quantized on both."""
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if _mma_gemv(x2, w_q, block):
        return fp8_mma_gemv(x2, w_q, w_scale_inv, block, bias).view(*x.shape[:-1], w_q.shape[0])
    if _gemv(x2, block[1]):
        from deepserve.kernels.fp8_gemv import fp8_gemv

        return fp8_gemv(x2, w_q, w_scale_inv, block, bias).view(*x.shape[:-1], w_q.shape[0])
    if _cublas_blockwise(x2, w_q, w_scale_inv, block):
        x_q, x_scale = quantize_per_token_group(x2, block[1], cublas_layout=True)
        out = torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale_inv.t(), out_dtype=x.dtype)
        out = out[: x2.shape[0]]  # without quantize's padding rows
        out = out + bias.to(out.dtype) if bias is not None else out
    else:
        x_q, x_scale = quantize_per_token_group(x2, block[1])
        out = block_fp8_matmul(x_q, x_scale, w_q, w_scale_inv, block, x.dtype, bias)
    return out.view(*x.shape[:-1], w_q.shape[0])


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _cublas_blockwise(x2: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor,
                      block: tuple[int, int]) -> bool:
    """torch._scaled_mm with DeepSeek's 1 x 128 / 128 x 128 scaling for this call: switched on, a shape
    cuBLAS computes correctly (cublas_blockwise_shape), on CUDA outside graph capture, and a torch that has
    it (probed once)."""
    if not CUBLAS_BLOCKWISE or not cublas_blockwise_shape(x2.shape[0], *w_q.shape, block, x2.dtype,
                                                          w_scale_inv.is_contiguous()):
        return False
    if not x2.is_cuda or torch.cuda.is_current_stream_capturing():
        return False
    return _blockwise_supported(x2.device)


def cublas_blockwise_shape(m: int, n: int, k: int, block: tuple[int, int], dtype: torch.dtype,
                           scales_contiguous: bool) -> bool:
    """Whether block_fp8_linear hands x [M, K] @ w [N, K]^T to cuBLAS's block-wise scaling: prefill-sized M
    (>= CUBLAS_MIN_M), 128 x 128 blocks, bf16, contiguous weight scales, N % 16 and K % 512. On the H200
    (torch 2.11, CUDA 13.0; bench/cublas_blockwise_probe.py, bench/RESULTS.md) it refused M % 4 != 0
    (quantize's cublas_layout pads M), refused scale tensors with padded strides, and returned wrong products
    without an error whenever K / 128 was not a multiple of 4 (K = 384, 1,408, 1,664, 11,008)."""
    return (m >= CUBLAS_MIN_M and tuple(block) == (128, 128) and dtype == torch.bfloat16 and scales_contiguous
            and n % 16 == 0 and k % 512 == 0)


@functools.cache
def _blockwise_supported(device: torch.device) -> bool:
    """Whether this torch / cuBLAS computes block-wise scaled products correctly, checked once on the device:
    the shape rule above was found on one build, and the failures it avoids raised no error."""
    import logging

    try:
        error = _blockwise_self_check(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        logging.getLogger(__name__).info("torch._scaled_mm has no block-wise FP8 scaling here (%s); "
                                         "FP8 prefill GEMMs stay on Triton", exc)
        return False
    if not error <= 1e-2:  # NaN included
        logging.getLogger(__name__).warning(
            "torch._scaled_mm's block-wise FP8 scaling gave a wrong product in its self-check (max relative error "
            "%.3g); FP8 prefill GEMMs stay on Triton", error)
        return False
    return True


def _blockwise_self_check(device: torch.device) -> float:
    """Max relative error of block_fp8_linear's cuBLAS call on an allowed shape (M 260, padded; N 272; K 512)
    whose every activation group and weight block has its own magnitude, against the float32 product of the
    dequantized operands."""
    from deepserve.kernels import fp8_ref

    gen = torch.Generator(device=device).manual_seed(0)

    def blocks(rows: int, cols: int, block_rows: int) -> torch.Tensor:  # random values, magnitudes per block
        scale = torch.rand(-(-rows // block_rows), cols // 128, generator=gen, device=device) * 10
        scale = scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(128, 1)
        return torch.randn(rows, cols, generator=gen, device=device) * scale

    w_q, w_s = fp8_ref.quantize_weight_block(blocks(272, 512, 128), (128, 128))
    x_q, x_s = quantize_per_token_group(blocks(260, 512, 1).bfloat16(), 128, cublas_layout=True)
    out = torch._scaled_mm(x_q, w_q.t(), scale_a=x_s, scale_b=w_s.t(), out_dtype=torch.bfloat16)[:260].float()
    want = fp8_ref.dequantize_per_token_group(x_q[:260], x_s[:260].contiguous(), 128) @ \
        fp8_ref.dequantize_weight_block(w_q, w_s, (128, 128)).t()
    return ((out - want).abs().max() / want.abs().max()).item()


def channel_fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], w_q [N, K] fp8, w_scale [N] fp32 -> [..., N] in x's dtype: channel_fp8_linear_ref's
    contract (one activation scale per token). CUDA: torch._scaled_mm with row-wise scales for
    prefill-sized M where it takes the shapes (bf16 x, K and N multiples of 16), channel_fp8_triton
    elsewhere (CUBLAS_MIN_M). CPU: the reference."""
    if not x.is_cuda:
        return channel_fp8_linear_ref(x, w_q, w_scale, bias)
    return channel_fp8_cuda(x, w_q, w_scale, bias)


def channel_fp8_cuda(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """channel_fp8_linear's GPU choice (also what the interpreter tests run)."""
    (n, k), x2 = w_q.shape, x.reshape(-1, x.shape[-1])  # x2 [M, K]
    if _mma_gemv(x2, w_q, None):
        return fp8_mma_gemv(x2, w_q, w_scale.float(), None, bias).view(*x.shape[:-1], n)
    if _gemv(x2):
        from deepserve.kernels.fp8_gemv import fp8_gemv

        return fp8_gemv(x2, w_q, w_scale.float(), None, bias).view(*x.shape[:-1], n)
    if x.dtype == torch.bfloat16 and k % 16 == 0 and n % 16 == 0 and x2.shape[0] >= CUBLAS_MIN_M:
        x_q, x_scale = quantize_per_token_group(x2, k)  # [M, K], [M, 1]
        out = torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale.float().view(1, n),
                               bias=None if bias is None else bias.to(x.dtype), out_dtype=x.dtype)
    else:
        out = channel_fp8_triton(x2, w_q, w_scale, bias)
    return out.view(*x.shape[:-1], n)


def channel_fp8_triton(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype, as channel_fp8_linear, by the block kernel: the per-token scale
    and the per-channel scale become broadcast views (stride 0 along K) over CHANNEL_BK-wide groups of
    one weight row each."""
    (n, k), m = w_q.shape, x.shape[0]
    x_q, x_scale = quantize_per_token_group(x, k)  # [M, K], [M, 1]
    groups = triton.cdiv(k, CHANNEL_BK)
    return block_fp8_matmul(x_q, x_scale.expand(m, groups), w_q, w_scale.float().view(n, 1).expand(n, groups),
                            (1, CHANNEL_BK), x.dtype, bias)
