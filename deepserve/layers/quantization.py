"""Which weights are quantized and in what format: one small config every quantizable layer receives
(Fp8Config or Int4Config).

`--quantization` (vLLM's name) and the checkpoint's quantization_config decide it together
(`resolve_quantization`); the model classes turn the result into an `Fp8Config` (`fp8_config`):
  block-scaled  the checkpoint ships FP8 (DeepSeek-V3/R1: float8_e4m3fn weights, a float32 scale_inv per
                128 x 128 block): the weights load and stay as shipped.
  per-channel   `--quantization fp8` on a bf16/fp16 checkpoint: the weights load in the model dtype and
                `quantize_after_loading` turns each quantizable linear into fp8 with one scale per output
                channel, and the routed experts into 128 x 128 blocks (the fused MoE kernel's format).
Activations are quantized per token on the fly in both (kernels/fp8_ref.py has the numerics).
Int4 (W4A16, `awq` / `gptq`): the checkpoint ships int4 (GPTQ also int8) weights with group scales and
zero points (loader/int4.py reads both formats into one layout, kernels/int4_ref.py has the numerics);
activations stay in the model dtype. Auto-detected from quantization_config.quant_method; an explicit
--quantization must name the same method. Every linear layer the checkpoint quantizes is held int4:
Llama / Qwen2 attention and MLP projections, DeepSeek's attention projections, dense MLPs, shared and
routed experts. Modules a checkpoint ships unquantized (modules_to_not_convert; GPTQ "-:" dynamic rules)
load in the model dtype.
Layers that stay in the model dtype whatever the checkpoint says: embeddings, lm_head, the MoE router,
norms, and MLA's wkv_b (its halves are folded into the queries and outputs, never a plain GEMM; a
quantized one is dequantized at load).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

from torch import nn

from deepserve.errors import ConfigRefused

logger = logging.getLogger(__name__)

SUPPORTED = ("fp8", "awq", "gptq")
INT4_METHODS = ("awq", "gptq")
MIN_FP8_CAPABILITY = (8, 9)  # Ada and Hopper have FP8 tensor cores
PER_CHANNEL_EXPERT_BLOCK = (128, 128)


class Fp8Unsupported(ConfigRefused):
    """An FP8 checkpoint on a GPU without FP8 tensor cores, served only with --quantization none."""


@dataclass(frozen=True)
class Fp8Config:
    # (bn, bk): the checkpoint's weight block; None: per-channel, quantized after loading
    weight_block: tuple[int, int] | None

    @property
    def quantize_at_load(self) -> bool:
        return self.weight_block is None


@dataclass(frozen=True)
class Int4Config:
    """A weight-only integer format (kernels/int4_ref.py): `bits`-bit codes, one scale and zero point per
    output row and group of group_size inputs (-1: one group per row)."""

    method: str  # "awq" or "gptq": the checkpoint's packing
    bits: int
    group_size: int
    desc_act: bool  # GPTQ act order: each input's group is g_idx[k], not k // group_size
    zero_offset: bool  # GPTQ's v1 convention: the stored zero point is one less than the real one
    # No module list: which modules are int4 is what the checkpoint ships (loader/int4.py), so
    # modules_to_not_convert, GPTQ's "-:" rules and experts-only builds all follow from the tensors.

    def group_for(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    def num_groups(self, in_features: int) -> int:
        return -(-in_features // self.group_for(in_features))


QuantConfig = Fp8Config | Int4Config


def checkpoint_block(hf_config: Any) -> tuple[int, int] | None:
    """The checkpoint's FP8 weight block, None for an unquantized checkpoint; an unsupported
    quant_method is refused naming the supported ones."""
    from deepserve.loader.fp8 import fp8_block_size

    return fp8_block_size(hf_config)


def resolve_quantization(hf_config: Any, requested: str | None, device: str = "cuda",
                         capability: tuple[int, int] | None = None, gpu_name: str = "",
                         without_checkpoint: bool = False) -> str | None:
    """The engine's quantization: "fp8", "awq", "gptq" or None (the model dtype; a quantized checkpoint
    is then dequantized at load). `capability` is the GPU's compute capability (None: not known, assumed
    able). without_checkpoint: no weights are read (dummy weights, the planner), so --quantization awq /
    gptq describes the int4 build of the model whatever its config says."""
    if requested not in (None, "", "none", *SUPPORTED):
        raise ValueError(f"quantization {requested!r} is not supported; supported: {', '.join(SUPPORTED)} "
                         "(--quantization), or leave it unset to follow the checkpoint's quantization_config")
    requested = requested or None  # "" (a config file's empty value) follows the checkpoint, like unset
    from deepserve.loader.int4 import checkpoint_method

    method = checkpoint_method(hf_config)
    if requested in INT4_METHODS or method in INT4_METHODS:
        return _resolve_int4(method, requested, without_checkpoint)
    block = checkpoint_block(hf_config)
    wanted = "fp8" if requested == "fp8" or (requested is None and block is not None) else None
    if wanted is None and block is not None:  # --quantization none on an FP8 checkpoint
        logger.info("quantization none: the FP8 checkpoint is dequantized to the model dtype at load")
    if wanted and device == "cuda" and capability is not None and capability < MIN_FP8_CAPABILITY:
        gpu = f"{gpu_name or 'this GPU'} (compute capability {capability[0]}.{capability[1]})"
        if block is None:
            raise ValueError(f"--quantization fp8 needs FP8 tensor cores (compute capability >= 8.9: Ada, "
                             f"Hopper); {gpu} has none. Leave --quantization unset to serve in bf16")
        # Refused rather than dequantized unasked: the bf16 weights are twice the memory the user sized for
        # (V3's 1.3 TB would run out of memory only after a long load), so the doubling is the user's choice.
        raise Fp8Unsupported(f"this FP8 checkpoint needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper); "
                             f"{gpu} has none. Pass --quantization none (LLM(quantization='none')) to dequantize it "
                             "to the model dtype at load (twice the weight memory), or serve an int4 build of the "
                             "model (AWQ / GPTQ)")
    return wanted


def _resolve_int4(method: str | None, requested: str | None, without_checkpoint: bool) -> str | None:
    if requested == "none":
        logger.info("quantization none: the %s checkpoint is dequantized to the model dtype at load", method)
        return None
    if requested is None or requested == method or (without_checkpoint and requested in INT4_METHODS):
        return requested or method
    have = f"quant_method {method!r}" if method else "no quantization_config (an unquantized checkpoint)"
    raise ValueError(f"--quantization {requested} does not match the checkpoint: its config.json has {have}; "
                     "leave --quantization unset to follow the checkpoint"
                     + (f", or pass {method}" if method in INT4_METHODS else ""))


def fp8_config(hf_config: Any, quantization: str | None) -> QuantConfig | None:
    """The layers' format for an engine quantization resolved by resolve_quantization: Fp8Config for
    "fp8", Int4Config for "awq" / "gptq" (the checkpoint's fields, validated), None otherwise."""
    if quantization is None:
        return None
    if quantization in INT4_METHODS:
        from deepserve.loader.int4 import int4_config

        return int4_config(hf_config, quantization)
    return Fp8Config(weight_block=checkpoint_block(hf_config))


def quantize_after_loading(model: nn.Module) -> None:
    """Per-channel FP8 (`--quantization fp8` on an unquantized checkpoint): every layer built with a
    quantize-at-load config converts its loaded weights; int4 linears on a Hopper GPU take the tensor-core
    GEMV's tiled layout (layers/int4.tiled_for_mma_gemv); first, a module's fusion of loaded weights (layers/moe.py
    DeepseekMoE's shared experts under DEEPSERVE_SHARED_EXPERTS_FUSION). Works on meta tensors too (the planner)."""
    for module in model.modules():  # parents before children: a parent's fusion comes before its parts' re-layout
        for hook in ("fuse_loaded_weights", "quantize_loaded_weights"):
            convert = getattr(module, hook, None)
            if convert is not None:
                convert()


@functools.cache
def warn_once(message: str, level: int = logging.WARNING) -> None:
    """A load-time message said once a process, not once per layer (e.g. why a fusion after loading did not
    apply: every layer of a model has the same reason). `level` INFO for a default's refusal nobody asked
    for (a fusion on by default that does not apply to this model)."""
    logger.log(level, message)
