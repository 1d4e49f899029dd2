"""FP8 (float8_e4m3fn) numerics in plain torch: what every FP8 kernel must equal, and the CPU path.

Two weight formats, both W8A8 with activations quantized on the fly ("dynamic"):
  block-scaled  DeepSeek-V3/R1 as shipped: weight [N, K] fp8 with scale_inv [ceil(N/bn), ceil(K/bk)]
                float32, one factor per bn x bk tile (the real weight is fp8 * factor; despite its name
                the tensor multiplies). Activations take one scale per token and group of bk columns.
  per-channel   `--quantization fp8` on a bf16 checkpoint: weight [N, K] fp8 with scale [N] float32;
                activations take one scale per token (a group as wide as K).

Activation scale of a group: amax(|x|) / 448 (448 is e4m3's largest finite value), floored at
AMAX_FLOOR / 448 so an all-zero group divides by a positive number; x_q = clamp(x / scale) in e4m3.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# torch on CUDA divides by a Python scalar as a multiplication by its fp32 reciprocal
# (aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu), on CPU it divides: this file's `amax / FP8_MAX` differs
# by an ulp between the devices, and the kernels follow the device they run on with this (it rounds to the
# same fp32 as torch's 1.0f / 448.0f: 1/7 has no tie bits).
INV_FP8_MAX = 1.0 / FP8_MAX
AMAX_FLOOR = 1e-10


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_per_token_group_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q [M, K] fp8, scale [M, ceil(K/group)] float32) with x ~= x_q * scale per group;
    the last group may be partial."""
    m, k = x.shape
    groups = cdiv(k, group)
    padded = torch.zeros(m, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    tiles = padded.view(m, groups, group)
    scale = tiles.abs().amax(dim=-1).clamp(min=AMAX_FLOOR) / FP8_MAX  # [M, G]
    q = (tiles / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(m, groups * group)
    return q[:, :k].contiguous(), scale


def dequantize_per_token_group(x_q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """The inverse of quantize_per_token_group_ref, in float32."""
    k = x_q.shape[1]
    return x_q.float() * scale.repeat_interleave(group, dim=1)[:, :k]


def quantize_weight_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], scale_inv [ceil(N/bn), ceil(K/bk)] float32) as DeepSeek ships them."""
    (n, k), (bn, bk) = w.shape, block
    nb, kb = cdiv(n, bn), cdiv(k, bk)
    tiles = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    tiles[:n, :k] = w.float()
    tiles = tiles.view(nb, bn, kb, bk)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=AMAX_FLOOR) / FP8_MAX  # [nb, kb]
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(nb * bn, kb * bk)
    return q[:n, :k].contiguous(), scale


def dequantize_weight_block(w_q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w_q [N, K] fp8, scale_inv [ceil(N/bn), ceil(K/bk)] -> float32 [N, K]."""
    (n, k), (bn, bk) = w_q.shape, block
    expected = (cdiv(n, bn), cdiv(k, bk))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"weight of shape {(n, k)} needs a {expected} scale for {block} blocks, got {tuple(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return w_q.float() * scale


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], scale [N] float32): one factor per output channel."""
    scale = w.float().abs().amax(dim=1).clamp(min=AMAX_FLOOR) / FP8_MAX  # [N]
    return (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def block_fp8_linear_ref(x: torch.Tensor, w_q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype: activations quantized per token and bk-group, the weight
    dequantized per call, the product in float32."""
    x_q, x_scale = quantize_per_token_group_ref(x.reshape(-1, x.shape[-1]), block[1])
    a = dequantize_per_token_group(x_q, x_scale, block[1])
    out = a @ dequantize_weight_block(w_q, scale_inv, block).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], w_q.shape[0])


def channel_fp8_linear_ref(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype: activations quantized per token, weight per channel."""
    x2 = x.reshape(-1, x.shape[-1])
    x_q, x_scale = quantize_per_token_group_ref(x2, x2.shape[1])  # one group per token
    out = (x_q.float() @ w_q.float().T) * x_scale * scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], w_q.shape[0])
