"""The start-up prefill warm-up (DEEPSERVE_PREFILL_WARMUP): which lengths it runs, that the GPU memory
profile runs them on the profile's blocks before the sampler's profile, and that it leaves nothing behind
(the runner's next steps give the logits and tokens they give without it)."""

from __future__ import annotations

import pytest
import torch

from deepserve.engine.request import Request, ScheduledRequest, SchedulerOutput
from deepserve.runner.model_runner import prefill_warmup_lengths
from deepserve.sampling_params import SamplingParams
from tests.models.test_deepseek import make_runner, run_step, with_blocks
from tests.parallel.conftest import llama_path  # noqa: F401  (fixture)


def test_lengths_are_one_and_powers_of_two_and_one_less_below_the_profile_step():
    assert prefill_warmup_lengths(8192) == [1] + [
        n for p in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096) for n in (p - 1, p)] + [8191]
    assert prefill_warmup_lengths(64) == [1, 15, 16, 31, 32, 63]
    assert prefill_warmup_lengths(16) == [1]  # the profile step itself runs 16
    assert prefill_warmup_lengths(1) == []
    lengths = prefill_warmup_lengths(4096)
    assert all(n < 4096 for n in lengths)
    # Triton's integer specializations: == 1, divisible by 16, neither; and for the MoE's assignments
    # (tokens x top_k, top_k 6 or 8) both divisible by 16 and not.
    assert 1 in lengths and any(n % 16 == 0 for n in lengths) and any(n % 16 and n > 1 for n in lengths)
    for top_k in (6, 8):
        assert any(n * top_k % 16 for n in lengths) and any(n * top_k % 16 == 0 for n in lengths)


def _profile_calls(runner, monkeypatch) -> list:
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    real_execute, real_profile = runner.execute, runner.profile_sampling

    def execute(out: SchedulerOutput):
        calls.append(("forward", [s.num_new_tokens for s in out.scheduled],
                      max(b for s in out.scheduled for b in s.request.block_ids) + 1,
                      runner.attention_layers[0].kv_cache.shape))
        return real_execute(out)

    monkeypatch.setattr(runner, "execute", execute)
    monkeypatch.setattr(runner, "profile_sampling", lambda: (calls.append("sampling"), real_profile())[1])
    runner._profile_run()
    return calls


@pytest.mark.parametrize("on", [False, True])
def test_the_gpu_profile_runs_the_warmup_lengths_when_switched_on(llama_path, monkeypatch, on):  # noqa: F811
    monkeypatch.setenv("DEEPSERVE_PREFILL_WARMUP", "1" if on else "0")
    runner = make_runner(llama_path, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    calls = _profile_calls(runner, monkeypatch)
    forwards = [c for c in calls if isinstance(c, tuple)]
    assert [f[1] for f in forwards] == [[64]] + ([[n] for n in prefill_warmup_lengths(64)] if on else [])
    profile_cache = forwards[0][3]
    for _, (n,), blocks_used, cache_shape in forwards:
        assert blocks_used == -(-n // runner.block_size)  # each on the first blocks of the profile's cache
        assert cache_shape == profile_cache
    assert calls[-2:] == ["sampling", "sync"]
    assert all(layer.kv_cache is None for layer in runner.attention_layers)  # freed before the real cache


def test_the_warmup_leaves_nothing_behind(llama_path):  # noqa: F811
    runner = make_runner(llama_path, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    runner.allocate_kv_cache(16)
    prompts = [[5, 9, 2, 7, 1, 3], [4, 4, 8, 6, 2, 9, 11, 3, 3]]

    def logits_and_tokens():
        requests = with_blocks(runner, prompts)
        logits = run_step(runner, [(r, 0, len(r.prompt_token_ids)) for r in requests])
        fresh = with_blocks(runner, prompts)
        for r in fresh:
            r.sampling_params = SamplingParams(temperature=0.0, max_tokens=1)
        sampled = runner.execute(SchedulerOutput([ScheduledRequest(r, len(r.prompt_token_ids), 0)
                                                  for r in fresh]))
        return logits, sampled.sampled

    before_logits, before_tokens = logits_and_tokens()
    assert runner.warm_up_prefill(64) == [1, 15, 16, 31, 32, 63]
    after_logits, after_tokens = logits_and_tokens()
    torch.testing.assert_close(after_logits, before_logits, rtol=0, atol=0)
    assert after_tokens == before_tokens


def test_a_warmup_request_is_a_plain_prefill():
    # The warm-up's requests go through the same scheduled-step path as a prompt: no sampling options
    # that would need the penalty history or a grammar.
    request = Request("warmup-8", [0] * 8, SamplingParams(max_tokens=1))
    assert not request.sampling_params.needs_known_tokens
