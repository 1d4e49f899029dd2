"""The host tier of the KV cache (--swap-space): block manager and scheduler bookkeeping, exact ids."""

from __future__ import annotations

from deepserve.config import SchedulerConfig
from deepserve.engine.block_manager import BlockManager
from deepserve.engine.request import Request, RequestStatus
from deepserve.engine.scheduler import Scheduler
from deepserve.sampling_params import SamplingParams


def make_request(rid: str, num_prompt: int, first_token: int = 0) -> Request:
    return Request(rid, list(range(first_token, first_token + num_prompt)),
                   SamplingParams(max_tokens=100, ignore_eos=True))


def test_swap_out_moves_computed_blocks_to_host_and_swap_in_brings_them_back():
    bm = BlockManager(num_blocks=8, block_size=4, num_host_blocks=4)
    req = make_request("r", 10)
    assert bm.allocate_slots(req, 10) and req.block_ids == [0, 1, 2]
    req.num_computed_tokens = 10
    bm.cache_full_blocks(req)
    assert bm.swap_out(req) == [(0, 0), (1, 1), (2, 2)]  # (gpu, host)
    assert req.block_ids == [] and req.host_block_ids == [0, 1, 2] and req.num_computed_tokens == 10
    assert bm.num_free_blocks == 8 and bm.num_free_host_blocks == 1
    # Another request takes GPU blocks meanwhile; the swap-in gets fresh ones, plus room for the next token.
    other = make_request("o", 4, first_token=50)
    assert bm.allocate_slots(other, 4) and other.block_ids == [3]
    assert bm.swap_in(req, 1) == [(0, 4), (1, 5), (2, 6)]  # (host, gpu)
    assert req.block_ids == [4, 5, 6] and req.host_block_ids == []
    # Its host blocks are free once the step's copies are taken (no copy of that step may write them).
    assert bm.num_free_host_blocks == 1
    assert bm.take_host_copies() == ([], []) and bm.num_free_host_blocks == 4


def test_swap_out_needs_room_for_every_block_and_changes_nothing_without_it():
    bm = BlockManager(num_blocks=8, block_size=4, num_host_blocks=2)
    req = make_request("r", 10)
    assert bm.allocate_slots(req, 10)
    req.num_computed_tokens = 10  # three blocks to keep, two host blocks
    assert bm.swap_out(req) is None
    assert req.block_ids == [0, 1, 2] and req.host_block_ids == [] and bm.num_free_host_blocks == 2
    assert BlockManager(num_blocks=8, block_size=4).swap_out(req) is None  # no host tier at all


def test_swap_in_changes_nothing_when_gpu_blocks_lack():
    bm = BlockManager(num_blocks=3, block_size=4, num_host_blocks=4)
    req = make_request("r", 8)
    assert bm.allocate_slots(req, 8)
    req.num_computed_tokens = 8
    assert bm.swap_out(req) == [(0, 0), (1, 1)]
    hog = make_request("h", 8, first_token=50)
    assert bm.allocate_slots(hog, 8)  # 1 GPU block left; the swap-in needs 3 (2 kept + the next token)
    assert bm.swap_in(req, 1) is None
    assert req.block_ids == [] and req.host_block_ids == [0, 1] and bm.num_free_blocks == 1


def test_freeing_a_swapped_out_request_returns_its_host_blocks():
    bm = BlockManager(num_blocks=8, block_size=4, num_host_blocks=4)
    req = make_request("r", 8)
    assert bm.allocate_slots(req, 8)
    req.num_computed_tokens = 8
    bm.swap_out(req)
    bm.free(req)  # aborted while swapped out
    assert req.host_block_ids == [] and bm.num_free_host_blocks == 4 and bm.num_free_blocks == 8


def make_scheduler(num_blocks: int, num_host_blocks: int) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    return Scheduler(config, BlockManager(num_blocks, 4, False, num_host_blocks))


