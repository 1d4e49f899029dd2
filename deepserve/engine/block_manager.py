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
  or host blocks, never both; host blocks carry no hash, so their free list is a plain stack.
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

    def __post_init__(self) -> None:
        self.blocks = [KVBlock(i) for i in range(self.num_blocks)]
        self.free_blocks = OrderedDict.fromkeys(range(self.num_blocks))
        self.cached_blocks = {}
        self.free_host_blocks = list(reversed(range(self.num_host_blocks)))

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
        # Prompt logprobs need every prompt position computed, so such requests skip the cache.
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
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

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Make the request's blocks cover its computed tokens plus `num_new_tokens`.

        `computed_blocks` (admission only) are prefix-cache hits to take over first. Returns False
        and changes nothing when there are not enough free blocks."""
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
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
        for _ in range(num_fresh):
            request.block_ids.append(self._take_fresh_block())
        return True

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
        if num == 0 or num > len(self.free_host_blocks):
            return None
        host = [self.free_host_blocks.pop() for _ in range(num)]
        copies = list(zip(request.block_ids[:num], host, strict=True))
        self.free(request)
        request.host_block_ids = host
        return copies

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Fresh GPU blocks for a swapped-out request's kept tokens plus `num_new_tokens`, and its host
        blocks freed; the (host block, gpu block) copies. None, and nothing changed, when GPU blocks lack.
        The host blocks freed here take a swap-out only in a later schedule (a step that preempts admits
        nothing), so its copy runs after these."""
        if not self.allocate_slots(request, num_new_tokens):
            return None
        copies = list(zip(request.host_block_ids, request.block_ids, strict=False))
        self.free_host_blocks.extend(reversed(request.host_block_ids))
        request.host_block_ids = []
        return copies

    def _take_fresh_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) == block_id:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
        block.ref_count = 1
        return block_id
