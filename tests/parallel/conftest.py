"""Tiny checkpoints and a helper that runs one LLM and always shuts its workers down.

Every tensor-parallel engine makes this pytest process rank 0 of a process group; `run_llm`
shuts it down before returning, so the next test (TP=1 included) starts from a clean process.
"""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from deepserve import LLM, SamplingParams
from tests.conftest import save_checkpoint

# vocab 500 does not divide by 4: the vocab-parallel embedding pads its last slice.
DENSE = dict(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
PROMPTS = [[5, 17, 300, 42, 9], list(range(100, 137)), [7] * 20]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def make_llm(path: str, tp: int, **kwargs) -> LLM:
    return LLM(path, device="cpu", dtype="float32", tensor_parallel_size=tp, num_gpu_blocks_override=64, **kwargs)


def shutdown(llm: LLM) -> None:
    runner = llm.llm_engine.core.runner
    if hasattr(runner, "shutdown"):
        runner.shutdown()


def greedy_tokens(path: str, tp: int, prompts: list[list[int]] = PROMPTS, **kwargs) -> list[list[int]]:
    llm = make_llm(path, tp, **kwargs)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        shutdown(llm)
        del llm
        gc.collect()


def _dense_checkpoint(tmp_path_factory, tokenizer, name: str, config_cls, model_cls, **extra) -> str:
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**DENSE, **extra})).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):
                p.normal_(0, 0.5)  # Qwen2's q/k/v biases start at zero; make them count
    return save_checkpoint(model, tokenizer, str(tmp_path_factory.mktemp(name)))


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory, tokenizer) -> str:
    return _dense_checkpoint(tmp_path_factory, tokenizer, "llama-gqa", LlamaConfig, LlamaForCausalLM)


@pytest.fixture(scope="session")
def qwen2_path(tmp_path_factory, tokenizer) -> str:
    return _dense_checkpoint(tmp_path_factory, tokenizer, "qwen2-gqa", Qwen2Config, Qwen2ForCausalLM,
                             tie_word_embeddings=True)
