"""Architecture name (config.json "architectures") -> model class. A dict, nothing more."""

from __future__ import annotations

from typing import Any

from torch import nn

from deepserve.errors import ConfigRefused

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("deepserve.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("deepserve.models.qwen2", "Qwen2ForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepserve.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepserve.models.deepseek_v2", "DeepseekV3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(hf_config: Any) -> type[nn.Module]:
    import importlib

    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    # The checkpoint's own field: a refusal of the input (one line in the engine's log), not a bug.
    raise ConfigRefused(
        f"config.json's architectures {archs} are not supported; supported: {', '.join(supported_architectures())}"
    )
