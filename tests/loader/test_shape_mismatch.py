"""A checkpoint whose tensors do not have the shapes its config gives (an edited config.json, or
--hf-overrides on real weights) is refused naming the tensor: the loaders cut each rank's shard out of a
checkpoint tensor, and used to cut a part of a larger one without a word, serving truncated weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from deepserve.config import EngineArgs
from deepserve.demo import ensure_demo_model
from deepserve.runner.model_runner import ModelRunner
from tests.conftest import save_checkpoint
from tests.loader.test_fp8 import fp8_checkpoint  # noqa: F401 - the fixture
from tests.models.test_dense_models import make_dense_model


def load(path: str, **overrides) -> ModelRunner:
    return ModelRunner(EngineArgs(model=path, device="cpu", dtype="float32", hf_overrides=overrides)
                       .create_engine_config())


@pytest.mark.parametrize(("overrides", "tensor"), [
    ({"intermediate_size": 64}, r"model\.layers\.0\.mlp\.(down|gate|up)_proj\.weight"),  # dense MLP, 128 shipped
    ({"moe_intermediate_size": 16}, r"model\.layers\.1\.mlp\.experts\..*"),  # routed experts, 32 shipped
])
def test_deepseek_config_smaller_than_the_weights_is_refused(overrides, tensor):
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{tensor}': shape .* does not match the weights"):
        load(ensure_demo_model(), **overrides)


def test_llama_config_smaller_than_the_weights_is_refused(tmp_path, tokenizer):
    hf_model = make_dense_model(LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=2))
    path = save_checkpoint(hf_model, tokenizer, str(tmp_path / "llama"))
    heads = hf_model.config.num_key_value_heads
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model\.layers\.0\.self_attn\.(k|v)_proj\.weight'"):
        load(path, num_key_value_heads=heads // 2)
    load(path)  # the checkpoint itself is fine


def test_fp8_scale_of_the_wrong_block_count_is_refused_naming_it(fp8_checkpoint):  # noqa: F811
    _, fp8_dir, _ = fp8_checkpoint
    shard = f"{fp8_dir}/model-00002-of-00002.safetensors"
    scales = load_file(shard)
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    scales[name] = torch.ones(1, 1)  # used to fail as an IndexError from inside the loader
    save_file(scales, shard)
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{name}': shape \(1, 1\), (expected|but the config)"):
        load(fp8_dir)


@pytest.mark.parametrize(("family", "field", "tensor"), [
    ("llama", "intermediate_size", r"model\.layers\.0\.mlp\.(down|gate|up)_proj\.(qweight|qzeros|scales|g_idx)"),
    ("v3", "moe_intermediate_size", r"model\.layers\.\d\.mlp\.experts\.\d+\.(down|gate|up)_proj\.\w+"),
])
@pytest.mark.parametrize("fmt", ["awq", "gptq-act-order"])
def test_int4_config_smaller_than_the_packed_weights_is_refused(tmp_path, tokenizer, family, field, tensor, fmt):
    from tests.models.test_deepseek import make_hf_model
    from tests.models.test_int4_models import DEEPSEEK, DENSE, int4_checkpoint

    hf_model = make_dense_model(*DENSE[family]) if family in DENSE else make_hf_model(*DEEPSEEK[family])
    path, _ = int4_checkpoint(tmp_path, hf_model, tokenizer, fmt)
    smaller = getattr(hf_model.config, field) // 2
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{tensor}': shape .* does not match the weights"):
        load(path, **{field: smaller})
    load(path)  # the checkpoint itself loads
