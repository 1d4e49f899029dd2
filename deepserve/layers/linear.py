"""Tensor-parallel linear layers. Each owns its shard and its one collective (DESIGN.md principle 7).

Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that copies its slice
of a full checkpoint tensor, so the checkpoint loader never needs to know about parallelism. The
tensor may be a `loader.checkpoint.LazyTensor`: the loaders only `narrow` / slice it before the copy,
so a rank reads just its slice from the file; a real tensor works the same.
Weights are stored as [out_features, in_features], like nn.Linear and the checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepserve.distributed.parallel_state import get_tp_rank, get_tp_world_size, tp_all_reduce


def _divide(n: int, world: int, what: str) -> int:
    if n % world:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({world})")
    return n // world


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


class ReplicatedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(nn.Module):
    """Splits the output features across ranks; the output stays sharded (no collective)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.out_per_rank = _divide(out_features, self.tp_size, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = loaded.narrow(0, self.tp_rank * self.out_per_rank, self.out_per_rank)
        default_weight_loader(param, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (gate_up_proj).

    Each rank holds its slice of every member, members side by side."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes), bias)
        self.member_sizes = [_divide(n, self.tp_size, "output features") for n in output_sizes]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            raise ValueError("a merged projection loads one member at a time (shard_id)")
        size = self.member_sizes[shard_id]
        offset = sum(self.member_sizes[:shard_id])
        default_weight_loader(param.data.narrow(0, offset, size), loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections in one matmul; heads are split across ranks (kv heads replicated
    when there are fewer kv heads than ranks)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        tp = get_tp_world_size()
        self.num_kv_heads_per_rank = max(1, num_kv_heads // tp)
        kv_total = self.num_kv_heads_per_rank * tp * head_dim
        super().__init__(hidden_size, [num_heads * head_dim, kv_total, kv_total], bias)
        self.kv_replicas = max(1, tp // num_kv_heads)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        index = {"q": 0, "k": 1, "v": 2}[shard_id]
        size = self.member_sizes[index]
        offset = sum(self.member_sizes[:index])
        rank = self.tp_rank if index == 0 else self.tp_rank // self.kv_replicas
        default_weight_loader(param.data.narrow(0, offset, size), loaded.narrow(0, rank * size, size))


class RowParallelLinear(nn.Module):
    """Splits the input features across ranks and all-reduces the partial outputs. reduce_results=False
    (vLLM's name) returns this rank's partial output instead, for a caller that adds other partial
    sums first and reduces them all at once (bias not allowed then: it must be added once, after)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce_results: bool = True
                 ) -> None:
        super().__init__()
        if bias and not reduce_results:
            raise ValueError("a RowParallelLinear with a bias must reduce its results")
        self.reduce_results = reduce_results
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.in_per_rank = _divide(in_features, self.tp_size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = default_weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, loaded.narrow(1, self.tp_rank * self.in_per_rank, self.in_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if not self.reduce_results:
            return out
        out = tp_all_reduce(out)
        # The bias is added once, after the sum, not once per rank.
        return out + self.bias if self.bias is not None else out
