"""W4A16 (and W8A16) linear layers: int4 / int8 weights dequantized in registers, a GEMM in the
activations' dtype with fp32 accumulation. int4_ref.py fixes the numerics and the weight layout (and is
the CPU path); this file must equal it.

  w4a16_matmul  x [M, K] @ dequantized(qweight)^T -> [M, N]. Each program loads a BLOCK_K x BLOCK_N tile
                of packed int32 (one int32 holds `pack` consecutive inputs of one output row: the tile
                reads each word `pack` times, from L1), shifts and masks out the codes, subtracts the
                zero point and multiplies by the scale in fp32, rounds to x's dtype (as a model on the
                dequantized weights holds them) and feeds tl.dot. Scales and zero points are one row of
                BLOCK_N per k-step when a group holds whole k-steps (groups of 128, BLOCK_K <= 128),
                else gathered per input (g_idx under act order, odd group sizes).
  Decode (M <= 64) streams 0.5 byte per weight: narrow N tiles, and split-K when the tiles cannot fill
  the SMs (fp8.py's split-K: fp32 partials summed in order, deterministic).

Four variants, chosen by the config's type (choose_config picks one per M among the last three;
bench/check_int4.py --variants checks and times those three, bench/gemv_probe.py the first):
  Int4MmaGemvConfig  int4_mma_gemv.py: the tensor-core GEMV for 1-8 tokens on Hopper (4-bit, no act order,
                     groups and K multiples of 128), taken first up to DEEPSERVE_INT4_MMA_GEMV_MAX_M (8)
  Int4GemmConfig     the tile kernel below (tl.dot); the default below DEEPSERVE_INT4_CUBLAS_MIN_M
  Int4GemvConfig     int4_gemv.py: split-K GEMV without tensor cores, for decode; taken for
                     M <= DEEPSERVE_INT4_GEMV_MAX_M (1 by default: with its one-token tiles, W2 TPOT of
                     DeepSeek-LLM-7B AWQ 4.46 ms against the tile kernel's 6.21 on one H200; with the old
                     default tiles, n32 k256, at M <= 16 it made it worse, 7.98 against 6.19)
  Int4DequantConfig  int4_dequant.py: dequantize to a scratch weight, then cuBLAS, for prefill; taken for
                     M >= DEEPSERVE_INT4_CUBLAS_MIN_M (64 by default: W1 DeepSeek-LLM-7B AWQ 5,041 out
                     tok/s against 4,067 with the tile kernel, same H200)

A weight in int4_mma_gemv's tiled layout (tiled=True; layers keep it so on Hopper) is read by the tile kernel
and the dequantize pass through int4_tile.row_starts; the CUDA-core GEMV does not read it (the tile kernel
stands in where the tensor-core GEMV does not apply to a call, e.g. unaligned activations).

No wrapper reads a device value on the host, so every call can be captured in a CUDA graph.
Shapes: M tokens, N output features, K input features, G groups.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from deepserve import envs
from deepserve.kernels.fused_moe import _tile_ids
from deepserve.kernels.int4_dequant import Int4DequantConfig, w4a16_dequant_matmul
from deepserve.kernels.int4_gemv import Int4GemvConfig, default_gemv_config, w4a16_gemv
from deepserve.kernels.int4_mma_gemv import (
    TILE_ROWS,
    Int4MmaGemvConfig,
    mma_gemv_supported,
    require_supported,
    tiles_apply,
    w4a16_mma_gemv,
)
from deepserve.kernels.int4_tile import RESHAPE_UNPACK, dequantize_tile, row_starts
from deepserve.kernels.split_k import sm_count, split_count, store_tile, sum_splits

# Triton decides at decoration, when the module is imported; a launch must not reread the environment.
INTERPRET = envs.TRITON_INTERPRET
USE_SPLIT_K = True
# Which variant a call takes by token count M (module docstring); read once, at import.
GEMV_MAX_M = int(envs.DEEPSERVE_INT4_GEMV_MAX_M)
CUBLAS_MIN_M = int(envs.DEEPSERVE_INT4_CUBLAS_MIN_M)
MMA_GEMV_MAX_M = int(envs.DEEPSERVE_INT4_MMA_GEMV_MAX_M)


@dataclass(frozen=True)
class Int4GemmConfig:
    block_m: int
    block_n: int
    block_k: int  # a power of two >= 16 and a multiple of pack
    group_m: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    reshape_unpack: bool = RESHAPE_UNPACK  # how codes leave their words (kernels/int4_tile.py)


def default_config(m: int, n: int, k: int, num_sms: int = 132) -> Int4GemmConfig:
    """Tiles by token count, guessed for the H200 and to be set from bench/check_int4.py: decode is a
    weight stream (the smallest row tile, narrow N tiles, split-K where N alone cannot fill the SMs),
    prefill is compute-bound (128 x 128 tiles; the dequantization runs on the CUDA cores beside it)."""
    if m <= 64:
        cfg = Int4GemmConfig(max(16, triton.next_power_of_2(m)), 64, 128, 1, 4, 4)
    elif m <= 256:
        cfg = Int4GemmConfig(64, 128, 64, 8, 4, 4)
    else:
        cfg = Int4GemmConfig(128, 128, 64, 8, 8, 3)
    if not USE_SPLIT_K:
        return cfg
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    return replace(cfg, split_k=split_count(tiles, triton.cdiv(k, cfg.block_k), num_sms))


def choose_config(m: int, n: int, k: int, num_sms: int = 132, gemv_max_m: int | None = None,
                  cublas_min_m: int | None = None) -> Int4GemmConfig | Int4GemvConfig | Int4DequantConfig:
    """The variant and tiles for M tokens: the GEMV at M <= gemv_max_m, dequantize + cuBLAS at
    M >= cublas_min_m (0 switches either off; None: the DEEPSERVE_INT4_* settings), else the tile kernel."""
    gemv_max_m = GEMV_MAX_M if gemv_max_m is None else gemv_max_m
    cublas_min_m = CUBLAS_MIN_M if cublas_min_m is None else cublas_min_m
    if 0 < m <= gemv_max_m:
        return default_gemv_config(m)
    if 0 < cublas_min_m <= m:
        return Int4DequantConfig()
    return default_config(m, n, k, num_sms)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"int4: {message}")


def _check_inputs(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                  bits: int, group: int, g_idx: torch.Tensor | None, bias: torch.Tensor | None, tiled: bool) -> None:
    _require(bits in (4, 8), f"bits must be 4 or 8, got {bits}")
    pack = 32 // bits
    _require(x.dim() == 2 and x.stride(1) == 1, f"x must be [M, K] with a contiguous last dim, got {tuple(x.shape)}")
    _require(x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"unsupported dtype {x.dtype}")
    k, n = x.shape[1], qweight.shape[0]
    _require(qweight.dtype == torch.int32 and qweight.is_contiguous() and tuple(qweight.shape) == (n, k // pack)
             and k % pack == 0, f"qweight must be contiguous int32 [N, K/{pack}], got {tuple(qweight.shape)} for K {k}")
    if tiled:  # int4_mma_gemv.tile_words / tile_scales: zeros are in scales
        _require(tiles_apply(bits, group, g_idx, n, k), f"tiled weights need 4-bit codes, no g_idx, N a multiple of "
                 f"{TILE_ROWS}, K and the group multiples of 128, K whole groups; got {bits} bits, N {n}, K {k}, "
                 f"group {group}")
        _require(scales.dtype == torch.float16 and scales.is_contiguous()
                 and tuple(scales.shape) == (n // TILE_ROWS, k // group, 8, 4),
                 f"tiled scales must be contiguous fp16 [N / 16, G, 8, 4] (tile_scales), got {tuple(scales.shape)}")
    else:
        _require(zeros is not None and scales.dtype == zeros.dtype == torch.float16 and scales.shape == zeros.shape
                 and scales.shape[0] == n and scales.is_contiguous() and zeros.is_contiguous(),
                 "scales and zeros must be contiguous fp16 [N, G]")
    _require(g_idx is None or (g_idx.dtype == torch.int32 and tuple(g_idx.shape) == (k,)), "g_idx must be int32 [K]")
    _require(bias is None or (bias.shape == (n,) and bias.is_contiguous()), "bias must be contiguous [N]")
    tensors = [x, qweight, scales] + [t for t in (zeros, g_idx, bias) if t is not None]
    _require(len({t.device for t in tensors}) == 1, "all inputs must be on one device")


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 bits: int, group: int, g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 config: Int4GemmConfig | Int4GemvConfig | Int4DequantConfig | Int4MmaGemvConfig | None = None,
                 tiled: bool = False) -> torch.Tensor:
    """x [M, K], qweight int32 [N, K/pack], scales / zeros fp16 [N, G], g_idx int32 [K] or None (input k
    is in group k // group), bias [N] -> [M, N] in x's dtype: int4_ref.w4a16_linear_ref's numerics.
    tiled: qweight / scales are int4_mma_gemv.tile_words / tile_scales of those (zeros unused; the CUDA-core
    GEMV does not read them: the tile kernel stands in). config picks the variant (module docstring);
    None: choose_config's for M."""
    _check_inputs(x, qweight, scales, zeros, bits, group, g_idx, bias, tiled)
    (m, k), n = x.shape, qweight.shape[0]
    if config is None and m <= MMA_GEMV_MAX_M and mma_gemv_supported(x, bits, group, g_idx, k):
        return w4a16_mma_gemv(x, qweight, scales, zeros, group, bias, tiled=tiled)
    if isinstance(config, Int4MmaGemvConfig):  # asked for: checked here, once
        require_supported(x, bits, group, g_idx, k)
        return w4a16_mma_gemv(x, qweight, scales, zeros, group, bias, config, tiled)
    _require(not (tiled and isinstance(config, Int4GemvConfig)), "the CUDA-core GEMV (Int4GemvConfig) does not read "
             "the tiled layout; pass config=None or an Int4GemmConfig / Int4DequantConfig")
    cfg = config or choose_config(m, n, k, sm_count(x.device))
    if isinstance(cfg, Int4GemvConfig) and tiled:  # the dispatch's own choice at one token: the tile kernel
        cfg = default_config(m, n, k, sm_count(x.device))
    if isinstance(cfg, Int4GemvConfig):
        return w4a16_gemv(x, qweight, scales, zeros, bits, group, g_idx, bias, cfg, sm_count(x.device))
    if isinstance(cfg, Int4DequantConfig):
        return w4a16_dequant_matmul(x, qweight, scales, zeros, bits, group, g_idx, bias, cfg, tiled)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    pack = 32 // bits
    _require(cfg.block_k >= 16 and cfg.block_k & (cfg.block_k - 1) == 0 and cfg.block_k % pack == 0,
             f"block_k {cfg.block_k} must be a power of two >= 16")
    partial = cfg.split_k > 1
    c = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device) if partial else out
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.split_k)
    _w4a16_gemm_kernel[grid](
        x, qweight, scales, scales if tiled else zeros, out if g_idx is None else g_idx, c,
        out if bias is None else bias,
        m, n, k, cfg.split_k, x.stride(0), qweight.stride(0), scales.stride(0), n,
        BITS=bits, GROUP=group, HAS_G_IDX=g_idx is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=k % cfg.block_k == 0, RESHAPE=cfg.reshape_unpack,
        PARTIAL=partial, TILED=tiled,
        HAS_BIAS=bias is not None, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_UPCAST=x.dtype != torch.float32 and INTERPRET, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if partial:
        sum_splits(c, out, bias)
    return out


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 bits: int, group: int, g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 tiled: bool = False) -> torch.Tensor:
    """x [..., K] -> [..., N] (layers/int4.int4_linear's CUDA path)."""
    lead = x.shape[:-1]
    out = w4a16_matmul(x.reshape(-1, x.shape[-1]).contiguous(), qweight, scales, zeros, bits, group, g_idx, bias,
                       tiled=tiled)
    return out.view(*lead, qweight.shape[0])


