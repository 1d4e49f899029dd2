"""Each attention front's KV-cache spec: the layout the runner allocates and the bytes it counts."""

from __future__ import annotations

import torch

from deepserve.layers.attention import Attention
from deepserve.layers.kv_cache_spec import KVCacheSpec


def test_mha_spec_has_key_and_value_planes():
    spec = Attention(num_heads=8, head_dim=64, num_kv_heads=2, scale=0.125).kv_cache_spec(torch.bfloat16)
    assert spec.shape(10, 16) == (2, 10, 16, 2, 64)
    assert spec.bytes_per_token == 2 * 2 * 64 * 2  # K and V, 2 kv heads, 64 values, 2 bytes
    cache = spec.allocate(3, 16, torch.device("cpu"))
    assert cache.shape == (2, 3, 16, 2, 64) and cache.dtype == torch.bfloat16 and not cache.any()


def test_latent_spec_has_one_entry_per_token():
    spec = KVCacheSpec(entry_shape=(576,), planes=1, dtype=torch.float32)
    assert spec.shape(4, 8) == (4, 8, 576) and spec.bytes_per_token == 576 * 4


def test_runner_sizes_blocks_from_the_specs(tmp_path, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    from deepserve.config import EngineArgs
    from deepserve.runner.model_runner import ModelRunner
    from tests.conftest import save_checkpoint

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    path = save_checkpoint(LlamaForCausalLM(config), tokenizer, str(tmp_path))
    runner = ModelRunner(EngineArgs(model=path, dtype="float32", device="cpu").create_engine_config())
    assert runner.kv_cache_bytes_per_block() == runner.block_size * 3 * (2 * 2 * 16 * 4)  # 3 layers, head_dim 16
    runner.allocate_kv_cache(5)
    assert [tuple(layer.kv_cache.shape) for layer in runner.attention_layers] == [(2, 5, runner.block_size, 2, 16)] * 3
