from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepserve.layers.fusion import triton_on_cuda


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


@triton_on_cuda("silu_and_mul")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2 * I] (gate then up) -> [T, I]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
