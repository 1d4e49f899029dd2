"""Build the model for a config and fill its weights (checkpoint or dummy)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from deepserve.config import ModelConfig
from deepserve.loader.checkpoint import check_all_loaded, init_dummy_weights, iterate_safetensors
from deepserve.models.registry import get_model_class

logger = logging.getLogger(__name__)


def load_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    model_class = get_model_class(config.hf_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(config.hf_config)
    finally:
        torch.set_default_dtype(previous)
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    else:
        loaded = model.load_weights(iterate_safetensors(config.model))
        check_all_loaded(model, loaded | _tied(model))
    return model.eval()


def _tied(model: nn.Module) -> set[str]:
    """Parameter names that alias another (tied embeddings) and so load with it."""
    seen: dict[int, str] = {}
    aliases = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.setdefault(id(param), name)
    return aliases
