"""Build the model for a config and fill its weights (checkpoint or dummy)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import nn

from deepserve.config import ModelConfig
from deepserve.errors import ConfigRefused
from deepserve.layers.quantization import quantize_after_loading
from deepserve.loader.checkpoint import check_all_loaded, init_dummy_weights, iterate_safetensors
from deepserve.loader.encryption import read_key_file
from deepserve.loader.kv_scales import take_kv_scales
from deepserve.models.registry import get_model_class

logger = logging.getLogger(__name__)


def load_model(config: ModelConfig, device: torch.device, dtype: torch.dtype,
               enable_expert_parallel: bool = False) -> nn.Module:
    """The model of `config` on `device`, its weights loaded (or dummy). Options that are not the
    checkpoint's (expert parallelism, quantization) reach the model class as constructor arguments."""
    model_class = get_model_class(config.hf_config)
    options = dict(enable_expert_parallel=enable_expert_parallel, quantization=config.quantization)
    if device.type == "cpu":
        _check_host_memory(_build(model_class, config, torch.device("meta"), dtype, options), dtype)
    model = _build(model_class, config, device, dtype, options)
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    else:
        loaded = model.load_weights(take_kv_scales(model, checkpoint_tensors(config)))
        check_all_loaded(model, loaded | _tied(model))
    quantize_after_loading(model)  # --quantization fp8 on an unquantized checkpoint: per-channel FP8 now
    return model.eval()


def checkpoint_tensors(config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as the model's loaders take them, decrypted with the configured key (an
    encrypted checkpoint's every reader goes through here: the model, its MTP layer)."""
    key = read_key_file(config.decryption_key_file) if config.decryption_key_file else None
    return iterate_safetensors(config.model, key)


def _build(model_class: type[nn.Module], config: ModelConfig, device: torch.device, dtype: torch.dtype,
           options: dict) -> nn.Module:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return model_class(config.hf_config, **options)
    finally:
        torch.set_default_dtype(previous)


def _check_host_memory(meta_model: nn.Module, dtype: torch.dtype) -> None:
    """Refuse, with the numbers and what to change, a model that cannot fit in this machine's free memory
    (a refusal of the configuration: one line in the engine's log)."""
    need = sum(p.numel() * p.element_size() for p in meta_model.parameters())
    available = _available_host_bytes()
    if available is not None and need > 0.9 * available:
        raise ConfigRefused(
            f"the model's weights need {need / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')} and this "
            f"machine has {available / 2**30:.1f} GiB free; run it on a GPU (--device cuda), with a smaller "
            "dtype (--dtype bfloat16), or pick a smaller model"
        )


def _available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _tied(model: nn.Module) -> set[str]:
    """Parameter names that alias another (tied embeddings) and so load with it."""
    seen: dict[int, str] = {}
    aliases = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.setdefault(id(param), name)
    return aliases
