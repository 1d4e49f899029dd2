"""The GPU cache-sizing error names the flags to change and the values that would fit (pure arithmetic;
the GPU path calls it with the measured peak and total)."""

from __future__ import annotations

from deepserve.config import EngineArgs
from deepserve.runner.model_runner import _out_of_memory_message

GIB = 2**30


def test_message_gives_the_context_and_utilisation_that_would_fit():
    config = EngineArgs(device="cpu", max_model_len=2048, gpu_memory_utilization=0.9).create_engine_config()
    per_block = 16 * 491_520  # DeepSeek-LLM-7B, bf16, 16-token blocks
    peak, total = 125 * GIB, 140 * GIB
    num_blocks = int((0.9 * total - peak) // per_block)  # what 1 GiB of room holds
    needed = 2048 // 16
    msg = _out_of_memory_message(peak, total, per_block, needed + 40, num_blocks, config, 16)
    assert f"lower --max-model-len to {num_blocks * 16}" in msg
    util = (peak + (needed + 40) * per_block) / total
    assert f"raise --gpu-memory-utilization to {util:.2f}" in msg and util > 0.9
    assert "--tensor-parallel-size" in msg
