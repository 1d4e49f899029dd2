"""The block allocator: exact block ids, prefix hits verified by tokens, eviction order."""

from __future__ import annotations

from deepserve.engine.block_manager import BlockManager
from deepserve.engine.request import Request
from deepserve.sampling_params import SamplingParams


def make_request(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, tokens, SamplingParams())


def compute_all(bm: BlockManager, req: Request, hits: list[int] = ()) -> None:
    """Admit `req` with its hits and mark every token computed, as a finished prefill would."""
    num_hit_tokens = len(hits) * bm.block_size
    assert bm.allocate_slots(req, req.num_tokens - num_hit_tokens, hits)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)


def test_fresh_blocks_come_in_order_and_are_counted():
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make_request(list(range(10)))  # 10 tokens -> 3 blocks
    assert bm.allocate_slots(req, 10)
    assert req.block_ids == [0, 1, 2]
    assert bm.num_free_blocks == 5
    # Growing by one token inside the last block takes nothing; crossing into a new block takes one.
    req.num_computed_tokens = 10
    assert bm.allocate_slots(req, 2) and req.block_ids == [0, 1, 2]
    assert bm.allocate_slots(req, 3) and req.block_ids == [0, 1, 2, 3]


def test_allocation_fails_without_side_effects():
    bm = BlockManager(num_blocks=2, block_size=4)
    req = make_request(list(range(12)))
    assert not bm.allocate_slots(req, 12)
    assert req.block_ids == [] and bm.num_free_blocks == 2


def test_prefix_hit_reuses_full_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = make_request(list(range(9)), "a")  # blocks [0 1 2], two of them full
    compute_all(bm, first)
    second = make_request(list(range(8)) + [99, 98], "b")
    hits = bm.get_computed_blocks(second)
    assert hits == [0, 1]
    compute_all(bm, second, hits)
    assert second.block_ids == [0, 1, 3]
    assert bm.blocks[0].ref_count == 2 and bm.blocks[1].ref_count == 2
    # A prompt that is exactly two cached blocks still computes its last token itself.
    exact = make_request(list(range(8)), "c")
    assert bm.get_computed_blocks(exact) == [0]


def test_hit_requires_the_whole_prefix_to_match():
    bm = BlockManager(num_blocks=8, block_size=4)
    compute_all(bm, make_request([1, 2, 3, 4, 5, 6, 7, 8, 9], "a"))
    # Same second block, different first block: the chained hash differs, so no hit at all.
    assert bm.get_computed_blocks(make_request([0, 2, 3, 4, 5, 6, 7, 8, 9], "b")) == []


def test_hash_collision_is_caught_by_token_check():
    bm = BlockManager(num_blocks=8, block_size=2)
    req = make_request([5, 6, 7], "a")
    compute_all(bm, req)
    # Corrupt the stored tokens as a colliding block would look: same hash, other tokens.
    bm.blocks[req.block_ids[0]].token_ids = (9, 9)
    assert bm.get_computed_blocks(make_request([5, 6, 7], "b")) == []


def test_freed_cached_blocks_are_revived_then_evicted_lru_tail_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request([1, 2, 3, 4, 5], "a")  # blocks 0 1 2; 0 and 1 full and cached
    compute_all(bm, a)
    bm.free(a)
    # Free list order: 3 (never used), then a's blocks tail first: 2, 1, 0.
    assert list(bm.free_blocks) == [3, 2, 1, 0]
    b = make_request([1, 2, 3, 4, 7], "b")
    hits = bm.get_computed_blocks(b)
    assert hits == [0, 1]
    compute_all(bm, b, hits)
    assert b.block_ids == [0, 1, 3]  # revived 0 and 1, fresh block from the front: 3
    bm.free(b)
    assert list(bm.free_blocks) == [2, 3, 1, 0]
    # A new unrelated request evicts from the front: 2, then 3; block 1's hash survives until taken.
    c = make_request([8, 8, 8, 8, 8], "c")
    assert bm.allocate_slots(c, 5)
    assert c.block_ids == [2, 3, 1]
    assert bm.blocks[1].block_hash is None  # evicted: hash dropped
    assert bm.get_computed_blocks(make_request([1, 2, 3, 4, 0], "d")) == [0]


def test_usage_and_disabled_caching():
    bm = BlockManager(num_blocks=4, block_size=2, enable_caching=False)
    a = make_request([1, 2, 3], "a")
    compute_all(bm, a)
    assert bm.usage == 0.5
    bm.free(a)
    assert bm.get_computed_blocks(make_request([1, 2, 3], "b")) == []
    assert bm.cached_blocks == {}


def test_freeing_forgets_the_hash_chain_so_a_recompute_registers_again():
    bm = BlockManager(num_blocks=8, block_size=2)
    req = make_request([1, 2, 3, 4, 5], "a")
    compute_all(bm, req)
    assert len(req.block_hashes) == 2
    bm.free(req)  # as a preemption does
    assert req.block_hashes == [] and req.block_ids == []


def test_reset_prefix_cache_forgets_every_prefix_but_only_when_no_block_is_in_use():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = make_request(list(range(9)), "a")
    compute_all(bm, first)
    assert not bm.reset_prefix_cache()  # a's blocks are in use: refused, nothing changed
    assert bm.get_computed_blocks(make_request(list(range(9)), "b")) == [0, 1]
    bm.free(first)
    assert bm.reset_prefix_cache()
    assert bm.cached_blocks == {} and all(b.block_hash is None and not b.token_ids for b in bm.blocks)
    assert bm.get_computed_blocks(make_request(list(range(9)), "c")) == []
    assert bm.num_free_blocks == 8
