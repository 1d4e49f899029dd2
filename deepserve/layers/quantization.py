"""Which weights are FP8 and in what format: one small config every quantizable layer receives.

`--quantization` (vLLM's name) and the checkpoint's quantization_config decide it together
(`resolve_quantization`); the model classes turn the result into an `Fp8Config` (`fp8_config`):
  block-scaled  the checkpoint ships FP8 (DeepSeek-V3/R1: float8_e4m3fn weights, a float32 scale_inv per
                128 x 128 block): the weights load and stay as shipped.
  per-channel   `--quantization fp8` on a bf16/fp16 checkpoint: the weights load in the model dtype and
                `quantize_after_loading` turns each quantizable linear into fp8 with one scale per output
                channel, and the routed experts into 128 x 128 blocks (the fused MoE kernel's format).
Activations are quantized per token on the fly in both (kernels/fp8_ref.py has the numerics).
Layers that stay in the model dtype whatever the checkpoint says: embeddings, lm_head, the MoE router,
norms, and MLA's wkv_b (its halves are folded into the queries and outputs, never a plain GEMM).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch import nn

logger = logging.getLogger(__name__)

SUPPORTED = ("fp8",)
MIN_FP8_CAPABILITY = (8, 9)  # Ada and Hopper have FP8 tensor cores
PER_CHANNEL_EXPERT_BLOCK = (128, 128)


@dataclass(frozen=True)
class Fp8Config:
    # (bn, bk): the checkpoint's weight block; None: per-channel, quantized after loading
    weight_block: tuple[int, int] | None

    @property
    def quantize_at_load(self) -> bool:
        return self.weight_block is None


def checkpoint_block(hf_config: Any) -> tuple[int, int] | None:
    """The checkpoint's FP8 weight block, None for an unquantized checkpoint; an unsupported
    quant_method is refused naming the supported ones."""
    from deepserve.loader.fp8 import fp8_block_size

    return fp8_block_size(hf_config)


def resolve_quantization(hf_config: Any, requested: str | None, device: str = "cuda",
                         capability: tuple[int, int] | None = None, gpu_name: str = "") -> str | None:
    """The engine's quantization: "fp8" or None (the model dtype; an FP8 checkpoint is then dequantized
    at load). `capability` is the GPU's compute capability (None: not known, assumed able)."""
    if requested not in (None, "", "none", *SUPPORTED):
        raise ValueError(f"quantization {requested!r} is not supported; supported: {', '.join(SUPPORTED)} "
                         "(--quantization), or leave it unset to follow the checkpoint's quantization_config")
    requested = requested or None  # "" (a config file's empty value) follows the checkpoint, like unset
    block = checkpoint_block(hf_config)
    wanted = "fp8" if requested == "fp8" or (requested is None and block is not None) else None
    if wanted is None and block is not None:  # --quantization none on an FP8 checkpoint
        logger.info("quantization none: the FP8 checkpoint is dequantized to the model dtype at load")
    if wanted and device == "cuda" and capability is not None and capability < MIN_FP8_CAPABILITY:
        gpu = f"{gpu_name or 'this GPU'} (compute capability {capability[0]}.{capability[1]})"
        if block is None:
            raise ValueError(f"--quantization fp8 needs FP8 tensor cores (compute capability >= 8.9: Ada, "
                             f"Hopper); {gpu} has none. Leave --quantization unset to serve in bf16")
        logger.warning("%s has no FP8 tensor cores (compute capability >= 8.9); the FP8 checkpoint is "
                       "dequantized to the model dtype at load (twice the weight memory)", gpu)
        return None
    return wanted


def fp8_config(hf_config: Any, quantization: str | None) -> Fp8Config | None:
    """The layers' FP8 format for an engine quantization resolved by resolve_quantization."""
    if quantization is None:
        return None
    return Fp8Config(weight_block=checkpoint_block(hf_config))


def quantize_after_loading(model: nn.Module) -> None:
    """Per-channel FP8 (`--quantization fp8` on an unquantized checkpoint): every layer built with a
    quantize-at-load config converts its loaded weights. Works on meta tensors too (the planner)."""
    for module in model.modules():
        convert = getattr(module, "quantize_loaded_weights", None)
        if convert is not None:
            convert()
