"""Checkpoint loading: safetensors shards (with or without their index) and dummy weights.

Each parameter's `weight_loader` takes the full checkpoint tensor and copies its own slice
(tensor parallelism, merged q/k/v and gate/up), so this file knows nothing about layouts.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn

logger = logging.getLogger(__name__)


def checkpoint_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(model_path) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(
            f"no *.safetensors weights in {model_path}; convert the checkpoint to safetensors, "
            "or pass load_format='dummy' (--load-format dummy) for random weights"
        )
    return [os.path.join(model_path, n) for n in names]


def iterate_safetensors(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_path):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name)


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params: dict[str, tuple[str, object]],
    skip_suffixes: tuple[str, ...] = (),
) -> set[str]:
    """Copy checkpoint tensors into `model`; returns the parameter names loaded.

    `stacked_params` maps a checkpoint name fragment (q_proj) to our merged parameter's fragment
    and its shard id (qkv_proj, "q"). Unknown checkpoint tensors are an error, not a silent skip."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.endswith(skip_suffixes):
            continue
        target, shard_id = name, None
        for fragment, (merged, sid) in stacked_params.items():
            if f".{fragment}." in name:
                target, shard_id = name.replace(f".{fragment}.", f".{merged}."), sid
                break
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
        loader = param.weight_loader
        with torch.no_grad():
            loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)
        loaded.add(target)
    return loaded


def check_all_loaded(model: nn.Module, loaded: set[str]) -> None:
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")


def init_dummy_weights(model: nn.Module, seed: int, scale: float = 1e-2) -> None:
    """Random weights from the config alone (benchmarks): small uniform values, norms at 1.

    Drawn on the parameters' own device, so a 7B model fills in a second on a GPU."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.fill_(1.0)
                continue
            gen = generators.setdefault(param.device, torch.Generator(device=param.device).manual_seed(seed))
            if param.dtype.is_floating_point and param.element_size() >= 2:
                param.uniform_(-scale, scale, generator=gen)
            else:  # fp8 and integer storage: fill through a wider type
                param.copy_(torch.empty(param.shape, device=param.device).uniform_(-scale, scale, generator=gen))