def step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    sched.update_from_output(out, [[token] * s.num_sampled for s in out.scheduled])
    return out, [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def test_preempted_request_swaps_out_and_resumes_without_recompute():
    sched = make_scheduler(num_blocks=5, num_host_blocks=4)
    a, b = make_request("a", 8), make_request("b", 8, first_token=50)
    sched.add_request(a)
    sched.add_request(b)
    assert step(sched)[1] == [("a", 8), ("b", 8)]  # blocks a [0, 1], b [2, 3]
    out, scheduled = step(sched)  # a takes the fifth block; b then needs one: b goes to the host
    assert scheduled == [("a", 1)]
    assert out.blocks_to_swap_out == [(2, 0), (3, 1)] and out.blocks_to_swap_in == []
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 8 and b.host_block_ids == [0, 1]
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out, scheduled = step(sched)
    assert scheduled == [("b", 1)]  # only its sampled token: the prompt's KV came back from the host
    # Into fresh GPU blocks from the front of the free list, the third for b's sampled token.
    assert out.blocks_to_swap_in == [(0, 3), (1, 2)] and b.block_ids == [3, 2, 4]
    stats = sched.stats()
    assert stats.num_swapped_out_blocks_total == 2 and stats.num_swapped_in_blocks_total == 2
    assert stats.num_preemptions_total == 1
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    bm = sched.block_manager
    assert bm.num_free_blocks == 5 and bm.num_free_host_blocks == 4  # no leak


def test_without_host_room_preemption_recomputes():
    sched = make_scheduler(num_blocks=5, num_host_blocks=1)
    a, b = make_request("a", 8), make_request("b", 8, first_token=50)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    out, _ = step(sched)
    assert out.blocks_to_swap_out == [] and b.num_computed_tokens == 0 and b.host_block_ids == []


def test_swap_outs_of_a_step_that_runs_nothing_go_with_the_next_step():
    # A request that outgrows the whole cache preempts itself: no step runs, so its copies wait for the
    # next step that does, ahead of that step's forward (which may write the GPU blocks they read).
    sched = make_scheduler(num_blocks=2, num_host_blocks=4)
    a = make_request("a", 8)
    sched.add_request(a)
    step(sched)
    out = sched.schedule()  # its sampled token needs a third block
    assert out.is_empty() and out.blocks_to_swap_out == [] and a.host_block_ids == [0, 1]
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    sched.add_request(make_request("c", 4, first_token=50))
    out, scheduled = step(sched)
    assert scheduled == [("c", 4)] and out.blocks_to_swap_out == [(0, 0), (1, 1)]
    assert sched.schedule().blocks_to_swap_out == []  # sent once


# The host prefix tier: evicted prefix blocks are stored on the host and loaded back on a hit.

def cached_request(bm: BlockManager, rid: str, num_prompt: int, first_token: int = 0) -> Request:
    """A request whose prompt is computed and whose full blocks are in the prefix cache."""
    req = make_request(rid, num_prompt, first_token)
    assert bm.allocate_slots(req, num_prompt)
    req.num_computed_tokens = num_prompt
    bm.cache_full_blocks(req)
    return req


def test_evicted_prefix_blocks_are_stored_on_the_host_and_loaded_back_on_a_hit():
    bm = BlockManager(num_blocks=4, block_size=4, num_host_blocks=4)
    a = cached_request(bm, "a", 9)  # blocks [0, 1, 2]; 0 and 1 full and hashed
    bm.free(a)  # free list [3, 2, 1, 0]: tails first
    b = make_request("b", 16, first_token=100)
    assert bm.allocate_slots(b, 16) and b.block_ids == [3, 2, 1, 0]
    # Blocks 1 and 0 held a's prefix: stored into host blocks 0 and 1 as they were evicted.
    assert bm.take_host_copies() == ([(1, 0), (0, 1)], [])
    assert list(bm.host_prefix) == [0, 1] and bm.cached_blocks == {}
    bm.free(b)  # b computed nothing: nothing of it is cached; free list [0, 1, 2, 3]
    c = make_request("c", 9)  # a's prompt again
    assert bm.get_computed_blocks(c) == []  # not on the GPU any more
    assert bm.get_host_hits(c) == [1, 0]  # a's block 0 is in host block 1, its block 1 in host block 0
    assert bm.allocate_slots(c, 1, [], [1, 0]) and c.block_ids == [0, 1, 2]
    assert bm.take_host_copies() == ([], [(1, 0), (0, 1)])  # (host, gpu) loads
    # The loaded blocks are GPU prefix blocks again; the host keeps its copies (most recent last).
    assert c.block_hashes == [bm.blocks[0].block_hash, bm.blocks[1].block_hash]
    assert bm.get_computed_blocks(make_request("d", 9)) == [0, 1]
    assert list(bm.host_prefix) == [1, 0] and bm.num_free_host_blocks == 2


def test_a_host_hit_is_verified_by_tokens_and_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=3, block_size=4, num_host_blocks=4)
    bm.free(cached_request(bm, "a", 8))
    assert bm.allocate_slots(make_request("b", 12, first_token=100), 12)  # evicts both of a's blocks
    bm.take_host_copies()
    # a's first block went to host block 1, its second to host block 0.
    assert bm.get_host_hits(make_request("c", 9)) == [1, 0]
    assert bm.get_host_hits(make_request("c", 8)) == [1]  # 8 tokens: the last one must be computed
    other = make_request("d", 9)
    other.token_ids[5] = 99  # the second block differs
    assert bm.get_host_hits(other) == [1]
    assert BlockManager(num_blocks=3, block_size=4, enable_caching=False, num_host_blocks=4).get_host_hits(
        make_request("e", 9)) == []


