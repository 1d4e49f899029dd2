"""Int4 (and int8) weight-only numerics in plain torch (W4A16): what the Triton kernels must equal, and
the CPU path. Also the unpacking of the two checkpoint formats into our one layout.

Our layout (every int4 layer and expert holds this, whatever the checkpoint's format):
  qweight  int32 [N, K / pack]   each int32 holds `pack` = 32 / bits consecutive input features of one
                                 output row, feature k at bits (k % pack) * bits (nn.Linear's [out, in]
                                 with the inputs packed, so a row's slice is its columns' slice)
  scales   float16 [N, G]         one factor per output row and group of input features
  zeros    float16 [N, G]         the group's zero point as an integer value (exact in fp16)
  g_idx    int32 [K] or None      the group of each input feature (GPTQ desc_act); None: k // group_size
  weight[n, k] = (q[n, k] - zeros[n, g(k)]) * scales[n, g(k)], computed in fp32.

The checkpoint formats (facts of AutoAWQ's GEMM export and AutoGPTQ / GPTQModel's):
  AWQ   qweight int32 [K, N / 8] packed along the OUTPUT dim, the 8 columns of an int32 in the order
        0 2 4 6 1 3 5 7 (bits 4 i hold column AWQ_ORDER[i]); qzeros int32 [K / g, N / 8] the same way,
        the zero point stored as is; scales fp16 [K / g, N].
  GPTQ  qweight int32 [K / pack, N] packed along the INPUT dim in order; qzeros int32 [K / g, N / pack]
        packed along the output dim in order, the zero point stored minus one (checkpoint_format "gptq",
        the "v1" convention; "gptq_v2" stores it as is); scales fp16 [K / g, N]; g_idx int32 [K].
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # bits 4 i of an AWQ int32 hold column AWQ_ORDER[i]
SUPPORTED_BITS = (4, 8)


def pack_factor(bits: int) -> int:
    return 32 // bits


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] packed along the last dim in order -> int32 [R, C * pack], values in [0, 2^bits)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)  # [pack]
    values = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)  # [R, C, pack]
    return values.reshape(*packed.shape[:-1], -1)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int [R, C] with values in [0, 2^bits) -> int32 [R, C / pack] packed along the last dim in order."""
    pack = pack_factor(bits)
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, pack)  # [R, C/pack, pack]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    word = (v << shifts).sum(dim=-1)  # < 2^32: the bit fields do not overlap
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # the same 32 bits, signed


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AWQ int32 [R, C] (4-bit, interleaved) -> int32 [R, 8 C] in natural column order."""
    fields = unpack_rows(packed, 4).view(*packed.shape, 8)  # field i holds column AWQ_ORDER[i]
    natural = torch.empty_like(fields)
    natural[..., list(AWQ_ORDER)] = fields
    return natural.view(*packed.shape[:-1], -1)


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """int [R, 8 C] in natural column order -> AWQ int32 [R, C] (interleaved): awq_unpack's inverse."""
    grouped = values.reshape(*values.shape[:-1], -1, 8)
    return pack_rows(grouped[..., list(AWQ_ORDER)].reshape(values.shape), 4)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int,
               g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Our layout -> float32 weight [N, K]. group_size is the checkpoint's (ignored where g_idx is given)."""
    q = unpack_rows(qweight, bits).float()  # [N, K]
    k = q.shape[1]
    groups = g_idx.long() if g_idx is not None else torch.arange(k, device=q.device) // group_size  # [K]
    return (q - zeros.float()[:, groups]) * scales.float()[:, groups]


def w4a16_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     bits: int, group_size: int, g_idx: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: the weight dequantized in fp32, rounded to x's dtype (what a
    model on the dequantized weights holds), then a plain matmul. The kernels must equal this."""
    w = dequantize(qweight, scales, zeros, bits, group_size, g_idx).to(x.dtype)  # [N, K]
    return torch.nn.functional.linear(x, w, bias)
