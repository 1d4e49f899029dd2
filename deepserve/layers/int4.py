"""Int4 (W4A16) storage of a linear layer or a stack of experts, and the matmul that reads it.

The parameters are named after the checkpoint's tensors (`qweight`, `qzeros`, `scales`, `g_idx`), so a
checkpoint name maps onto them like `weight` does, but hold our layout (kernels/int4_ref.py): each
parameter's weight_loader turns its slice of the checkpoint tensor into it (loader/int4.py).
Shapes for out features N and in features K of this rank, G groups (all of the checkpoint's groups when
they cannot be split with K: act order, or one group per row):
  qweight int32 [.., N, K / pack], scales and qzeros float16 [.., N, G], g_idx int32 [.., K] (act order only).
"""

from __future__ import annotations

import torch
from torch import nn

from deepserve import envs
from deepserve.kernels import int4_ref
from deepserve.layers.quantization import Int4Config


def keeps_all_groups(cfg: Int4Config, in_features: int, in_shards: int) -> bool:
    """Whether an input shard keeps every group's scales: act order scatters a group's inputs over the
    shards, and a group wider than a shard (group_size -1) belongs to all of them."""
    return in_shards > 1 and (cfg.desc_act or cfg.group_for(in_features) > in_features // in_shards)


def int4_parameters(cfg: Int4Config, lead: tuple[int, ...], out_features: int, in_features: int,
                    groups: int) -> dict[str, nn.Parameter]:
    """Empty parameters for `lead` (e.g. (experts,)) x out_features x in_features of this rank."""
    pack = int4_ref.pack_factor(cfg.bits)
    if in_features % pack:
        raise ValueError(f"{cfg.method}: {in_features} input features per rank are not a multiple of {pack} "
                         f"({cfg.bits}-bit codes pack {pack} inputs per int32)")
    shapes = {"qweight": ((*lead, out_features, in_features // pack), torch.int32),
              "scales": ((*lead, out_features, groups), torch.float16),
              "qzeros": ((*lead, out_features, groups), torch.float16)}
    if cfg.desc_act:
        shapes["g_idx"] = ((*lead, in_features), torch.int32)
    params = {}
    for name, (shape, dtype) in shapes.items():
        params[name] = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        params[name].quant_bits = cfg.bits  # dummy weights fill zero points at 2^(bits-1)
    return params


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                bits: int, group: int, g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                tiled: bool = False) -> torch.Tensor:
    """x [..., K] -> [..., N]: the Triton W4A16 kernel on CUDA, the reference elsewhere. `group`: inputs
    per group (input k reads group k // group of this rank's scales), unused with g_idx. tiled: the weight
    is in tiled_for_mma_gemv's layout (CUDA only)."""
    if x.is_cuda:
        from deepserve.kernels.int4 import w4a16_linear

        return w4a16_linear(x, qweight, scales, zeros, bits, group, g_idx, bias, tiled)
    return int4_ref.w4a16_linear_ref(x, qweight, scales, zeros, bits, group, g_idx, bias)


def tiles_for_mma_gemv(device: torch.device, dtype: torch.dtype, bits: int, group: int, g_idx: torch.Tensor | None,
                       n: int, k: int) -> bool:
    """Whether a loaded int4 weight of n x k on `device`, for activations of `dtype`, takes the tensor-core
    GEMV's tiled layout: a Hopper GPU, bf16 / fp16 activations (the GEMV's; fp32 ones would lose the CUDA-core
    GEMV, which does not read the layout), DEEPSERVE_INT4_TILED and DEEPSERVE_INT4_MMA_GEMV_MAX_M on, and a
    shape the GEMV takes whole."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or not envs.DEEPSERVE_INT4_TILED \
            or int(envs.DEEPSERVE_INT4_MMA_GEMV_MAX_M) <= 0:
        return False
    from deepserve.kernels import int4_mma_gemv

    return int4_mma_gemv.tiles_apply(bits, group, g_idx, n, k) and int4_mma_gemv._is_hopper(device)


def tiled_for_mma_gemv(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group: int,
                       g_idx: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(qweight, scales) in the tensor-core GEMV's tiled layout (kernels/int4_mma_gemv.tile_words /
    tile_scales, the zero points inside the scales tensor), or None where the row layout stays
    (tiles_for_mma_gemv; dtype: the activations')."""
    n, k = qweight.shape[0], qweight.shape[1] * int4_ref.pack_factor(bits)
    if not tiles_for_mma_gemv(qweight.device, dtype, bits, group, g_idx, n, k):
        return None
    from deepserve.kernels import int4_mma_gemv

    return int4_mma_gemv.tile_words(qweight), int4_mma_gemv.tile_scales(scales, zeros)
