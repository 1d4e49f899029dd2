"""The KV-cache block allocator: ref-counted blocks, prefix caching, an O(1) LRU free list.

Invariants:
- A block is either in use (ref_count > 0) or in `free_blocks`, never both.
- A full, computed block may carry a hash; the hash stays registered in `cached_blocks` while the
  block is free, so a later request with the same prefix can take it back. It is dropped only when
  the block is evicted, i.e. handed out again as a fresh block.
- `free_blocks` is ordered by eviction priority: the front is evicted first. Freed blocks go to the
  back, a request's tail blocks before its head blocks, so shared prefixes outlive private tails.
- A block's hash chains its parent's hash with its own tokens, so equal hashes mean equal prefixes;
  the block also keeps its tokens and they are compared on every hit, so a hash collision can at
  worst miss the cache, never return wrong KV.
- Host tier (--swap-space): a preempted request's computed blocks may move to host blocks
  (`swap_out`) and back into fresh GPU blocks when it resumes (`swap_in`). A request holds GPU blocks
  or host blocks, never both. A host block is free (`free_host_blocks`, a stack that hands out host
  block 0 first, so the low host blocks, whose memory is pinned first at start-up, are used first), held by a
  swapped-out request, or (prefix caching on) a cached prefix block (`host_prefix`).
- Host prefix tier: a cached GPU block that is evicted is copied to a host block with its hash and
  tokens (a "store") instead of being lost, and a lookup that misses on the GPU continues on the host:
  each host hit gets a fresh GPU block and a copy back (a "load"). The host keeps its copy (a block
  evicted again costs no second store). Policy for the shared host space: preempted requests come
  first — a swap-out takes free host blocks, then evicts cached prefix blocks, least recently stored
  or hit first; a store takes a free host block or evicts the least recent prefix block, never a
  request's. The copies go to the scheduler through `take_host_copies`, once per step.
- Copy ordering (the runner makes a step's stores and swap-outs first, then its loads and swap-ins,
  all before its forward): a host block read in a step is neither evicted nor reused in that step
  (`_host_busy` for prefix blocks, `_host_release` for a resumed request's blocks, both cleared by
  `take_host_copies`), so no write of the same step lands on it first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from deepserve.engine.request import Request


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int
    enable_caching: bool = True
    num_host_blocks: int = 0  # 0: no host tier, preemption recomputes
    blocks: list[KVBlock] = field(init=False)
    free_blocks: OrderedDict[int, None] = field(init=False)
    cached_blocks: dict[int, int] = field(init=False)  # block hash -> block id
    free_host_blocks: list[int] = field(init=False)  # popped from the end: host block 0 goes first
    # Host prefix tier, in eviction order (front first): host block -> (hash, tokens); and hash -> host block.
    host_prefix: OrderedDict[int, tuple[int, tuple[int, ...]]] = field(init=False)
    host_cached: dict[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.blocks = [KVBlock(i) for i in range(self.num_blocks)]
        self.free_blocks = OrderedDict.fromkeys(range(self.num_blocks))
        self.cached_blocks = {}
        self.free_host_blocks = list(reversed(range(self.num_host_blocks)))
        self.host_prefix = OrderedDict()
        self.host_cached = {}
        self._stores: list[tuple[int, int]] = []  # (gpu block, host block) copies not yet taken
        self._loads: list[tuple[int, int]] = []  # (host block, gpu block)
        self._host_busy: set[int] = set()  # prefix blocks a pending copy reads or writes: not evictable
        self._host_release: list[int] = []  # a resumed request's host blocks, free once its loads are taken

    @property
    def num_free_host_blocks(self) -> int:
        return len(self.free_host_blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest run of cached full blocks that prefixes the request's tokens.

        At least one token is always left to compute: its logits are needed to sample."""
        if not self._may_hit(request):
            return []
        tokens = request.token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        hits: list[int] = []
        parent_hash: int | None = None
        for i in range(max_blocks):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            block_hash = hash((parent_hash, chunk))
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
            parent_hash = block_hash
        request.block_hashes = [self.blocks[b].block_hash for b in hits]
        return hits

    def get_host_hits(self, request: Request) -> list[int]:
        """Host prefix blocks that continue the GPU hits `get_computed_blocks` just found (their chain
        is in request.block_hashes), verified by tokens; still leaving one token to compute."""
        if not self.host_prefix or not self._may_hit(request):
            return []
        tokens, size = request.token_ids, self.block_size
        parent_hash = request.block_hashes[-1] if request.block_hashes else None
        hits: list[int] = []
        for i in range(len(request.block_hashes), (len(tokens) - 1) // size):
            chunk = tuple(tokens[i * size : (i + 1) * size])
            block_hash = hash((parent_hash, chunk))
            host = self.host_cached.get(block_hash)
            if host is None or self.host_prefix[host][1] != chunk:
                break
            hits.append(host)
            parent_hash = block_hash
        return hits

    def _may_hit(self, request: Request) -> bool:
        # Prompt logprobs need every prompt position computed, so such requests skip the cache.
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int] = (),
                       host_hits: list[int] = ()) -> bool:
        """Make the request's blocks cover its computed tokens plus `num_new_tokens`.

        `computed_blocks` (admission only) are prefix-cache hits to take over first, then `host_hits`
        (get_host_hits), each loaded into a fresh GPU block. Returns False and changes nothing when
        there are not enough free blocks."""
        num_computed = request.num_computed_tokens + (len(computed_blocks) + len(host_hits)) * self.block_size
        held = len(request.block_ids) + len(computed_blocks)
        num_fresh = -(-(num_computed + num_new_tokens) // self.block_size) - held
        if num_fresh <= 0 and not computed_blocks:  # the common decode step: the last block has room
            return True
        num_fresh = max(0, num_fresh)
        # Hits that sit in the free list leave it when taken, so they count against it too.
        num_revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if num_fresh + num_revived > self.num_free_blocks:
            return False
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
            request.block_ids.append(block_id)
        if host_hits:
            self._host_busy.update(host_hits)  # before any eviction below could store over them
        for _ in range(num_fresh):
            request.block_ids.append(self._take_fresh_block())
        if host_hits:
            self._load_host_hits(request, host_hits)
        return True

    def _load_host_hits(self, request: Request, host_hits: list[int]) -> None:
        """The first fresh blocks just taken receive the host hits: a load each, and the hash and tokens
        of the block they hold, so they are GPU prefix-cache blocks from now on."""
        first = len(request.block_hashes)
        for i, host in enumerate(host_hits):
            block = self.blocks[request.block_ids[first + i]]
            block.block_hash, block.token_ids = self.host_prefix[host]
            self.cached_blocks.setdefault(block.block_hash, block.block_id)
            request.block_hashes.append(block.block_hash)
            self.host_prefix.move_to_end(host)  # a hit makes it the most recent
            self._loads.append((host, block.block_id))

    def cache_full_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        """Register the hashes of blocks that became full and computed (call after each step); only
        blocks within the first `num_tokens` tokens (default: the computed ones).

        `request.block_hashes` remembers the chain so far, so each block is hashed once."""
        if not self.enable_caching:
            return
        limit = request.num_computed_tokens if num_tokens is None else min(num_tokens, request.num_computed_tokens)
        num_full = min(limit // self.block_size, len(request.block_ids))
        hashes = request.block_hashes
        if len(hashes) >= num_full:  # most steps fill no block
            return
        for i in range(len(hashes), num_full):
            block = self.blocks[request.block_ids[i]]
            if block.block_hash is None:
                chunk = tuple(request.token_ids[i * self.block_size : (i + 1) * self.block_size])
                block.block_hash = hash((hashes[-1] if hashes else None, chunk))
                block.token_ids = chunk
                # First writer wins: an identical block computed twice in one step stays private.
                self.cached_blocks.setdefault(block.block_hash, block.block_id)
            hashes.append(block.block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, GPU and host, so the next requests compute their prompts in full
        (a benchmark's repeated run measures the same work; vLLM's LLM.reset_prefix_cache). Only with
        no block in use and no host copy pending; False, and nothing changed, otherwise."""
        host_held = self.num_free_host_blocks + len(self.host_prefix) < self.num_host_blocks  # a swapped request's
        if self.num_free_blocks < self.num_blocks or host_held or self._stores or self._loads or self._host_release:
            return False
        for block in self.blocks:
            block.block_hash, block.token_ids = None, ()
        self.cached_blocks.clear()
        self.free_host_blocks.extend(self.host_prefix)
        self.free_host_blocks.sort(reverse=True)  # host block 0 first again (the class docstring)
        self.host_prefix.clear()
        self.host_cached.clear()
        self._host_busy.clear()
        return True

    def free(self, request: Request) -> None:
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        request.block_ids = []
        request.block_hashes = []  # they describe the blocks just released
        self.free_host_blocks.extend(reversed(request.host_block_ids))
        request.host_block_ids = []

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past the first num_tokens tokens (speculative decoding: the slots
        of rejected drafts). Such blocks hold no computed token and carry no hash; they go to the front
        of the free list, as nothing can hit them."""
        keep = -(-num_tokens // self.block_size)
        while len(request.block_ids) > keep:
            block_id = request.block_ids.pop()
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
                self.free_blocks.move_to_end(block_id, last=False)

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the blocks holding the request's computed tokens to host blocks and free its GPU blocks;
        the (gpu block, host block) copies, which must run before those GPU blocks are written again.
        None, and nothing changed, when there is nothing to keep or the host tier lacks room."""
        num = -(-request.num_computed_tokens // self.block_size)
        evictable = len(self.host_prefix) - len(self._host_busy)  # busy blocks are all prefix blocks
        if num == 0 or num > len(self.free_host_blocks) + evictable:
            return None
        host = [self._take_host_block() for _ in range(num)]
        copies = list(zip(request.block_ids[:num], host, strict=True))
        self.free(request)
        request.host_block_ids = host
        return copies

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Fresh GPU blocks for a swapped-out request's kept tokens plus `num_new_tokens`, and its host
        blocks freed; the (host block, gpu block) copies. None, and nothing changed, when GPU blocks lack.
        The host blocks are freed by the next `take_host_copies`, so no copy of this step writes them
        before these loads read them."""
        if not self.allocate_slots(request, num_new_tokens):
            return None
        copies = list(zip(request.host_block_ids, request.block_ids, strict=False))
        self._host_release.extend(reversed(request.host_block_ids))
        request.host_block_ids = []
        return copies

    def take_host_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The host prefix tier's copies decided since the last call, for the step about to run:
        (stores (gpu block, host block), loads (host block, gpu block)). The host blocks they read are
        evictable and reusable again from now on: a later step's copies run after this step's."""
        stores, loads = self._stores, self._loads
        self._stores, self._loads = [], []
        self._host_busy.clear()
        self.free_host_blocks.extend(self._host_release)
        self._host_release = []
        return stores, loads

    def _take_fresh_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) == block_id:
                del self.cached_blocks[block.block_hash]
                if self.num_host_blocks:
                    self._store(block)
            block.block_hash = None
            block.token_ids = ()
        block.ref_count = 1
        return block_id

    def _store(self, block: KVBlock) -> None:
        """Keep an evicted prefix block on the host: a store into a free or evicted host block, unless
        the host holds that hash already, or every host block is a request's or busy."""
        host = self.host_cached.get(block.block_hash)
        if host is not None:
            self.host_prefix.move_to_end(host)
            return
        host = self._take_host_block()
        if host is None:
            return
        self.host_prefix[host] = (block.block_hash, block.token_ids)
        self.host_cached[block.block_hash] = host
        self._host_busy.add(host)  # written this step: no eviction, hence no second write, before it runs
        self._stores.append((block.block_id, host))

    def _take_host_block(self) -> int | None:
        """A free host block, else the least recent prefix block that no pending copy uses; None if neither."""
        if self.free_host_blocks:
            return self.free_host_blocks.pop()
        for host in self.host_prefix:
            if host not in self._host_busy:
                block_hash, _ = self.host_prefix.pop(host)
                del self.host_cached[block_hash]
                return host
        return None
