"""Shared fixtures: a byte-level BPE tokenizer trained here, tiny random checkpoints written
with transformers' own model classes."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU the Triton kernels run in Triton's interpreter. The switch is read when a kernel is
# decorated, so it must be set before any test imports a kernel module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Paged attention stores keys and values in fixed-size blocks of memory.",
    "深度求索 builds mixture-of-experts models; 注意力 is all you need. 🚀✨",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
]
SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]


@pytest.fixture(scope="session")
def tokenizer():
    from deepserve.demo import train_bpe_tokenizer

    return train_bpe_tokenizer(CORPUS, vocab_size=400, special_tokens=SPECIALS)


def save_checkpoint(model, tokenizer, path: str) -> str:
    """save_pretrained the model (safetensors) and the tokenizer into one Hugging Face folder."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
