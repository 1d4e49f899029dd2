"""What one attention layer keeps in the paged KV cache per token: the runner sizes and allocates the
cache from it, the planner estimates from it, and the attention front reads its own layout back.

Two layouts exist (DESIGN.md principle 10): MHA/GQA keeps key and value planes, [2, blocks, block_size,
Hkv, D]; MLA one latent entry per token, [blocks, block_size, C + Dr]. The dtype is the model's or, under
--kv-cache-dtype fp8, float8_e4m3fn (one byte per value: twice the tokens per GiB); an FP8 cache's scales
are per layer (two float32 scalars) and live in the layer, not in the cache, so they cost no cache bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    entry_shape: tuple[int, ...]  # what one token keeps: (Hkv, D) per plane, or (C + Dr,)
    planes: int  # 2: separate key and value planes (MHA/GQA); 1: one entry (MLA's latent)
    dtype: torch.dtype

    @property
    def elements_per_token(self) -> int:
        return self.planes * prod(self.entry_shape)

    @property
    def bytes_per_token(self) -> int:
        return self.elements_per_token * torch.empty((), dtype=self.dtype).element_size()

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The layer's cache tensor: [2, blocks, block_size, *entry] or [blocks, block_size, *entry]."""
        planes = (self.planes,) if self.planes > 1 else ()
        return (*planes, num_blocks, block_size, *self.entry_shape)

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.shape(num_blocks, block_size), dtype=self.dtype, device=device)
