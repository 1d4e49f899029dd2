"""Reading a checkpoint's config.json and deriving dtype and context length from it."""

from __future__ import annotations

import json
import os
from typing import Any

from deepserve.errors import ConfigRefused, FilesMissing

_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
           "half": "float16", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def load_hf_config(model: str, overrides: dict[str, Any] | None = None) -> Any:
    from transformers import AutoConfig

    if not os.path.isdir(model):
        raise FilesMissing(
            f"model {model!r} is not a local folder; deepserve loads Hugging Face checkpoints from disk "
            "(config.json + *.safetensors + tokenizer files)"
        )
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise ConfigRefused(f"model folder {model!r} has no config.json; --model takes a Hugging Face checkpoint "
                            "folder (config.json + *.safetensors + tokenizer files) or a preset name")
    _check_json(path)
    try:
        config = AutoConfig.from_pretrained(model, trust_remote_code=False)
    except ValueError as e:  # transformers' refusal: no model_type, a model_type it does not know
        raise ConfigRefused(f"{model}/config.json: {e}") from e
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    return config


def read_checkpoint_json(path: str) -> Any:
    """A checkpoint's JSON file (config.json, the weights' index), parsed; one that can't be read or parsed is
    refused naming the file and the spot (json's own message)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise ConfigRefused(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise ConfigRefused(f"{path} is not valid JSON: {e}") from None


def _check_json(path: str) -> None:
    """Refuse a config.json that is not a JSON object. Read here first: transformers reports such a file with
    an OSError (the type it uses for files it can't find), which is no refusal, so the engine logged it with a
    traceback."""
    data = read_checkpoint_json(path)
    if not isinstance(data, dict):
        raise ConfigRefused(f"{path} must hold a JSON object (the model's settings), not a {type(data).__name__}")


def resolve_dtype(dtype: str, hf_config: Any, device: str) -> str:
    """'auto' means the checkpoint's dtype on GPU and float32 on CPU (accurate, and fast on any CPU)."""
    if dtype == "auto":
        if device == "cpu":
            return "float32"
        config_dtype = str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "")
        config_dtype = config_dtype.removeprefix("torch.")
        return "float16" if config_dtype == "float16" else "bfloat16"
    if dtype not in _DTYPES:
        raise ConfigRefused(f"dtype must be one of auto, float32, bfloat16, float16; got {dtype!r}")
    return _DTYPES[dtype]


def resolve_max_model_len(hf_config: Any, requested: int | None) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or 4096
    if requested is None:
        return int(limit)
    if requested < 1:
        raise ConfigRefused(f"max_model_len must be >= 1, got {requested}")
    if requested > limit:
        raise ConfigRefused(
            f"max_model_len {requested} is longer than the model's max_position_embeddings ({limit}); "
            f"lower --max-model-len to at most {limit}"
        )
    return requested