def test_swap_out_evicts_host_prefix_blocks_least_recent_first_and_stores_never_evict_a_request():
    bm = BlockManager(num_blocks=4, block_size=4, num_host_blocks=3)
    bm.free(cached_request(bm, "a", 12))  # blocks 0, 1, 2 hashed; free list [3, 2, 1, 0]
    hog = make_request("h", 16, first_token=100)
    assert bm.allocate_slots(hog, 16)  # evicts 2, 1, 0: stored into host blocks 0, 1, 2
    assert bm.take_host_copies() == ([(2, 0), (1, 1), (0, 2)], [])
    hog.num_computed_tokens = 8
    # A preempted request takes host blocks before cached prefixes keep them: the least recent go.
    assert bm.swap_out(hog) == [(3, 0), (2, 1)]
    assert list(bm.host_prefix) == [2] and hog.host_block_ids == [0, 1]
    # A store finds no free host block and evicts the last prefix block, never the request's.
    c = cached_request(bm, "c", 4, first_token=200)
    bm.free(c)
    assert bm.allocate_slots(make_request("x", 16, first_token=300), 16)
    stores, _ = bm.take_host_copies()
    assert [h for _, h in stores] == [2] and hog.host_block_ids == [0, 1]


def test_a_host_block_a_step_reads_is_not_overwritten_in_that_step():
    # The step's stores run before its loads, so a host block loaded by a hit must not take a store in the
    # same step: with one host block, the evictions behind the hit store nothing.
    bm = BlockManager(num_blocks=4, block_size=4, num_host_blocks=1)
    bm.free(cached_request(bm, "a", 5))  # block 0 hashed (block 1 is partial); free list [2, 3, 1, 0]
    hog = cached_request(bm, "h", 13, first_token=100)  # takes all four: a's block stored into host 0
    assert bm.take_host_copies() == ([(0, 0)], [])
    bm.free(hog)  # three hashed blocks back in the free list
    c = make_request("c", 5)
    assert bm.get_computed_blocks(c) == [] and bm.get_host_hits(c) == [0]
    assert bm.allocate_slots(c, 1, [], [0])  # two fresh blocks: both evict hashed blocks of the hog
    stores, loads = bm.take_host_copies()
    assert loads == [(0, c.block_ids[0])] and stores == []
    assert list(bm.host_prefix) == [0]
    # From the next step on the host block may be reused: an eviction now stores over it.
    bm.free(c)
    assert bm.allocate_slots(make_request("x", 16, first_token=300), 16)
    stores, _ = bm.take_host_copies()
    assert [h for _, h in stores] == [0]


def test_the_scheduler_sends_host_copies_with_the_step_and_counts_host_hits():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    sched = Scheduler(config, BlockManager(4, 4, True, 4))
    a = make_request("a", 9)
    sched.add_request(a)
    step(sched)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    sched.add_request(make_request("b", 13, first_token=100))
    out, scheduled = step(sched)  # evicts a's two cached blocks
    assert scheduled == [("b", 13)] and out.blocks_to_swap_out == [(1, 0), (0, 1)]
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    c = make_request("c", 9)
    sched.add_request(c)
    out, scheduled = step(sched)
    assert scheduled == [("c", 1)]  # 8 of its 9 prompt tokens loaded from the host
    assert out.blocks_to_swap_in == [(1, c.block_ids[0]), (0, c.block_ids[1])]
    assert c.num_cached_tokens == 8
    stats = sched.stats()
    assert stats.prefix_cache_host_hits_total == 8 and stats.prefix_cache_hits_total == 8
    assert stats.prefix_cache_host_stores_total == 2 + len(out.blocks_to_swap_out)


def test_reset_prefix_cache_empties_the_host_tier_too():
    bm = BlockManager(num_blocks=4, block_size=4, num_host_blocks=4)
    bm.free(cached_request(bm, "a", 9))
    b = make_request("b", 16, first_token=100)
    assert bm.allocate_slots(b, 16)  # evicts a's two prefix blocks to host blocks 0 and 1
    assert not bm.reset_prefix_cache()  # b holds blocks and the stores are pending
    bm.take_host_copies()
    bm.free(b)
    assert bm.reset_prefix_cache()
    assert bm.host_prefix == {} and bm.host_cached == {} and bm.num_free_host_blocks == 4
    assert bm.get_host_hits(make_request("c", 9)) == []
    assert [bm._take_host_block() for _ in range(4)] == [0, 1, 2, 3]  # host block 0 first again
