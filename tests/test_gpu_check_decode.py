"""bench/gpu_check.py's decode check (used by check_int4_engine.py and check_fp8_engine.py on the GPU), run
on the CPU: one sequence decoded a token a step, its logprobs against a prefill of the same tokens. On one
device the two agree; against another model's prefill they do not, so the check can fail."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gpu_check = _load("gpu_check")


def _llama(path: Path, seed: int) -> str:
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**gpu_check.COMMON, num_key_value_heads=2)).save_pretrained(path)
    return str(path)


def test_decode_logprobs_equal_the_prefill_of_the_same_tokens_and_a_wrong_model_is_caught(tmp_path):
    path = _llama(tmp_path / "a", 0)
    sequences, decoded = gpu_check.decode_logprobs(path, "cpu", "bfloat16", steps=4)
    prompts = gpu_check.prompts()
    assert [len(s) for s in sequences] == [len(p) + 4 for p in prompts]
    assert all(s[:len(p)] == p for s, p in zip(sequences, prompts, strict=True))
    assert len(decoded) == 4 * len(prompts) and all(lp <= 0 for lp in decoded)
    forced = gpu_check.teacher_forced_logprobs(path, "cpu", "bfloat16", sequences, steps=4)
    assert (torch.tensor(decoded) - torch.tensor(forced)).abs().mean().item() < 0.01
    other = _llama(tmp_path / "b", 1)  # another model's prefill of the same tokens: far off
    wrong = gpu_check.teacher_forced_logprobs(other, "cpu", "bfloat16", sequences, steps=4)
    assert (torch.tensor(decoded) - torch.tensor(wrong)).abs().mean().item() > 0.1