# M changes every step: one compile serves all of them.
@triton.jit(do_not_specialize=["M", "split_k"])
def _w4a16_gemm_kernel(
    a_ptr, q_ptr, s_ptr, z_ptr, g_ptr, c_ptr, bias_ptr,
    M, N, K, split_k, stride_am, stride_qn, stride_sn, stride_cm,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
    RESHAPE: tl.constexpr, PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr, TILED: tl.constexpr,
):
    # c = a [M, K] @ w [N, K]^T with w[n, k] = (code(n, k) - z[n, g]) * s[n, g], g = g_idx[k] or k // GROUP.
    # Program (tile, split) sums split's share of the K tiles; rows and columns past M and N wrap around
    # (modulo) so every load is in bounds, and the store masks them.
    pid_m, pid_n = _tile_ids(tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    split = tl.program_id(1)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, split_k)
    first, last = split * per_split, tl.minimum((split + 1) * per_split, k_tiles)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    q_rows, s_rows, z_rows = row_starts(offs_n.to(tl.int64), K, stride_qn, stride_sn, GROUP, TILED)
    for t in range(first, last):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        a = _load_a(a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :], offs_k, K, EVEN_K)
        w = dequantize_tile(q_ptr + q_rows, s_ptr + s_rows, z_ptr + z_rows, g_ptr, offs_k, t * BLOCK_K, K, BITS,
                            GROUP, HAS_G_IDX, BLOCK_K, BLOCK_N, EVEN_K, RESHAPE, TILED)
        w = w.to(a_ptr.dtype.element_ty)  # the weight as a model on the dequantized weights holds it
        if DOT_UPCAST:  # the interpreter multiplies half types poorly; the values are the same
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc)
        else:
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    store_tile(c_ptr, bias_ptr, acc, pid_m, pid_n, split, M, N, stride_cm, BLOCK_M, BLOCK_N, PARTIAL, HAS_BIAS)


@triton.jit
def _load_a(ptrs, offs_k, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(offs_k < K)[None, :], other=0.0)
