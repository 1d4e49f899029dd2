"""Per-head products of a few tokens: y[b, h, n] = sum_k x[b, h, k] * w[h, n, k], the two products around the
absorbed MLA decode (layers/mla.py): q_nope through W_UK into latent space, and the attended latents through
W_UV back to values.

Why: at one token these are 16-128 tiny GEMVs, and torch.bmm ran them as one cuBLAS launch of 3.4-3.5 µs each
on the H200 (V2-Lite AWQ decode profile: 54 a step, 186 µs; bench/RESULTS.md). Here a program holds one head's
[BLOCK_N, K] slice of w in registers and serves every token with it, H x N / BLOCK_N programs in all, each
reading its slice once, the result written in [B, H, N] order.

Numerics: bf16 / fp16 products summed in fp32 over the whole K, rounded once to x's dtype (a cuBLAS GEMM's
order of sums differs, so results agree to rounding, not bit for bit). The tests compare the kernel with
head_matmul_ref and with torch.bmm, the layer's path elsewhere (CPU, more tokens, larger weights).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepserve.kernels import pdl

# Where it beats torch.bmm (bench/head_matmul_probe.py on one H200, both products of a layer, weights from HBM;
# bench/RESULTS.md): V2-Lite (16 heads, 2 MB a product) at one token 4.86 against 6.41 µs, but at 2-8 tokens it
# lost (7.25-14.04 against 6.42-7.16: each token's sums wait on the one before); V3 (128 heads, 16 MB) even at one
# token (13.49 / 13.35) and far behind at more. So: one token, and weights no larger than the one size measured
# faster (sizes between 2 and 16 MB, e.g. V3's 32 heads a rank at tensor parallelism 4, were not timed).
MAX_TOKENS = 1
MAX_WEIGHT_BYTES = 2 << 20
# Elements of w a program holds: [BLOCK_N, K] with BLOCK_N = TILE_ELEMENTS / K (64 rows of K = 128, 16 of 512),
# 64 fp32 values a thread at 4 warps.
TILE_ELEMENTS = 8192


@triton.jit
def _head_matmul_kernel(x_ptr, w_ptr, y_ptr, tokens, N, K, stride_xb, stride_xh, stride_wh, stride_wn, stride_wk,
                        stride_yb, stride_yh, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr = False):
    # One program = (head h, output block n): w[h, n block, :] loaded once, then each token's row of x.
    pdl.trigger(PDL)  # a small launch: the next one may start now (kernels/pdl.py)
    h = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok, k_ok = offs_n < N, offs_k < K
    w = tl.load(w_ptr + h * stride_wh + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk,
                mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
    pdl.wait(PDL)  # the weights are a constant, asked for before the previous kernel has finished; x is not
    for b in range(tokens):
        x = tl.load(x_ptr + b * stride_xb + h * stride_xh + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        y = tl.sum(w * x[None, :], axis=1)
        tl.store(y_ptr + b * stride_yb + h * stride_yh + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def head_matmul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, H, K], w [H, N, K] -> [B, H, N] in x's dtype, summed in fp32."""
    return torch.einsum("bhk,hnk->bhn", x.float(), w.float()).to(x.dtype)


def head_matmul_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the layer gives x [B, H, K] and w [H, N, K] to the kernel: on CUDA, where it beats torch.bmm (at
    most MAX_TOKENS tokens and MAX_WEIGHT_BYTES of w) and within what it takes (_shapes_fit)."""
    return (x.is_cuda and w.is_cuda and x.dim() == 3 and x.shape[0] <= MAX_TOKENS
            and w.numel() * w.element_size() <= MAX_WEIGHT_BYTES and _shapes_fit(x, w))


def _shapes_fit(x: torch.Tensor, w: torch.Tensor) -> bool:
    # at least one token, 16-bit floats of one dtype, x's last axis contiguous (w any strides), K a power of two of
    # at most TILE_ELEMENTS / 16 (a program's tile holds the whole of K)
    return (x.dim() == 3 and w.dim() == 3 and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and x.shape[0] >= 1 and x.shape[1] == w.shape[0] and x.shape[2] == w.shape[2] and x.stride(2) == 1
            and w.shape[2] == triton.next_power_of_2(w.shape[2]) and w.shape[2] <= TILE_ELEMENTS // 16)


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y [B, H, N] contiguous = per head h, x[:, h] @ w[h]^T (x [B, H, K], w [H, N, K]). On CPU tensors the
    kernel runs only under Triton's interpreter (the tests)."""
    if not _shapes_fit(x, w):
        raise ValueError(f"head_matmul: x [B, H, K] (last axis contiguous) and w [H, N, K] of one 16-bit dtype, K a "
                         f"power of two <= {TILE_ELEMENTS // 16}; got {tuple(x.shape)} {x.dtype}, "
                         f"{tuple(w.shape)} {w.dtype}")
    tokens, heads, k = x.shape
    n = w.shape[1]
    y = torch.empty(tokens, heads, n, dtype=x.dtype, device=x.device)
    block_n = min(triton.next_power_of_2(n), TILE_ELEMENTS // k)
    on = pdl.wanted(x, tokens, mla_moe=True)
    _head_matmul_kernel[(heads, triton.cdiv(n, block_n))](
        x, w, y, tokens, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), y.stride(0),
        y.stride(1), BLOCK_N=block_n, BLOCK_K=k, PDL=on, num_warps=4, **pdl.launch_options(on))
    return y
