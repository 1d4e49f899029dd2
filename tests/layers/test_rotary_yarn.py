"""YaRN frequencies and DeepSeek's mscale corrections against transformers, and the interleaved
rope layout against transformers' DeepSeek-V2 (complex) and V3 (rope_interleave) rotations."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

from deepserve.layers.rotary import (
    RotaryEmbedding,
    rope_attention_factor,
    rope_parameters,
    softmax_scale_correction,
    yarn_mscale,
)

DR, MAX_POS = 16, 512
YARNS = {
    "v2-lite": dict(factor=40.0, original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=0.707),
    "v3": dict(factor=40.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0,
               beta_fast=32, beta_slow=1),
    "uneven-mscale": dict(factor=4.0, original_max_position_embeddings=128, mscale=1.0, mscale_all_dim=0.5),
    "plain-yarn": dict(factor=8.0, original_max_position_embeddings=64, beta_fast=16, beta_slow=2),
    "no-truncate": dict(factor=4.0, original_max_position_embeddings=64, truncate=False),
}


def v3_config(**rope) -> DeepseekV3Config:
    rope = dict(rope_type="yarn", rope_theta=10000.0, **rope) if rope else None
    return DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, qk_rope_head_dim=DR,
                            max_position_embeddings=MAX_POS, rope_parameters=rope)


@pytest.mark.parametrize("name", sorted(YARNS))
def test_yarn_matches_transformers(name):
    config = v3_config(**YARNS[name])
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    params = rope_parameters(config)
    ours = RotaryEmbedding(DR, MAX_POS, params)
    positions = torch.arange(MAX_POS, dtype=torch.float32)
    freqs = torch.outer(positions, hf_inv_freq)
    want = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * hf_factor
    torch.testing.assert_close(ours.cos_sin, want, atol=1e-4, rtol=1e-5)
    assert rope_attention_factor(params, MAX_POS) == pytest.approx(hf_factor)
    assert DR**-0.5 * softmax_scale_correction(params) == pytest.approx(hf_v3.yarn_apply_mscale(params, DR**-0.5))


def test_mscale_all_dim_sharpens_the_softmax():
    params = rope_parameters(v3_config(**YARNS["v3"]))
    assert softmax_scale_correction(params) == pytest.approx((0.1 * math.log(40.0) + 1.0) ** 2)
    assert rope_attention_factor(params, MAX_POS) == 1.0  # mscale == mscale_all_dim: cos/sin untouched
    assert yarn_mscale(1.0, 5.0) == 1.0
    assert softmax_scale_correction(rope_parameters(v3_config())) == 1.0


def test_default_rope_is_unchanged():
    config = v3_config()
    inv_freq, _ = hf_v3.DeepseekV3RotaryEmbedding.compute_default_rope_parameters(config)
    ours = RotaryEmbedding(DR, MAX_POS, rope_parameters(config))
    freqs = torch.outer(torch.arange(MAX_POS, dtype=torch.float32), inv_freq)
    torch.testing.assert_close(ours.cos_sin, torch.cat([freqs.cos(), freqs.sin()], dim=-1), atol=1e-4, rtol=1e-5)


def rotations(interleaved: bool, config):
    torch.manual_seed(0)
    positions = torch.tensor([0, 3, 17, 200, 511])
    q, k = torch.randn(5, 4, DR), torch.randn(5, 1, DR)
    ours = RotaryEmbedding(DR, MAX_POS, rope_parameters(config), interleaved=interleaved)
    return positions, q, k, ours(positions, q, k)


def test_interleaved_matches_transformers_v2_complex_rotation():
    config = DeepseekV2Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=DR,
                              max_position_embeddings=MAX_POS,
                              rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, **YARNS["uneven-mscale"]))
    positions, q, k, (q_rot, k_rot) = rotations(True, config)
    freqs_cis = hf_v2.DeepseekV2RotaryEmbedding(config)(q, positions[None])  # [1, T, Dr/2] complex
    # transformers' layout: [batch, heads, T, D]
    want_q, want_k = hf_v2.apply_rotary_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], freqs_cis)
    torch.testing.assert_close(q_rot, want_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_rot, want_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("interleave", [True, False])
def test_scores_match_transformers_v3_rope_layouts(interleave):
    """transformers' V3 writes interleaved pairs back de-interleaved; q·k is what must agree."""
    config = v3_config(**YARNS["v3"])
    config.rope_interleave = interleave
    positions, q, k, (q_rot, k_rot) = rotations(interleave, config)
    cos, sin = hf_v3.DeepseekV3RotaryEmbedding(config)(q, positions[None])  # [1, T, Dr] each
    apply = hf_v3.apply_rotary_pos_emb_interleave if interleave else hf_v3.apply_rotary_pos_emb
    want_q, want_k = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    want_scores = torch.einsum("hqd,hkd->hqk", want_q[0], want_k[0].expand(4, -1, -1))
    scores = torch.einsum("qhd,khd->hqk", q_rot, k_rot.expand(-1, 4, -1))
    # transformers takes the angles in float32 (ours in float64): ~1e-4 apart by position 511.
    torch.testing.assert_close(scores, want_scores, atol=1e-3, rtol=1e-4)
    if not interleave:
        torch.testing.assert_close(q_rot, want_q[0].transpose(0, 1), atol=1e-4, rtol=1e-4)


def test_rotary_leaves_dims_beyond_rotary_dim_alone():
    params = rope_parameters(v3_config())
    x = torch.randn(3, 2, DR + 4)
    for interleaved in (True, False):
        out, _ = RotaryEmbedding(DR, MAX_POS, params, interleaved)(torch.tensor([1, 2, 3]), x, x)
        assert torch.equal(out[..., DR:], x[..., DR:])
