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


def test_memory_stranded_in_the_allocator_is_left_out_of_the_cache(monkeypatch, caplog):
    # Free pieces of segments that still hold a tensor cannot take the cache's large tensors: the sizing
    # counts them as used (after empty_cache, which returns whole free segments) and says so when large.
    import torch

    from deepserve.runner import model_runner

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 120 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 103 * GIB)
    with caplog.at_level("WARNING", logger="deepserve.runner.model_runner"):
        assert model_runner._stranded_bytes(torch.device("cuda", 0)) == 17 * GIB
    assert calls == ["empty_cache"] and "17.0 GiB" in caplog.text
    caplog.clear()
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 120 * GIB - 2**20)
    with caplog.at_level("WARNING", logger="deepserve.runner.model_runner"):
        assert model_runner._stranded_bytes(torch.device("cuda", 0)) == 2**20
    assert caplog.text == ""
