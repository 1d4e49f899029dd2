"""An FP8 KV cache with checkpoint scales under tensor and pipeline parallelism: each rank (or stage)
reads the scales of the layers it holds, so greedy tokens equal one process's; and the scales matter
(extreme ones change the tokens against an unquantized cache). Scales that are not one positive finite
number per layer are refused, naming the tensor."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from deepserve.loader.kv_scales import take_kv_scales
from tests.conftest import save_checkpoint
from tests.parallel.conftest import DENSE, greedy_tokens

# Layer 1 (pipeline stage 2's under PP=2) gets scales far from 1: tokens change only if they are read.
SCALES = {"model.layers.0.self_attn.k_scale": 0.3, "model.layers.0.self_attn.v_scale": 0.02,
          "model.layers.1.self_attn.k_scale": 1e-4, "model.layers.1.self_attn.v_scale": 1e-5}


@pytest.fixture(scope="module")
def scaled_llama(tmp_path_factory, tokenizer) -> str:
    torch.manual_seed(0)
    path = save_checkpoint(LlamaForCausalLM(LlamaConfig(**DENSE)).eval(), tokenizer,
                           str(tmp_path_factory.mktemp("kv-scales")))
    save_file({name: torch.tensor(value) for name, value in SCALES.items()}, f"{path}/kv-scales.safetensors")
    return path


def test_fp8_kv_scales_under_tp2_and_pp2(scaled_llama):
    one = greedy_tokens(scaled_llama, 1, kv_cache_dtype="fp8")
    assert one != greedy_tokens(scaled_llama, 1)  # the scales are read: tokens differ from a bf16 cache's
    assert greedy_tokens(scaled_llama, 2, kv_cache_dtype="fp8") == one
    assert greedy_tokens(scaled_llama, 1, kv_cache_dtype="fp8", pipeline_parallel_size=2) == one


@pytest.mark.parametrize("value, message", [
    (torch.tensor([0.5, 0.5]), "not per head"), (torch.tensor(0.0), "positive and finite"),
    (torch.tensor(float("inf")), "positive and finite"), (torch.tensor(float("nan")), "positive and finite"),
])
def test_bad_kv_scales_are_refused(value, message):
    class Front(torch.nn.Module):
        def kv_cache_spec(self, dtype):
            return None

        def load_kv_scale(self, which, value):
            pass

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].attn = Front()
    with pytest.raises(ValueError, match=message):
        list(take_kv_scales(model, [("model.layers.0.self_attn.k_scale", value)]))
