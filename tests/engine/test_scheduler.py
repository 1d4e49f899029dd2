"""The scheduler: token budgets, chunked prefill, decode priority, preemption order."""

from __future__ import annotations

import pytest

from deepserve.config import SchedulerConfig
from deepserve.engine.block_manager import BlockManager
from deepserve.engine.request import Request, RequestStatus
from deepserve.engine.scheduler import Scheduler
from deepserve.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, block_size=4, budget=64, max_seqs=8, chunked=True, caching=True):
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=64,
                             enable_chunked_prefill=chunked)
    return Scheduler(config, BlockManager(num_blocks, block_size, caching))


def add(sched: Scheduler, rid: str, num_prompt: int, max_tokens: int = 100, first_token: int = 0) -> Request:
    req = Request(rid, list(range(first_token, first_token + num_prompt)),
                  SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    sched.add_request(req)
    return req


def step(sched: Scheduler, token: int = 7) -> list[tuple[str, int]]:
    """One step where every sampling request samples `token`; returns (id, num_new_tokens)."""
    out = sched.schedule()
    sched.update_from_output(out, [[token] * s.num_sampled for s in out.scheduled])
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def test_prefill_then_decode_is_one_rule():
    sched = make_scheduler()
    a = add(sched, "a", 10)
    assert step(sched) == [("a", 10)]
    assert a.num_computed_tokens == 10 and a.output_token_ids == [7]
    assert step(sched) == [("a", 1)]
    assert a.num_tokens == 12 and a.num_computed_tokens == 11


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_at_the_end():
    sched = make_scheduler(budget=8)
    a = add(sched, "a", 20)
    assert step(sched) == [("a", 8)]
    assert step(sched) == [("a", 8)]
    assert a.output_token_ids == []
    assert step(sched) == [("a", 4)]
    assert a.output_token_ids == [7]


def test_running_decodes_are_not_starved_by_a_long_prefill():
    sched = make_scheduler(budget=8)
    add(sched, "a", 3)
    add(sched, "b", 3)
    assert step(sched) == [("a", 3), ("b", 3)]
    add(sched, "c", 30)
    assert step(sched) == [("a", 1), ("b", 1), ("c", 6)]
    # c is running now; it is first in no way: a and b still decode every step.
    assert step(sched) == [("a", 1), ("b", 1), ("c", 6)]


def test_a_prefill_chunk_leaves_room_for_the_decodes_behind_it():
    sched = make_scheduler(budget=8)
    add(sched, "a", 20)
    assert step(sched) == [("a", 8)]
    add(sched, "b", 2)
    add(sched, "c", 2)
    assert step(sched) == [("a", 8)]  # waiting requests only get what running ones leave
    # b and c cannot be admitted while a takes the budget; once a decodes they come in.
    assert step(sched) == [("a", 4), ("b", 2), ("c", 2)]
    assert step(sched) == [("a", 1), ("b", 1), ("c", 1)]


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    sched = make_scheduler(budget=64, chunked=False)
    add(sched, "a", 40)
    add(sched, "b", 40, first_token=100)
    assert step(sched) == [("a", 40)]  # b's 40 tokens do not fit the 24 left, and may not be split
    assert step(sched) == [("a", 1), ("b", 40)]


def test_prefix_hit_shrinks_what_an_unchunked_prompt_needs():
    sched = make_scheduler(budget=64, chunked=False)
    add(sched, "a", 40)
    add(sched, "b", 40)  # the same prompt: 9 full blocks come from a's cache once a computed them
    assert step(sched) == [("a", 40)]
    assert step(sched) == [("a", 1), ("b", 4)]


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_seqs=2)
    for rid in "abc":
        add(sched, rid, 2)
    assert step(sched) == [("a", 2), ("b", 2)]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_preemption_takes_the_latest_arrival_and_it_recomputes_first():
    # 5 blocks of 4 tokens. a and b take 2 blocks each for their 8-token prompts.
    sched = make_scheduler(num_blocks=5, block_size=4, caching=False)
    a = add(sched, "a", 8)
    b = add(sched, "b", 8, first_token=50)
    assert step(sched) == [("a", 8), ("b", 8)]  # 4 blocks used, 1 free
    # Each decode now needs a fifth block: a takes the last one; b, the latest, is preempted.
    assert step(sched) == [("a", 1)]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.num_preemptions_total == 1
    assert [r.request_id for r in sched.waiting] == ["b"]
    assert a.num_computed_tokens == 9
    assert a.block_ids == [0, 1, 4]
    # b comes back when a finishes and frees its blocks, recomputing prompt + its one output token.
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert step(sched) == [("b", 9)]


def test_preempting_others_lets_the_earliest_request_continue():
    sched = make_scheduler(num_blocks=4, block_size=4, caching=False)
    a = add(sched, "a", 4)
    b = add(sched, "b", 4, first_token=50)
    c = add(sched, "c", 4, first_token=90)
    assert step(sched) == [("a", 4), ("b", 4), ("c", 4)]  # 3 blocks used, 1 free
    assert step(sched) == [("a", 1), ("b", 1)]  # a takes the free block; b needs one: c goes
    assert c.status == RequestStatus.WAITING and b.status == RequestStatus.RUNNING
    assert a.block_ids == [0, 3] and b.block_ids == [1, 2]  # b took the block c gave back
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_finish_on_max_tokens_frees_blocks():
    sched = make_scheduler()
    a = add(sched, "a", 4, max_tokens=2)
    step(sched)
    step(sched)
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == [7, 7]
    assert sched.block_manager.num_free_blocks == 64
    assert not sched.has_unfinished_requests()


