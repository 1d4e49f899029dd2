"""An FP8 KV cache's per-layer scales from the checkpoint.

Checkpoints quantized for an FP8 KV cache (vLLM's convention, e.g. llm-compressor / ModelOpt exports)
carry one float32 `k_scale` and `v_scale` per attention layer, named `model.layers.N.self_attn.k_scale`
(or `...self_attn.attn.k_scale`, `...self_attn.k_proj.k_scale`). They are not parameters of ours: each
layer's attention front keeps them as buffers, 1.0 by default (what vLLM assumes without them), and
reads them only when its cache is FP8. A checkpoint with them therefore also loads with
--kv-cache-dtype auto.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from deepserve.loader.checkpoint import materialize

_SCALE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|attn)\..*?\b([kv])_scale$")
_LAYER_OF_MODULE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def take_kv_scales(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` without the KV cache scales, which go into their layer's attention front instead
    (`load_kv_scale(which, value)`). Scales of layers this model does not hold (another pipeline
    stage's, DeepSeek's MTP layer) are dropped, as those layers' other tensors are."""
    fronts = _attention_fronts(model)
    for name, tensor in weights:
        found = _SCALE.search(name)
        if found is None:
            yield name, tensor
            continue
        front = fronts.get(int(found.group(1)))
        if front is not None:
            front.load_kv_scale(found.group(2), _one_value(name, tensor))


def _attention_fronts(model: nn.Module) -> dict[int, nn.Module]:
    """Decoder layer index -> the module that owns that layer's KV cache (it has `kv_cache_spec`)."""
    fronts = {}
    for name, module in model.named_modules():
        layer = _LAYER_OF_MODULE.search(name)
        if layer is not None and hasattr(module, "kv_cache_spec"):
            fronts[int(layer.group(1))] = module
    return fronts


def _one_value(name: str, tensor: torch.Tensor) -> float:
    value = materialize(tensor).float()
    if value.numel() != 1:
        raise ValueError(f"checkpoint tensor {name!r} has {value.numel()} values; the FP8 KV cache takes one "
                         "scale per layer (per-tensor k_scale / v_scale), not per head")
    scale = float(value.reshape(()))
    if not 0 < scale < math.inf:  # NaN fails both; inf would read every entry back as NaN (0 * inf)
        raise ValueError(f"checkpoint tensor {name!r} is {scale}; a KV cache scale must be positive and finite")
    return scale
