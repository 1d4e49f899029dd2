"""The memory profile samples as many rows as the largest step can: one per sequence slot, k + 1 per slot
under speculative decoding (bounded by the token budget), with filters, a penalty and 20 logprobs on.
Counted here by the logits the samplers receive (on CPU; the GPU profile measures the peak around it)."""

from __future__ import annotations

import pytest

from tests.models.test_deepseek import make_runner
from tests.parallel.conftest import llama_path  # noqa: F401  (fixture)


@pytest.mark.parametrize("spec, budget, rows", [
    (None, 64, 8),  # max_num_seqs rows, one token each
    ({"method": "ngram", "num_speculative_tokens": 3}, 64, 32),  # 8 slots x (3 drafts + 1)
    ({"method": "ngram", "num_speculative_tokens": 3}, 20, 20),  # the token budget bounds a verify step
])
def test_the_profile_samples_the_largest_steps_rows(llama_path, monkeypatch, spec, budget, rows):  # noqa: F811
    runner = make_runner(llama_path, max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64,
                         speculative_config=spec)
    seen = []
    for name in ("sampler", "rejection_sampler"):
        real = getattr(runner, name)
        monkeypatch.setattr(runner, name, lambda logits, meta, *a, _real=real, _name=name: (
            seen.append((_name, tuple(logits.shape), meta.max_num_logprobs, meta.presence_penalty is not None)),
            _real(logits, meta, *a))[1])
    assert runner.profile_sampling() == rows
    which = "rejection_sampler" if spec else "sampler"
    assert seen == [(which, (rows, runner.vocab_size), 20, True)]


def _stub_cuda_memory(monkeypatch, calls: list, peak: dict) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: peak["bytes"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: (calls.append("reset"),
                                                                           peak.update(bytes=0)))


def test_the_gpu_profile_run_samples_after_its_forward(llama_path, monkeypatch):  # noqa: F811
    # _profile_run is what the GPU memory profile measures; on CPU its CUDA calls are stubbed.
    runner = make_runner(llama_path, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    calls = []
    _stub_cuda_memory(monkeypatch, calls, {"bytes": 0})
    real_execute, real_profile = runner.execute, runner.profile_sampling
    monkeypatch.setattr(runner, "execute", lambda out: (calls.append("forward"), real_execute(out))[1])
    monkeypatch.setattr(runner, "profile_sampling", lambda: (calls.append("sampling"), real_profile())[1])
    runner._profile_run()
    assert calls == ["forward", "sync", "reset", "sampling", "sync"]


@pytest.mark.parametrize("sampling_peak", [300, 3_000])
def test_the_profiles_dummy_blocks_are_not_counted_beside_the_cache(llama_path, monkeypatch, sampling_peak):  # noqa: F811
    # The step's peak holds the dummy blocks it ran on; the cache made after takes their place, so the peak
    # the cache is sized from leaves them out. The sampler runs after they are freed: its peak counts whole.
    runner = make_runner(llama_path, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    calls, peak, blocks = [], {"bytes": 0}, []
    _stub_cuda_memory(monkeypatch, calls, peak)
    real_execute, real_profile = runner.execute, runner.profile_sampling

    def execute(out):
        blocks.append(sum(layer.kv_cache.nbytes for layer in runner.attention_layers))
        peak["bytes"] = blocks[0] + 1_000  # the dummy blocks and 1,000 bytes of activations
        return real_execute(out)

    monkeypatch.setattr(runner, "execute", execute)
    monkeypatch.setattr(runner, "profile_sampling", lambda: (peak.update(bytes=sampling_peak), real_profile())[1])
    assert runner._profile_run() == max(1_000, sampling_peak)
    assert blocks[0] == 4 * runner.kv_cache_bytes_per_block()  # 64 tokens in blocks of 16
