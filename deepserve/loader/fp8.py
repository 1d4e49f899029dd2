"""DeepSeek's FP8 checkpoints (V3, R1, V3.1) and their multi-token-prediction layers.

The linear weights ship as float8_e4m3fn, each with a float32 `<name>_scale_inv` that holds one
factor per 128×128 block (the config's quantization_config.weight_block_size): the real weight is
fp8 · factor, block by block — despite its name the tensor multiplies. Layers built FP8
(layers/quantization.py) take both tensors as shipped; the rest (MLA's wkv_b, or every layer when the
engine runs without FP8: --quantization none, which a GPU without FP8 tensor cores needs) are dequantized to
float32 here and each parameter's weight_loader casts to the compute dtype.

MTP layers (indices >= num_hidden_layers, num_nextn_predict_layers of them) serve speculative
decoding, which the engine does not do yet: their tensors are skipped, and the log says so once.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from deepserve.errors import ConfigRefused
from deepserve.kernels.fp8_ref import dequantize_weight_block

logger = logging.getLogger(__name__)

SCALE_SUFFIX = "_scale_inv"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def fp8_block_size(hf_config: Any) -> tuple[int, int] | None:
    """The weight block of an FP8 block-scaled checkpoint; None for an unquantized one."""
    quant = getattr(hf_config, "quantization_config", None)
    if not quant:
        return None
    if not isinstance(quant, dict):
        quant = quant.to_dict()
    from deepserve.loader.int4 import checkpoint_method

    if checkpoint_method(hf_config) != "fp8":  # int4 (loader/int4.py); anything else is refused there
        return None
    block = quant.get("weight_block_size")
    if not block or len(block) != 2:
        raise ConfigRefused(
            f"config.json quantization_config.weight_block_size is {block!r}; only block-scaled FP8 "
            "(e.g. [128, 128]) is supported"
        )
    # Absent fields take DeepSeek's values. A static scheme ships input scales this engine would not apply
    # (it scales activations per token group on the fly); e5m2 codes would be read as e4m3.
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigRefused(f"config.json quantization_config.activation_scheme is {scheme!r}; only 'dynamic' "
                            "(activation scales computed per token group at run time) is supported")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigRefused(f"config.json quantization_config.fmt is {fmt!r}; only 'e4m3' (float8_e4m3fn) "
                            "is supported")
    return int(block[0]), int(block[1])


def dequantize_fp8_weights(weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int],
                           keep: Callable[[str], bool] = lambda name: False) -> Iterator[tuple[str, torch.Tensor]]:
    """Pairs every fp8 `<name>` with its `<name>_scale_inv`, in whatever order (or shard) they come,
    and yields the dequantized float32 tensor under `<name>`; everything else passes through, and so do
    the fp8 weights and scales of every `<name>` for which keep(name) is true (served in FP8)."""
    weights_by_name: dict[str, torch.Tensor] = {}
    scales_by_name: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        is_fp8 = name.endswith(SCALE_SUFFIX) or tensor.dtype == torch.float8_e4m3fn
        if is_fp8 and keep(name.removesuffix(SCALE_SUFFIX)):
            yield name, tensor
        elif name.endswith(SCALE_SUFFIX):
            target = name.removesuffix(SCALE_SUFFIX)
            if target in weights_by_name:
                yield target, dequantize_weight_block(weights_by_name.pop(target), tensor, block)
            else:
                scales_by_name[target] = tensor
        elif tensor.dtype == torch.float8_e4m3fn:
            if name in scales_by_name:
                yield name, dequantize_weight_block(tensor, scales_by_name.pop(name), block)
            else:
                weights_by_name[name] = tensor
        else:
            yield name, tensor
    unpaired = sorted(weights_by_name) + [n + SCALE_SUFFIX for n in sorted(scales_by_name)]
    if unpaired:
        shown = ", ".join(unpaired[:4]) + (" ..." if len(unpaired) > 4 else "")
        raise ValueError(f"FP8 checkpoint: {len(unpaired)} tensor(s) lack their weight or {SCALE_SUFFIX} pair: {shown}")


def skip_mtp_layers(weights: Iterable[tuple[str, torch.Tensor]], num_hidden_layers: int
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Drops the tensors of layers >= num_hidden_layers (the MTP modules), saying so once."""
    said = False
    for name, tensor in weights:
        match = _LAYER.search(name)
        if match and int(match.group(1)) >= num_hidden_layers:
            if not said:
                logger.info(
                    "checkpoint has multi-token-prediction layers (index >= num_hidden_layers = %d, e.g. %s); "
                    "the main model skips them (speculative_config method mtp loads them as its draft)",
                    num_hidden_layers, name,
                )
                said = True
            continue
        yield name, tensor
