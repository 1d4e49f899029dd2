"""Hand-written Triton kernels for the elementwise chains layers/fusion.py otherwise hands to torch.compile:
SiLU-and-mul, RMSNorm (with and without the residual add) and rotary embedding.

Why both exist: torch.compile traces each chain with dynamo at start-up (sympy shape reasoning, guards),
seconds of every start even with warm caches (bench/results/2026-12-01/startup1-e2bfcbb.txt), and its
SiLU-and-mul ran at about a third of HBM bandwidth in run 14's profiles (bench/RESULTS.md). These compile
once per shape class through Triton's own cache, with no dynamo. On by default since the H200 timed them
(bench/RESULTS.md, "Switches and step-tensor alignment"): 0.39-0.88x torch.compile's time per call at 256
and 4,096 tokens and for RMSNorm / rope at one token, equal for SiLU-and-mul at one token; W1 up;
DEEPSERVE_TRITON_ELEMENTWISE=0 gives torch.compile's versions (the layers pick, layers/fusion.py).

Numerics follow the compiled chains: the math in fp32 from the inputs as loaded, rounded once at the end,
except where the reference rounds on purpose (RMSNorm rounds the normalized value to the input dtype
before the weight, as layers/norm.py does; the residual sum is kept in the input dtype). The references
are the plain functions in layers/ (norm.py, activation.py, rotary.py), which CPU runs and tests compare.
Every wrapper is CUDA-graph safe (no host reads of device values).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepserve import envs
from deepserve.kernels import pdl

# Triton decides at decoration, when the module is imported; a launch must not reread the environment.
INTERPRET = envs.TRITON_INTERPRET
SILU_BLOCK = 1024  # output features per program: 2 KiB of bf16 per operand, 4 warps


def silu_and_mul(x: torch.Tensor, out_dtype: torch.dtype | None = None, tokens: int | None = None) -> torch.Tensor:
    """x [..., 2 * I] (gate then up) -> silu(gate) * up [..., I], in fp32 and rounded to out_dtype (x's).
    tokens: the step's tokens where a row is something else (a MoE's assignments), for kernels/pdl.py's rule."""
    _require(x.shape[-1] % 2 == 0 and x.stride(-1) == 1, "x must be [..., 2 * I] with a contiguous last axis")
    rows = x.reshape(-1, x.shape[-1])
    inner = x.shape[-1] // 2
    out = torch.empty(rows.shape[0], inner, dtype=out_dtype or x.dtype, device=x.device)
    if rows.shape[0]:
        on = pdl.wanted(x, rows.shape[0]) if tokens is None else pdl.wanted(x, tokens, mla_moe=True)
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inner, SILU_BLOCK))](
            rows, out, inner, rows.stride(0), out.stride(0), BLOCK=SILU_BLOCK, INTERPRET=INTERPRET, PDL=on,
            num_warps=4, **pdl.launch_options(on))
    return out.view(*x.shape[:-1], inner)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inner, stride_x, stride_o, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl.trigger(PDL)  # a small kernel: the next one may start now (kernels/pdl.py)
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inner
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inner + cols, mask=ok, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, _cast(y, out_ptr.dtype.element_ty, INTERPRET), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] -> weight * round(x * rsqrt(mean(x^2) + eps)) [..., H], in weight's and x's result dtype."""
    return _rms_norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the sum in x's dtype."""
    _require(residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x's shape and dtype")
    return _rms_norm(x, residual, weight, eps)


def _rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    _require(weight.shape == (hidden,) and x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1),
             "x [..., H] (contiguous last axis) and weight [H]")
    rows = x.reshape(-1, hidden)  # a view for every layout the models pass (rows of a wider tensor too)
    res = residual.reshape(-1, hidden) if residual is not None else None
    out = torch.empty(rows.shape, dtype=torch.result_type(weight, x), device=x.device)
    summed = torch.empty_like(rows, memory_format=torch.contiguous_format) if res is not None else None
    block = triton.next_power_of_2(hidden)
    if rows.shape[0]:
        on = pdl.wanted(x, rows.shape[0])
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res, weight, out, summed, hidden, rows.stride(0), res.stride(0) if res is not None else 0,
            out.stride(0), eps, BLOCK=block, INTERPRET=INTERPRET, PDL=on, num_warps=min(16, max(4, block // 512)),
            **pdl.launch_options(on))
    shape = x.shape
    return out.view(shape), summed.view(shape) if summed is not None else None


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, hidden, stride_x, stride_r, stride_o, eps,
                     BLOCK: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    pdl.trigger(PDL)  # a small kernel: the next one may start now (kernels/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    # The weight is loaded first, with x: written after the reduction, its load waited for it (a decode step's
    # norm is one row, so that load's latency was on the kernel's critical path). A constant: it may be asked
    # for before the previous kernel has finished.
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    pdl.wait(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if res_ptr is not None:  # the pre-norm block's residual add, kept (and returned) in x's dtype
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32))
        x = _cast(x, sum_ptr.dtype.element_ty, INTERPRET)
        tl.store(sum_ptr + row * hidden + cols, x, mask=ok)
    h = x.to(tl.float32)
    normed = h * tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
    normed = _cast(normed, x.dtype, INTERPRET).to(tl.float32)  # layers/norm.py rounds to x's dtype first
    tl.store(out_ptr + row * stride_o + cols, _cast(w * normed, out_ptr.dtype.element_ty, INTERPRET), mask=ok)


