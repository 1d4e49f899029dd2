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


def test_the_gpu_profile_run_samples_after_its_forward(llama_path, monkeypatch):  # noqa: F811
    # _profile_run is what the GPU memory profile measures; on CPU its CUDA calls are stubbed.
    import torch

    runner = make_runner(llama_path, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    real_execute, real_profile = runner.execute, runner.profile_sampling
    monkeypatch.setattr(runner, "execute", lambda out: (calls.append("forward"), real_execute(out))[1])
    monkeypatch.setattr(runner, "profile_sampling", lambda: (calls.append("sampling"), real_profile())[1])
    runner._profile_run()
    assert calls == ["forward", "sampling", "sync"]
