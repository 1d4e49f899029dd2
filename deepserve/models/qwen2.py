"""Qwen2 architecture (DeepSeek-R1-Distill-Qwen): Llama with biases on the q, k and v projections."""

from __future__ import annotations

from typing import Any

from deepserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        return True, False