def apply_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int,
               interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """layers/rotary.py's _apply_rope: q [T, H, D], k [T, Hkv, D] -> new tensors with the first rotary_dim
    features of each head rotated by position (cos_sin [max_position, rotary_dim]: cos then sin, fp32);
    pairs are (i, i + rotary_dim / 2), or (2i, 2i + 1) when interleaved. The rest is copied."""
    _require(rotary_dim % 2 == 0 and rotary_dim <= q.shape[-1] and q.shape[-1] == k.shape[-1]
             and cos_sin.shape[-1] == rotary_dim and cos_sin.dtype == torch.float32,
             "rotary_dim must be even, at most head_dim, and cos_sin [P, rotary_dim] float32")
    return (_rope(positions, q, cos_sin, rotary_dim, interleaved),
            _rope(positions, k, cos_sin, rotary_dim, interleaved))


def _rope(positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int,
          interleaved: bool) -> torch.Tensor:
    tokens, heads, dim = x.shape
    _require(x.stride(-1) == 1 and positions.shape == (tokens,), "x [T, H, D] with a contiguous last axis")
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if tokens and heads:
        half = rotary_dim // 2
        rest = dim - rotary_dim
        _rope_kernel[(tokens, heads)](
            positions, x, cos_sin, out, x.stride(0), x.stride(1), cos_sin.stride(0), out.stride(0), out.stride(1),
            HALF=half, BLOCK_HALF=triton.next_power_of_2(half), REST=rest,
            BLOCK_REST=triton.next_power_of_2(rest) if rest else 1, INTERLEAVED=interleaved, INTERPRET=INTERPRET,
            num_warps=1)
    return out


@triton.jit
def _rope_kernel(pos_ptr, x_ptr, cs_ptr, out_ptr, stride_xt, stride_xh, stride_cs, stride_ot, stride_oh,
                 HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, REST: tl.constexpr, BLOCK_REST: tl.constexpr,
                 INTERLEAVED: tl.constexpr, INTERPRET: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    src, dst, _, _, _, _, _ = rotate_head(pos_ptr, cs_ptr, x_ptr, out_ptr, t, h, stride_xt, stride_xh, stride_ot,
                                          stride_oh, stride_cs, HALF, BLOCK_HALF, INTERLEAVED, INTERPRET)
    if REST > 0:  # the features past rotary_dim, unchanged
        r = tl.arange(0, BLOCK_REST)
        kept = tl.load(src + 2 * HALF + r, mask=r < REST, other=0.0)
        tl.store(dst + 2 * HALF + r, kept, mask=r < REST)


@triton.jit
def rotate_head(pos_ptr, cs_ptr, x_ptr, out_ptr, t, h, stride_xt, stride_xh, stride_ot, stride_oh, stride_cs,
                HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr, INTERPRET: tl.constexpr):
    """Token t's head h rotated by its position from x into out (layers/rotary.py's arithmetic in fp32, rounded
    to out's dtype): the HALF pairs (i, i + HALF), or (2i, 2i + 1) when INTERLEAVED; the features past them are
    the caller's. Returns (src, dst, first, second, y1, y2, ok): the head's rows, the pairs' offsets, the stored
    values and the pairs' mask. Shared by _rope_kernel and kernels/rope_kv_store.py (which also caches y1, y2)."""
    i = tl.arange(0, BLOCK_HALF)
    ok = i < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cs_ptr + pos * stride_cs + i, mask=ok, other=0.0)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + i, mask=ok, other=0.0)
    src = x_ptr + t * stride_xt + h * stride_xh
    dst = out_ptr + t * stride_ot + h * stride_oh
    if INTERLEAVED:  # pair i is features (2i, 2i + 1)
        first, second = 2 * i, 2 * i + 1
    else:  # pair i is features (i, i + HALF)
        first, second = i, i + HALF
    x1 = tl.load(src + first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + second, mask=ok, other=0.0).to(tl.float32)
    y1 = _cast(x1 * cos - x2 * sin, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(dst + first, y1, mask=ok)
    y2 = _cast(x2 * cos + x1 * sin, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(dst + second, y2, mask=ok)
    return src, dst, first, second, y1, y2, ok


@triton.jit
def _cast(v, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 v to DTYPE, rounding to nearest even as the GPU does. Interpreter only: its fp32 -> bf16 cast
    truncates, so round on the bf16 grid in fp32 first (then the cast is exact)."""
    if INTERPRET:
        if DTYPE == tl.bfloat16:
            bits = v.to(tl.int32, bitcast=True)
            v = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return v.to(DTYPE)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
