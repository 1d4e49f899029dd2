"""Tensor- and pipeline-parallel group state. World size 1 is just a case: every helper works without init.

Ranks are laid out stage-major: rank = stage * tensor_parallel_size + tp_rank. Under tensor
parallelism alone the tensor-parallel group is the default group (no subgroup is made); under
pipeline parallelism every rank calls `init_model_parallel`, which makes one tensor-parallel
subgroup per stage (dist.new_group, the same calls in the same order on every rank) and records
this rank's stage. Pipeline stages exchange activations point to point on the default group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_TP_GROUP: Any = None  # None: the default group (world size 1, or tensor parallelism alone)
_TP_SIZE = 1
_PP_RANK = 0
_PP_SIZE = 1


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_model_parallel(tp: int, pp: int) -> None:
    """Make the per-stage tensor-parallel groups (collective over every rank) and record this rank's stage."""
    global _TP_GROUP, _TP_SIZE, _PP_RANK, _PP_SIZE
    if pp == 1:
        return  # tensor parallelism alone: the default group, as before
    rank = dist.get_rank()
    for stage in range(pp):
        group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
        if stage == rank // tp:
            _TP_GROUP = group
    _TP_SIZE, _PP_RANK, _PP_SIZE = tp, rank // tp, pp


def reset_model_parallel() -> None:
    global _TP_GROUP, _TP_SIZE, _PP_RANK, _PP_SIZE
    _TP_GROUP, _TP_SIZE, _PP_RANK, _PP_SIZE = None, 1, 0, 1


def get_tp_group() -> Any:
    return _TP_GROUP


def get_tp_world_size() -> int:
    if _TP_GROUP is not None:
        return _TP_SIZE
    return dist.get_world_size() if _initialized() else 1


def get_tp_rank() -> int:
    if _TP_GROUP is not None:
        return dist.get_rank() % _TP_SIZE
    return dist.get_rank() if _initialized() else 0


def get_pp_world_size() -> int:
    return _PP_SIZE


def get_pp_rank() -> int:
    return _PP_RANK


def is_first_stage() -> bool:
    return _PP_RANK == 0


def is_last_stage() -> bool:
    return _PP_RANK == _PP_SIZE - 1


def stage_layers(num_layers: int, stage: int | None = None, pp: int | None = None) -> tuple[int, int]:
    """[start, end) of the decoder layers `stage` owns: an even split, the larger shares last."""
    stage = _PP_RANK if stage is None else stage
    pp = _PP_SIZE if pp is None else pp
    if num_layers < pp:
        raise ValueError(f"num_hidden_layers ({num_layers}) must be >= pipeline_parallel_size ({pp})")
    return stage * num_layers // pp, (stage + 1) * num_layers // pp


def pp_send(x: torch.Tensor, dst_stage: int) -> None:
    """To the rank of the same tp_rank in stage `dst_stage`."""
    dist.send(x.contiguous(), dst_stage * _TP_SIZE + get_tp_rank())


def pp_recv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src_stage: int) -> torch.Tensor:
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, src_stage * _TP_SIZE + get_tp_rank())
    return x


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if get_tp_world_size() > 1:
        dist.all_reduce(x, group=_TP_GROUP)
    return x


def tp_broadcast_from_first(x: torch.Tensor) -> None:
    """x, in place on every rank of the tensor-parallel group, from the group's first rank."""
    if get_tp_world_size() > 1:
        src = dist.get_global_rank(_TP_GROUP, 0) if _TP_GROUP is not None else 0
        dist.broadcast(x, src=src, group=_TP_GROUP)


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    world = get_tp_world_size()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=-1)
