"""Speculative decoding's CPU bookkeeping: n-gram drafts, the verify step the scheduler builds, and what
it keeps of a step's outcome (computed tokens, blocks, prefix-cache hashes, counters)."""

from __future__ import annotations

import pytest

from deepserve.config import SchedulerConfig
from deepserve.engine.block_manager import BlockManager
from deepserve.engine.ngram_proposer import NgramProposer
from deepserve.engine.request import Request
from deepserve.engine.scheduler import Scheduler
from deepserve.sampling_params import SamplingParams


@pytest.mark.parametrize(("tokens", "k", "lo", "hi", "want"), [
    ([1, 2, 3, 4, 1, 2], 3, 1, 3, [3, 4, 1]),  # "1 2" seen at 0: what followed it
    ([1, 2, 3, 4, 1, 2], 1, 1, 3, [3]),  # at most k
    ([5, 6, 7, 8], 2, 1, 3, []),  # no earlier occurrence of any tail
    ([9, 1, 2, 7, 1, 2, 8, 1, 2], 2, 1, 3, [7, 1]),  # the earliest occurrence of the longest tail
    ([3, 1, 2, 9, 2, 4, 1, 2], 2, 2, 2, [9, 2]),  # n = 2 only: "1 2", not the later "2"
    ([1, 2, 9, 2], 2, 2, 3, []),  # only "2" repeats, shorter than prompt_lookup_min
    ([7, 7, 7], 4, 1, 3, [7]),  # a run: "7 7" at 0 is followed by one token
])
def test_ngram_drafts(tokens, k, lo, hi, want):
    assert NgramProposer(k, lo, hi).propose(tokens, k) == want


def test_ngram_drafts_respect_the_callers_limit():
    assert NgramProposer(4, 1, 3).propose([1, 2, 3, 4, 5, 1], 2) == [2, 3]
    assert NgramProposer(4, 1, 3).propose([1, 2, 3, 4, 5, 1], 0) == []


def scheduler(num_blocks: int = 16, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(max_model_len=64, **config), BlockManager(num_blocks, 4),
                     NgramProposer(3, 1, 3))


def decoding(s: Scheduler, prompt: list[int], **params) -> Request:
    """A request past its prefill: the prompt computed, its first token sampled."""
    request = Request("r", prompt, SamplingParams(**params))
    s.add_request(request)
    out = s.schedule()
    assert out.num_draft_tokens == 0  # prefill steps carry no drafts
    s.update_from_output(out, [[prompt[0]]])
    return request


def test_verify_step_schedules_drafts_and_keeps_accepted_tokens_only():
    s = scheduler()
    request = decoding(s, [1, 2, 3, 4, 5, 6, 7])  # first output 1: tail "1" occurs at 0, followed by 2 3 4
    out = s.schedule()
    (sched,) = out.scheduled
    assert sched.spec_token_ids == [2, 3, 4] and out.num_draft_tokens == 3
    assert (sched.start, sched.num_new_tokens, sched.num_sampled) == (7, 4, 4)
    assert len(request.block_ids) == 3  # room for positions 0..10
    # The target accepts 2, rejects 3 and samples 9 instead.
    s.update_from_output(out, [[2, 9]])
    assert request.output_token_ids == [1, 2, 9]
    assert request.num_computed_tokens == 9  # the prompt, 1 and 2; 9 is the next input
    assert len(request.block_ids) == 3  # positions 0..9 need three blocks of 4: nothing to trim here
    # Hashes cover known, computed full blocks only: tokens 0..7 are two full blocks.
    assert len(request.block_hashes) == 2
    stats = s.stats()
    assert (stats.spec_decode_num_drafts_total, stats.spec_decode_num_draft_tokens_total,
            stats.spec_decode_num_accepted_tokens_total) == (1, 3, 1)


def test_rejected_drafts_give_their_blocks_back():
    s = Scheduler(SchedulerConfig(max_model_len=64), BlockManager(16, 2), NgramProposer(3, 1, 3))
    request = decoding(s, [1, 2, 3, 4])  # output 1: drafts 2 3 4 at positions 5..7
    free_before_drafts = s.block_manager.num_free_blocks
    out = s.schedule()
    assert out.scheduled[0].spec_token_ids == [2, 3, 4]
    assert len(request.block_ids) == 4  # positions 0..7 in blocks of 2
    s.update_from_output(out, [[7]])  # every draft rejected
    assert request.num_computed_tokens == 5 and request.num_tokens == 6
    assert len(request.block_ids) == 3  # positions 0..5: the fourth block went back
    assert s.block_manager.num_free_blocks == free_before_drafts - 1
    assert len(request.block_hashes) == 2  # blocks [1 2] [3 4]; [1 7] is not computed yet
    s.update_from_output(s.schedule(), [[8]])  # "7" is new: a plain decode step
    assert len(request.block_hashes) == 3


def test_drafts_stop_at_max_tokens_and_max_model_len():
    s = scheduler()
    decoding(s, [1, 2, 3, 4, 5, 6, 7], max_tokens=3)  # one output token so far: two more allowed
    out = s.schedule()
    assert out.scheduled[0].spec_token_ids == [2]  # the drafted token and the target's own
    s = Scheduler(SchedulerConfig(max_model_len=10), BlockManager(16, 4), NgramProposer(3, 1, 3))
    decoding(s, [1, 2, 3, 4, 5, 6, 7])  # 8 tokens of a 10-token context
    assert s.schedule().scheduled[0].spec_token_ids == [2, 3]


def test_drafts_dropped_rather_than_preempting():
    s = scheduler(num_blocks=2)  # 8 slots: the prompt and one more token, no room for drafts
    request = decoding(s, [1, 2, 3, 4, 5, 6, 7])
    out = s.schedule()
    assert out.num_draft_tokens == 0 and not out.preempted and out.scheduled[0].request is request


def test_acceptance_summaries_and_the_periodic_log(caplog):
    import logging

    from deepserve.engine.core import SpecDecodeLog, acceptance
    from deepserve.engine.scheduler import SchedulerStats

    stats = SchedulerStats(0, 0, 0.0, 0, 0, 0, spec_decode_num_drafts_total=4, spec_decode_num_draft_tokens_total=12,
                           spec_decode_num_accepted_tokens_total=6)
    assert acceptance(stats) == (0.5, 2.5)  # 6 of 12 drafts; (4 + 6) tokens over 4 verify steps
    assert acceptance(SchedulerStats(0, 0, 0.0, 0, 0, 0)) == (0.0, 0.0)
    log = SpecDecodeLog(every=0.0)
    with caplog.at_level(logging.INFO, logger="deepserve.engine.core"):
        log.maybe_log(stats)
    assert "acceptance rate 0.500, mean accepted length 2.50" in caplog.text


def test_ngram_drafts_from_the_kept_array_follow_the_growing_sequence():
    proposer = NgramProposer(2, 1, 2)
    request = Request("r", [1, 2, 3, 1], SamplingParams())
    assert proposer.drafts_for(request, 2) == [2, 3]
    for token in [2, 3, 9] + list(range(100, 160)) + [9]:  # grows past the first buffer
        request.append_output_token(token)
        assert proposer.drafts_for(request, 2) == proposer.propose(request.token_ids, 2)
    assert proposer.drafts_for(request, 2) == [100, 101]
    proposer.forget(request)
    assert not proposer._arrays