def test_abort_waiting_and_running():
    sched = make_scheduler(max_seqs=1)
    a = add(sched, "a", 4)
    b = add(sched, "b", 4)
    step(sched)
    ended = sched.finish_requests(["a", "b", "nope"], RequestStatus.FINISHED_ABORTED)
    assert ended == [a, b]
    assert not sched.running and not sched.waiting
    assert sched.block_manager.num_free_blocks == 64


def test_sibling_waits_for_the_first_prompt_then_shares_its_blocks():
    sched = make_scheduler(block_size=4)
    first = add(sched, "0_x", 9)
    second = Request("1_x", list(range(9)), SamplingParams(max_tokens=5, ignore_eos=True), wait_for=first)
    sched.add_request(second)
    other = add(sched, "y", 3, first_token=50)
    assert step(sched) == [("0_x", 9), ("y", 3)]  # the sibling waits, the queue behind it moves
    assert step(sched) == [("0_x", 1), ("y", 1), ("1_x", 1)]  # 8 prompt tokens from the cache
    assert second.block_ids[:2] == first.block_ids[:2]
    assert second.num_cached_tokens == 8
    assert other.num_computed_tokens == 4


def test_stats_count_prefix_hits_in_tokens():
    sched = make_scheduler(block_size=4)
    add(sched, "a", 9)
    step(sched)
    add(sched, "b", 9)
    step(sched)
    stats = sched.stats()
    assert stats.prefix_cache_queries_total == 18 and stats.prefix_cache_hits_total == 8
    assert stats.num_running == 2


def test_never_more_running_requests_than_budget_tokens():
    sched = make_scheduler(budget=2, max_seqs=8)
    for rid in "abcd":
        add(sched, rid, 1)
    assert step(sched) == [("a", 1), ("b", 1)]
    # a and b decode; c and d wait instead of starving behind them.
    assert step(sched) == [("a", 1), ("b", 1)]
    assert [r.request_id for r in sched.waiting] == ["c", "d"]


def test_a_step_may_return_several_tokens_and_a_stop_drops_the_rest():
    # The step contract carries a list of tokens per request (speculative decoding will return up to
    # k + 1): they are taken in order, and one that ends the request drops those after it.
    sched = make_scheduler()
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=100, stop_token_ids=[99]))
    sched.add_request(req)
    step(sched, token=5)  # the prompt, then its first token
    out = sched.schedule()
    out.scheduled[0].num_sampled = 3  # as a speculative step will schedule it
    sampled = [[6, 7, 8]]
    assert sched.update_from_output(out, sampled) == [req]
    assert req.output_token_ids == [5, 6, 7, 8] and req.num_tokens == 7 and not req.is_finished
    out = sched.schedule()
    out.scheduled[0].num_sampled = 4
    sampled = [[9, 99, 10, 11]]
    sched.update_from_output(out, sampled)
    assert sampled == [[9, 99]], "the tokens after the stop token are dropped from the step's result"
    assert req.output_token_ids == [5, 6, 7, 8, 9, 99] and req.is_finished and req.stop_reason == 99
    assert not sched.running and not sched.block_manager.usage


def test_a_finished_request_takes_none_of_a_steps_tokens():
    sched = make_scheduler()
    req = add(sched, "r", 3)
    out = sched.schedule()
    sched.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)  # aborted while the step ran
    sampled = [[4, 5]]
    assert sched.update_from_output(out, sampled) == [] and sampled == [[]] and req.output_token_ids == []


def test_more_tokens_than_scheduled_is_refused():
    sched = make_scheduler()
    add(sched, "r", 3)
    out = sched.schedule()
    with pytest.raises(ValueError, match="returned 2 tokens for request 'r', which was scheduled to sample 1"):
        sched.update_from_output(out, [[4, 5]])


def test_committed_tokens_fill_their_placeholders_and_a_stop_drops_the_rest():
    sched = make_scheduler()
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=100, stop_token_ids=[99]))
    sched.add_request(req)
    out = sched.schedule()
    out.scheduled[0].num_sampled = 3
    sched.commit(out)
    assert req.output_token_ids == [-1, -2, -3] and out.scheduled[0].output_indices == [0, 1, 2]
    sampled = [[9, 99, 10]]
    sched.update_from_output(out, sampled, committed=True)
    assert sampled == [[9, 99]] and req.output_token_ids == [9, 99] and req.token_ids == [1, 2, 3, 9, 99]
    assert req.is_finished and not sched.running


def run_async(sched: Scheduler, first_token: int = 100) -> None:
    """Drive the scheduler as the async engine does: schedule and commit step n+1, then fill step n."""
    inflight, token = None, first_token
    while sched.has_unfinished_requests() or inflight is not None:
        out = sched.schedule()
        if not out.is_empty():
            sched.commit(out)
        if inflight is not None:
            sched.update_from_output(inflight, [[token] * s.num_sampled for s in inflight.scheduled], committed=True)
            token += 1
        inflight = None if out.is_empty() else out


def test_blocks_of_generated_tokens_are_cached_under_async_scheduling():
    # A follow-up prompt that repeats prompt + output (a chat's next turn) finds every full block of it.
    # Hashing a block before its placeholder got the real token (a mistake made once) found 4 of 16.
    sched = make_scheduler(block_size=4)
    req = Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=12, ignore_eos=True))
    sched.add_request(req)
    run_async(sched)
    history = req.prompt_token_ids + req.output_token_ids
    assert len(history) == 17 and all(t >= 0 for t in history)
    follow_up = Request("r2", history + [7], SamplingParams(max_tokens=1, ignore_eos=True))
    sched.add_request(follow_up)
    sched.schedule()
    assert follow_up.num_cached_tokens == 16
