"""The scheduler: which requests compute how many tokens this step.

One rule for every request (DESIGN.md principle 1): it gets
min(num_tokens - num_computed_tokens, what is left of the token budget) tokens. Running requests
go first, in arrival order, and each leaves one token of budget for every running request behind
it, so a long chunked prefill never starves the decodes. When blocks run out, the latest-arrived
running request is preempted: its blocks are freed and it recomputes later from the front of the
waiting queue — or, with a host tier (--swap-space) that has room, its computed blocks are copied to
host memory and back when it resumes, its num_computed_tokens kept. With prefix caching too, evicted
prefix blocks are kept on the host and a prefix hit there loads them back (BlockManager). Waiting
requests are admitted in arrival order while budget, sequence slots and blocks last, and never in a
step that had to preempt.

Speculative decoding (a proposer given): a decoding request with drafts computes its last token and
the drafts in one step (ScheduledRequest.spec_token_ids), if the blocks for them come without
preempting anyone; the step returns the accepted drafts and one token of the target's, and only their
KV counts as computed (the rejected drafts' blocks are trimmed).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from deepserve.config import SchedulerConfig
from deepserve.engine.block_manager import BlockManager
from deepserve.engine.ngram_proposer import ModelDrafts, NgramProposer
from deepserve.engine.request import Request, RequestStatus, ScheduledRequest, SchedulerOutput


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    num_swapped_out_blocks_total: int = 0  # KV blocks copied to the host tier (--swap-space)
    num_swapped_in_blocks_total: int = 0  # and back
    prefix_cache_host_hits_total: int = 0  # of prefix_cache_hits_total, tokens loaded from the host tier
    prefix_cache_host_stores_total: int = 0  # evicted prefix blocks copied to the host tier
    # Speculative decoding (vLLM's names): verify steps of one request, the draft tokens they checked,
    # and how many of those the target accepted.
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    # Highs since start-up or the last reset_peaks() (W4 reports the peak batch and KV usage of a run)
    peak_num_running: int = 0
    peak_kv_cache_usage: float = 0.0


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 proposer: NgramProposer | ModelDrafts | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.proposer = proposer  # speculative decoding's drafts; None: one token per request and step
        # KV slots reserved past each step's tokens: a model draft writes its own KV there (0 otherwise).
        self.lookahead = proposer.lookahead if proposer is not None else 0
        self.num_spec_drafts = 0
        self.num_spec_draft_tokens = 0
        self.num_spec_accepted_tokens = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of which found
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.prefix_cache_host_hits = 0
        self.prefix_cache_host_stores = 0
        # Swap-out copies of a schedule that ran no step: they go with the next step that runs, before
        # its forward, which is the first thing that can write the GPU blocks they read.
        self._unsent_swap_out: list[tuple[int, int]] = []
        # Unfinished requests whose sampling needs their earlier tokens known (SamplingParams.
        # needs_known_tokens: EngineCore steps one at a time while there are any under async
        # scheduling); counted here so no step has to scan for them.
        self.num_needing_known_tokens = 0
        # Unfinished requests with a grammar, waiting ones included: no step drafts while there is one
        # (_schedule_running).
        self.num_with_grammar = 0
        self.peak_num_running, self.peak_kv_cache_usage = 0, 0.0

    def reset_peaks(self) -> None:
        self.peak_num_running, self.peak_kv_cache_usage = 0, 0.0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.num_needing_known_tokens += request.sampling_params.needs_known_tokens
        self.num_with_grammar += request.grammar is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(blocks_to_swap_out=self._unsent_swap_out)
        self._unsent_swap_out = []
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        if out.is_empty():
            self._unsent_swap_out, out.blocks_to_swap_out = out.blocks_to_swap_out, []
        elif self.block_manager.num_host_blocks:
            self._take_host_copies(out)
        self.peak_num_running = max(self.peak_num_running, len(self.running))
        self.peak_kv_cache_usage = max(self.peak_kv_cache_usage, self.block_manager.usage)
        return out

    def _take_host_copies(self, out: SchedulerOutput) -> None:
        # After the swap-outs: a block stored here may be one a swap-out reads too, never one it writes.
        stores, loads = self.block_manager.take_host_copies()
        out.blocks_to_swap_out.extend(stores)
        out.blocks_to_swap_in.extend(loads)
        self.prefix_cache_host_stores += len(stores)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        # No drafts while a structured-output request is unfinished: its grammar mask covers one sampled
        # row per request (engine/core.py), which verify steps (several rows each) would not match, and a
        # waiting one may be admitted into this very step, behind the running requests' drafts.
        drafting = self.proposer is not None and not self.num_with_grammar
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.reached_length_limit(self.config.max_model_len):
                i += 1  # async scheduling: its last token is on its way and ends it; nothing to compute
                continue
            reserve = len(self.running) - i - 1  # one token for each running request behind this one
            num_new = min(request.num_tokens - request.num_computed_tokens, max(1, budget - reserve))
            if drafting and request.num_tokens - request.num_computed_tokens == 1:
                sched = self._schedule_with_drafts(request, max(1, budget - reserve) - 1)
                if sched is not None:
                    out.scheduled.append(sched)
                    out.num_draft_tokens += len(sched.spec_token_ids)
                    budget -= sched.num_new_tokens
                    i += 1
                    continue
            if not self._allocate_or_preempt(request, num_new + self.lookahead, out):
                break  # the request itself was preempted
            out.scheduled.append(ScheduledRequest(request, num_new, request.num_computed_tokens))
            budget -= num_new
            i += 1
        return budget

    def _schedule_with_drafts(self, request: Request, room: int) -> ScheduledRequest | None:
        """A verify step for a decoding request: its last token and the drafts that follow it, when there
        are drafts and blocks for them without preempting anyone; else None (a plain decode step).
        Drafts never run past max_model_len, nor past what max_tokens lets the request still produce."""
        limit = min(room, self.config.max_model_len - request.num_tokens)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - request.num_output_tokens - 1)
        drafts = self.proposer.drafts_for(request, limit)
        if not drafts or not self.block_manager.allocate_slots(request, 1 + len(drafts) + self.lookahead):
            return None
        return ScheduledRequest(request, 1 + len(drafts), request.num_computed_tokens, spec_token_ids=drafts)

    def _verified(self, request: Request, sched: ScheduledRequest, tokens: list[int]) -> None:
        """Count a verify step's outcome: tokens = the accepted drafts and the target's own next token. The
        KV of the last known token and the accepted drafts is kept; the rejected drafts' slots are given
        back (their blocks freed), so the cache and its hashes hold accepted tokens only."""
        request.num_computed_tokens += len(tokens)
        self.block_manager.trim(request, request.num_computed_tokens + 1 + self.lookahead)
        self.num_spec_drafts += 1
        self.num_spec_draft_tokens += len(sched.spec_token_ids)
        self.num_spec_accepted_tokens += len(tokens) - 1

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.block_manager.allocate_slots(request, num_new):
            victim = self.running.pop()  # the latest arrival goes first
            self._preempt(victim, out)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        deferred: list[Request] = []
        # Never more running requests than budget tokens: each must get at least one token a step.
        max_running = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        while self.waiting and budget > 0 and len(self.running) < max_running:
            request = self.waiting[0]
            if request.wait_for is not None and not _prompt_computed(request.wait_for):
                deferred.append(self.waiting.popleft())
                continue
            num_new = self._admit(request, budget, out)
            if num_new == 0:
                break
            self.waiting.popleft()
            out.scheduled.append(ScheduledRequest(request, num_new, request.num_computed_tokens))
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))

    def _admit(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        """Move the head of the waiting queue to running; the tokens scheduled, or 0 if it must wait.
        A swapped-out request keeps its computed tokens and comes back through the host tier."""
        swapped = bool(request.host_block_ids)
        hits = [] if swapped else self.block_manager.get_computed_blocks(request)
        host_hits = [] if swapped else self.block_manager.get_host_hits(request)
        block_size = self.block_manager.block_size
        num_computed = request.num_computed_tokens if swapped else (len(hits) + len(host_hits)) * block_size
        num_new = request.num_tokens - num_computed
        if num_new > budget and not self.config.enable_chunked_prefill:
            return 0
        num_new = min(num_new, budget)
        if swapped:
            copies = self.block_manager.swap_in(request, num_new + self.lookahead)
            if copies is None:
                return 0
            out.blocks_to_swap_in.extend(copies)
            self.num_swapped_in_blocks += len(copies)
        elif not self.block_manager.allocate_slots(request, num_new + self.lookahead, hits, host_hits):
            return 0
        request.num_computed_tokens = num_computed
        request.status = RequestStatus.RUNNING
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_computed
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_computed
            self.prefix_cache_host_hits += len(host_hits) * block_size
        self.running.append(request)
        return num_new

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        copies = self.block_manager.swap_out(request)
        if copies is None:  # no host tier, or no room in it: recompute
            self.block_manager.free(request)
            request.num_computed_tokens = 0
        else:
            out.blocks_to_swap_out.extend(copies)
            self.num_swapped_out_blocks += len(copies)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def commit(self, out: SchedulerOutput) -> None:
        """Async scheduling: count the step as computed now, before it has run, so the next step can
        be scheduled while this one is on the device. Each token a request samples gets a placeholder
        (Request.append_placeholder), its sampling rows numbered in step order; update_from_output
        (committed=True) fills them in."""
        row = 0
        for sched in out.scheduled:
            request = sched.request
            request.num_computed_tokens += sched.num_new_tokens
            # Blocks whose tokens are all known can be found by the prefix cache from the next
            # schedule on (n > 1 children admitted behind their parent's prompt, shared prefixes):
            # their KV comes from steps queued ahead of any step that could read it.
            self.block_manager.cache_full_blocks(request, request.num_known_tokens)
            if sched.num_sampled == 1:  # every step today
                sched.output_indices = [request.append_placeholder(row)]
            elif sched.num_sampled:
                sched.output_indices = [request.append_placeholder(row + j) for j in range(sched.num_sampled)]
            row += sched.num_sampled

    def update_from_output(self, out: SchedulerOutput, sampled: list[list[int]],
                           committed: bool = False, draft_token_ids: list[list[int]] | None = None) -> list[Request]:
        """Advance the counters by what the step computed (unless `commit` already did) and take each
        request's sampled tokens in order; the requests that gained tokens. A token that ends its
        request drops the ones after it, and a request that finished or was aborted while the step ran
        gets none: `sampled` is trimmed to what each request kept."""
        progressed = []
        for i, (sched, tokens) in enumerate(zip(out.scheduled, sampled, strict=True)):
            request = sched.request
            if request.is_finished:  # aborted, or (async) finished by the step before, while this one ran
                sampled[i] = []
                continue
            if len(tokens) > sched.num_sampled:
                raise ValueError(f"the step returned {len(tokens)} tokens for request {request.request_id!r}, "
                                 f"which was scheduled to sample {sched.num_sampled}")
            if committed:
                # Real tokens into their placeholders before any block is hashed: `commit` already
                # counted them as computed, and a hash over a placeholder would never match again.
                for index, token_id in zip(sched.output_indices, tokens, strict=False):
                    request.set_output_token(index, token_id)
                self.block_manager.cache_full_blocks(request)
            elif sched.spec_token_ids:  # (never async: EngineArgs turns it off under speculation)
                self._verified(request, sched, tokens)  # its blocks are hashed once its tokens are taken
            else:
                request.num_computed_tokens += sched.num_new_tokens
                self.block_manager.cache_full_blocks(request)
            if not tokens:
                continue
            progressed.append(request)
            if draft_token_ids is not None:  # a model draft's proposals for the request's next step
                request.draft_token_ids = draft_token_ids[i]
            was_waiting = request.status == RequestStatus.WAITING  # (async) preempted while in flight
            kept = self._take_tokens(request, sched, tokens, committed)
            if sched.spec_token_ids:
                # Hashes of computed blocks over the tokens kept (a stop may have dropped the last ones).
                self.block_manager.cache_full_blocks(request, request.num_tokens)
            if kept < len(tokens):
                sampled[i] = tokens[:kept]
            if request.is_finished:
                if was_waiting:
                    self.waiting.remove(request)
                self._release(request)
        if any(r.is_finished for r in self.running):
            self.running = [r for r in self.running if not r.is_finished]
        return progressed

    def _take_tokens(self, request: Request, sched: ScheduledRequest, tokens: list[int], committed: bool) -> int:
        """Check the stop rules after each of the step's tokens (appending them first unless committed,
        where they already sit in their placeholders' places); how many the request keeps. Tokens after
        the one that ends it are dropped, placeholders included."""
        max_len = self.config.max_model_len
        if len(tokens) == 1:  # every step today: no per-token loop
            if committed:
                request.check_stop(max_len, sched.output_indices[0])
            else:
                request.append_output_token(tokens[0])
                request.check_stop(max_len)
            return 1
        for j, token_id in enumerate(tokens):
            index = sched.output_indices[j] if committed else None
            if not committed:
                request.append_output_token(token_id)
            if request.check_stop(max_len, index):
                if committed:
                    request.truncate_output(index + 1)
                return j + 1
        return len(tokens)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (abort, stop string); unknown ids are ignored."""
        ended = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.WAITING:
                self.waiting.remove(request)
            else:
                self.running.remove(request)
            request.status = status
            self._release(request)
            ended.append(request)
        return ended

    def _release(self, request: Request) -> None:
        request.drop_placeholders()
        self.block_manager.free(request)
        if self.proposer is not None:
            self.proposer.forget(request)
        if self.requests.pop(request.request_id, None) is not None:
            self.num_needing_known_tokens -= request.sampling_params.needs_known_tokens
            self.num_with_grammar -= request.grammar is not None

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.block_manager.usage,
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries_total=self.prefix_cache_queries,
            prefix_cache_hits_total=self.prefix_cache_hits,
            num_swapped_out_blocks_total=self.num_swapped_out_blocks,
            num_swapped_in_blocks_total=self.num_swapped_in_blocks,
            prefix_cache_host_hits_total=self.prefix_cache_host_hits,
            prefix_cache_host_stores_total=self.prefix_cache_host_stores,
            spec_decode_num_drafts_total=self.num_spec_drafts,
            spec_decode_num_draft_tokens_total=self.num_spec_draft_tokens,
            spec_decode_num_accepted_tokens_total=self.num_spec_accepted_tokens,
            peak_num_running=self.peak_num_running,
            peak_kv_cache_usage=self.peak_kv_cache_usage,
        )


def _prompt_computed(request: Request) -> bool:
    return request.is_finished or request.num_computed_tokens >= request.num_prompt_tokens
