"""Rotary position embeddings: default, linear, llama3 scaling (DeepSeek-R1-Distill-Llama,
DeepSeek-Coder) and YaRN (DeepSeek-V2/V3, with DeepSeek's mscale corrections).

Two layouts: "neox" rotates the two halves of each head (transformers' Llama, Qwen2, and DeepSeek-V3
with rope_interleave=False); "interleaved" rotates adjacent pairs (x0, x1), (x2, x3), ... as the
DeepSeek-V2/V3 checkpoints are trained. Either way q and k use the same layout, so q·k is what the
checkpoint expects.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from deepserve.layers.fusion import triton_on_cuda


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope settings of a config, whether it uses transformers 5's `rope_parameters` or the
    older `rope_theta` + `rope_scaling` pair."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        out = dict(params)
    else:
        out = dict(getattr(hf_config, "rope_scaling", None) or {})
        out.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    return out


def _inv_freq(rotary_dim: int, params: dict[str, Any], max_position: int) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    if rope_type in ("yarn", "deepseek_yarn"):
        return _yarn_inv_freq(inv_freq, rotary_dim, params, max_position)
    raise ValueError(
        f"rope_scaling type {rope_type!r} is not supported for this model; supported: default, linear, llama3, yarn"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended smoothly.
    factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, blended)
    return torch.where(wavelen < old_len / high, inv_freq, out)


def _yarn_factor(params: dict[str, Any], max_position: int) -> float:
    # Without `factor` (some V3 derivatives) the stretch is the ratio of the two context lengths.
    if params.get("factor") is None:
        return max_position / float(params["original_max_position_embeddings"])
    return float(params["factor"])


def _yarn_inv_freq(inv_freq: torch.Tensor, rotary_dim: int, params: dict[str, Any], max_position: int
                   ) -> torch.Tensor:
    # Dimensions that turn more than beta_fast times over the original context keep their frequency,
    # those turning fewer than beta_slow times are divided by `factor`; a linear ramp blends between.
    factor = _yarn_factor(params, max_position)
    base = float(params["rope_theta"])
    old_len = float(params.get("original_max_position_embeddings") or max_position)
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over old_len
        return rotary_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate (divided by factor)
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 · mscale · ln(scale) + 1 once the context is stretched."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(params: dict[str, Any], max_position: int) -> float:
    """The factor cos and sin are multiplied by (transformers' `attention_factor`). DeepSeek's YaRN
    sets mscale = mscale_all_dim, which makes it 1 and moves the correction into the softmax scale."""
    if params["rope_type"] not in ("yarn", "deepseek_yarn"):
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = _yarn_factor(params, max_position)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


def softmax_scale_correction(params: dict[str, Any]) -> float:
    """DeepSeek multiplies the softmax scale by mscale(factor, mscale_all_dim)² when the rope is
    stretched: the same temperature applied to every q·k dimension, not only the rotary ones."""
    mscale_all_dim = params.get("mscale_all_dim")
    if params["rope_type"] == "default" or not mscale_all_dim:
        return 1.0
    return yarn_mscale(float(params.get("factor") or 1.0), float(mscale_all_dim)) ** 2


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, max_position: int, params: dict[str, Any], interleaved: bool = False
                 ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        inv_freq = _inv_freq(rotary_dim, params, max_position)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * rope_attention_factor(params, max_position)
        # [max_position, rotary_dim]: cos of every frequency, then sin of every frequency
        self.register_buffer("cos_sin", cos_sin.float(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, H, D], k: [T, Hkv, D]; rotates the first rotary_dim of each head
        return _apply_rope(positions, q, k, self.cos_sin, self.rotary_dim, self.interleaved)


@triton_on_cuda("apply_rope")
def _apply_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int,
                interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rotary_dim / 2] each
    rotate = _rotate_interleaved if interleaved else _rotate
    return rotate(q, cos, sin, rotary_dim), rotate(k, cos, sin, rotary_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rot.float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rotated, rest], dim=-1) if rest.numel() else rotated


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rot.float()[..., 0::2], rot.float()[..., 1::2]  # [..., rotary_dim / 2] each: pair members
    # Pair i rotates by frequency i and stays in place: (x1, x2) -> interleaved again.
    rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([rotated, rest], dim=-1) if rest.numel() else rotated
