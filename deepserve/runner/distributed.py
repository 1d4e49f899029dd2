"""Tensor-parallel group state. World size 1 is just a case: every helper works without init."""

from __future__ import annotations

import torch
import torch.distributed as dist


def get_tp_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def get_tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if get_tp_world_size() > 1:
        dist.all_reduce(x)
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    world = get_tp_world_size()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
