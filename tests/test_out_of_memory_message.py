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


def test_gpu_sizing_counts_the_stranded_memory_as_used(monkeypatch):
    # _profile_gpu_blocks: blocks = (total x utilisation - peak allocated - stranded) // bytes a block.
    from types import SimpleNamespace

    import torch

    from deepserve.runner.model_runner import ModelRunner

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 100 * GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * GIB, 140 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 96 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 90 * GIB)
    config = EngineArgs(device="cpu", max_model_len=2048, gpu_memory_utilization=0.9).create_engine_config()
    runner = SimpleNamespace(config=config, device=torch.device("cuda", 0), block_size=16, _profile_run=lambda: None)
    per_block = 16 * 491_520
    assert ModelRunner._profile_gpu_blocks(runner, per_block) == int((0.9 * 140 - 100 - 6) * GIB // per_block)
