"""AWQ / GPTQ int4 checkpoints under TP=2 and expert parallelism: packed weights, scales and zero points
shard in whole groups (act order: every rank keeps all groups), so greedy tokens equal one process's."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from tests.conftest import save_checkpoint
from tests.loader.int4_pack import write_int4_checkpoint
from tests.loader.test_fp8 import TINY_V3
from tests.models.test_deepseek import make_hf_model
from tests.parallel.conftest import DENSE, greedy_tokens

# (method, bits, group, sym, desc_act)
FORMATS = {"awq": ("awq", 4, 16, False, False), "gptq-act-order": ("gptq", 4, 16, False, True)}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def int4_v3(request, tmp_path_factory, tokenizer) -> str:
    hf_model = make_hf_model(DeepseekV3Config, DeepseekV3ForCausalLM, dict(TINY_V3, intermediate_size=192))
    root = tmp_path_factory.mktemp(f"int4-tp-{request.param}")
    src = save_checkpoint(hf_model, tokenizer, str(root / "f32"))
    write_int4_checkpoint(src, str(root / "q"), str(root / "ref"), *FORMATS[request.param])
    return str(root / "q")


def test_int4_deepseek_tp2_matches_single_process(int4_v3):
    assert greedy_tokens(int4_v3, 2) == greedy_tokens(int4_v3, 1)


def test_int4_deepseek_expert_parallel_matches_single_process(int4_v3):
    assert greedy_tokens(int4_v3, 2, enable_expert_parallel=True) == greedy_tokens(int4_v3, 1)


def test_int4_llama_tp2_matches_single_process(tmp_path, tokenizer):
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(LlamaConfig(**DENSE)).eval()
    src = save_checkpoint(hf_model, tokenizer, str(tmp_path / "f32"))
    write_int4_checkpoint(src, str(tmp_path / "q"), str(tmp_path / "ref"), "awq", 4, 16)
    assert greedy_tokens(str(tmp_path / "q"), 2) == greedy_tokens(str(tmp_path / "q"), 1)
