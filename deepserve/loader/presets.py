"""The benchmark models' shapes as configs, for `load_format="dummy"` where no weights can be fetched.

Each preset is the published config.json of the checkpoint (the fields that shape the model and its
tokens), so a dummy run allocates and computes exactly what the real model would.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from deepserve.errors import ConfigRefused

_DEEPSEEK_YARN = dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1)

_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "deepseek-v2-lite": ("deepseek_v2", dict(
        architectures=["DeepseekV2ForCausalLM"], vocab_size=102400, hidden_size=2048, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6, routed_scaling_factor=1.0,
        topk_method="greedy", n_group=1, topk_group=1, scoring_func="softmax", norm_topk_prob=False,
        first_k_dense_replace=1, moe_layer_freq=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, hidden_act="silu", max_position_embeddings=163840,
        rms_norm_eps=1e-6, rope_theta=10000, rope_scaling=dict(_DEEPSEEK_YARN, mscale=0.707, mscale_all_dim=0.707),
        attention_bias=False, tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001,
        torch_dtype="bfloat16",
    )),
    "deepseek-v3": ("deepseek_v3", dict(
        architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_nextn_predict_layers=1, num_attention_heads=128,
        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8,
        routed_scaling_factor=2.5, topk_method="noaux_tc", n_group=8, topk_group=4, scoring_func="sigmoid",
        norm_topk_prob=True, first_k_dense_replace=3, moe_layer_freq=1, kv_lora_rank=512, q_lora_rank=1536,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, hidden_act="silu",
        max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000,
        rope_scaling=dict(_DEEPSEEK_YARN, mscale=1.0, mscale_all_dim=1.0), attention_bias=False,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16",
        # The release's FP8 format; dummy weights are drawn in the compute dtype whatever it says.
        quantization_config=dict(activation_scheme="dynamic", fmt="e4m3", quant_method="fp8",
                                 weight_block_size=[128, 128]),
    )),
    "deepseek-llm-7b": ("llama", dict(
        architectures=["LlamaForCausalLM"], vocab_size=102400, hidden_size=4096, intermediate_size=11008,
        num_hidden_layers=30, num_attention_heads=32, num_key_value_heads=32, hidden_act="silu",
        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=100000, eos_token_id=100001, torch_dtype="bfloat16",
    )),
    "r1-distill-qwen-7b": ("qwen2", dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, hidden_act="silu",
        max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=10000, sliding_window=4096,
        max_window_layers=28, use_sliding_window=False, tie_word_embeddings=False, bos_token_id=151643,
        eos_token_id=151643, torch_dtype="bfloat16",
    )),
}
PRESET_NAMES: list[str] = sorted(_PRESETS)


def preset_config(name: str) -> Any:
    """The transformers config of preset `name` (a fresh object: callers may override fields)."""
    from transformers import AutoConfig

    if name not in _PRESETS:
        raise ConfigRefused(f"unknown model preset {name!r}; presets: {', '.join(PRESET_NAMES)}")
    model_type, fields = _PRESETS[name]
    return AutoConfig.for_model(model_type, **copy.deepcopy(fields))  # transformers edits rope dicts in place


def is_preset(model: str) -> bool:
    """True when `model` names a preset and no folder of that name exists."""
    return model in _PRESETS and not os.path.isdir(model)


def resolve_hf_config(model: str, overrides: dict[str, Any] | None = None, load_format: str = "auto") -> Any:
    """config.json of a local checkpoint folder, or a preset's config when `model` names one (and no
    folder of that name exists); a preset has no weights, so it needs load_format='dummy'."""
    from deepserve.loader.hf_config import load_hf_config

    if not is_preset(model):
        return load_hf_config(model, overrides)
    if load_format != "dummy":
        raise ConfigRefused(
            f"{model!r} is a shape preset without weights; pass load_format='dummy' (--load-format dummy), "
            "or point --model at a checkpoint folder"
        )
    config = preset_config(model)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    return config
