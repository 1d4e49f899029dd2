"""Rotary position embeddings: default, linear, llama3 scaling (DeepSeek-R1-Distill-Llama,
DeepSeek-Coder) — YaRN joins with the DeepSeek-V2 family.

Layout is "neox" (rotate the two halves of each head), as transformers' Llama and Qwen2 do.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope settings of a config, whether it uses transformers 5's `rope_parameters` or the
    older `rope_theta` + `rope_scaling` pair."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return dict(params)
    out = dict(getattr(hf_config, "rope_scaling", None) or {})
    out.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    return out


def _inv_freq(rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    raise ValueError(
        f"rope_scaling type {rope_type!r} is not supported for this model; supported: default, linear, llama3"
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


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), _inv_freq(rotary_dim, params))
        # [max_position, rotary_dim]: cos of every frequency, then sin of every frequency
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1).float(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, H, D], k: [T, Hkv, D]; rotates the first rotary_dim of each head
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rotary_dim / 2] each
        return _rotate(q, cos, sin, self.rotary_dim), _rotate(k, cos, sin, self.rotary_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rot.float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rotated, rest], dim=-1) if rest.numel() else rotated
