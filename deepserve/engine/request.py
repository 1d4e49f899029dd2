"""A request inside the engine: `num_computed_tokens` chasing `num_tokens`.

Invariant: token_ids == prompt_token_ids + output_token_ids, and the KV cache holds exactly
token_ids[:num_computed_tokens]. Each step the scheduler picks how many of the remaining
num_tokens - num_computed_tokens to compute; once they are all computed, the step samples one
more token, which makes num_tokens grow by one. Prefill, chunked prefill, prefix-cache hits,
decode and recompute after preemption are all this one rule. Under speculative decoding a decoding
request's step also computes draft tokens (ScheduledRequest.spec_token_ids) and may gain several tokens.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepserve.engine.grammar import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    def __init__(self, value: str) -> None:
        # A plain attribute, not a property over `.value`: the scheduler asks every running request
        # several times a step (enum's `.value` is a descriptor call; ~15 % of the core's host time
        # under cProfile at batch 256, bench/core_host_cost.py).
        self.finished = value in ("stop", "length", "abort")


logger = logging.getLogger(__name__)
_serials = itertools.count()


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
        wait_for: Request | None = None,
    ) -> None:
        self.request_id = request_id
        # Unique in this process for its whole life, unlike request_id, which a caller may reuse once
        # the request has finished: state kept per request across steps is keyed by this.
        self.serial = next(_serials)
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        self.token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache on first admission
        self.num_preemptions = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full computed blocks, in order
        # Swapped out (--swap-space): the host blocks holding KV of token_ids[:num_computed_tokens]; then
        # block_ids is empty (BlockManager.swap_out).
        self.host_block_ids: list[int] = []
        self.stop_reason: int | str | None = None
        # Sibling whose prompt must be computed before this one is admitted, so that n > 1
        # completions share the prompt's cached blocks instead of computing them n times.
        self.wait_for = wait_for
        # Prompt logprobs computed so far, one entry per prompt token 1..P-1: [(token_id, logprob, rank),
        # ...] with the actual token first; the runner skips positions already here after a recompute.
        self.prompt_logprobs: list[list[tuple[int, float, int]]] = []
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        # Structured output: the matcher, advanced by every output token in check_stop. It lives with the
        # request, not with its KV blocks, so preemption (recompute or swap) keeps it as it is: the
        # tokens it has seen are still the request's output.
        self.grammar: GrammarState | None = None
        # Speculative decoding with a model draft (MTP): the drafts its last step proposed for the next.
        self.draft_token_ids: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_output_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def check_stop(self, max_model_len: int, index: int | None = None) -> bool:
        """Apply the token-level stop rules to output token `index` (default: the last); True when
        finished. Under async scheduling a placeholder for the next step's token may already follow
        it (the scheduler's release of a finished request drops it).

        Stop strings need detokenized text and are applied by the output processor."""
        params = self.sampling_params
        index = self.num_output_tokens - 1 if index is None else index
        last, count = self.output_token_ids[index], index + 1
        if self.grammar is not None and self._grammar_ends(last):
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if count >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
            elif last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
        max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len
        if not self.is_finished and (count >= max_tokens or self.num_prompt_tokens + count >= max_model_len):
            self.status = RequestStatus.FINISHED_LENGTH
        return self.is_finished

    def grammar_consumes(self, token_id: int) -> bool:
        """Whether the token goes to the grammar: EOS does not; it is left to the eos rule (the mask
        allowed it only where the grammar accepts; with ignore_eos the output goes on, still constrained).
        The one rule for check_stop and the async feed-ahead (EngineCore)."""
        return token_id not in self.eos_token_ids

    def _grammar_ends(self, token_id: int) -> bool:
        """Feed the token to the grammar; True when the output is complete (the grammar admits nothing
        more) or the grammar refused the token (grammar_consumes says which tokens it sees)."""
        if not self.grammar_consumes(token_id):
            return False
        if not self.grammar.accept(token_id):
            logger.warning("request %s: the grammar refused token %d (%s); ending it", self.request_id, token_id,
                           self.grammar.error)
            return True
        return self.grammar.is_finished

    # Async scheduling (EngineCore): a step is scheduled before the previous step's tokens reach the
    # host. Each token still on its way is a placeholder, -(row + 1), where row is its row in the
    # previous step's sampled tensor; the runner reads it from there on the device, and the scheduler
    # puts the real token in its place once the host has it.

    def append_placeholder(self, row: int) -> int:
        """Append the placeholder of a token being sampled in sampling row `row`; its output index."""
        self.append_output_token(-(row + 1))
        return self.num_output_tokens - 1

    def set_output_token(self, index: int, token_id: int) -> None:
        self.output_token_ids[index] = token_id
        self.token_ids[self.num_prompt_tokens + index] = token_id

    @property
    def num_known_tokens(self) -> int:
        """Tokens before the first placeholder (placeholders only ever sit at the end)."""
        known = self.num_tokens
        while known > self.num_prompt_tokens and self.token_ids[known - 1] < 0:
            known -= 1
        return known

    def truncate_output(self, num_output: int) -> None:
        """Keep the first num_output output tokens (a stop inside a step's several tokens)."""
        del self.output_token_ids[num_output:]
        del self.token_ids[self.num_prompt_tokens + num_output:]

    def drop_placeholders(self) -> None:
        """Forget tokens still on their way (a request ended while a step for it ran)."""
        while self.output_token_ids and self.output_token_ids[-1] < 0:
            self.output_token_ids.pop()
            self.token_ids.pop()

    def reached_length_limit(self, max_model_len: int) -> bool:
        """True when the tokens so far (placeholders included) already end the request on length,
        so scheduling another step for it would be wasted."""
        max_tokens = self.sampling_params.max_tokens
        return ((max_tokens is not None and self.num_output_tokens >= max_tokens)
                or self.num_tokens >= max_model_len)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens}, blocks={self.block_ids})"
        )


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute token_ids[start:start+num_new_tokens], then sample
    num_sampled tokens. The step's result for it is a list of tokens (RunnerOutput.sampled), which
    may be shorter: a token that ends the request drops the rest."""

    request: Request
    num_new_tokens: int
    start: int  # == request.num_computed_tokens when scheduled
    # 1 when this chunk reaches the end of the known tokens, so the step samples the next token; 0 for
    # a prefill chunk short of it. Fixed when scheduled: under async scheduling the request gains a
    # placeholder per sampled token right after.
    num_sampled: int = field(init=False)
    output_indices: list[int] = field(default_factory=list)  # async scheduling: the placeholders' output indices
    # Speculative decoding: draft tokens that follow the request's last known token. The step computes
    # that token and the drafts (num_new_tokens = 1 + len), and samples at each of those positions:
    # the drafts the target agrees with are kept, then one token of its own (RunnerOutput.sampled
    # holds 1 .. len + 1 tokens). The drafts are not in request.token_ids.
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_sampled = int(self.start + self.num_new_tokens == self.request.num_tokens)
        if self.spec_token_ids:
            self.num_sampled = len(self.spec_token_ids) + 1


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Host tier (--swap-space): KV block copies the runner makes before the step's forward, all swap-outs
    # first (a swap-in's fresh GPU block may be one a swap-out is still to read; a host block a swap-out
    # writes may be one a swap-in reads). Swap-outs: preempted requests' blocks, then prefix blocks evicted
    # from the GPU (stores); swap-ins: resumed requests' blocks, then host prefix hits (loads).
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, host block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, gpu block)
    # Structured output (engine/grammar.py): the allowed-token bitmask of each sampling row, in the order
    # of `scheduled` (rows that sample nothing skipped), ceil(V / 32) little-endian 32-bit words a row;
    # None when no scheduled request has a grammar, so unconstrained steps carry nothing. EngineCore sets
    # a function that computes them: the runner calls it once the step's forward is queued, so the host
    # builds the masks while the device runs the forward (rank 0 alone samples; no worker sees it).
    grammar_bitmask: Callable[[], bytes | bytearray] | None = None
    # Speculative decoding: draft tokens in the step (sum of len(spec_token_ids)); 0: no verify rows,
    # the runner samples one token per request as usual.
    num_draft_tokens: int = 0

    def is_empty(self) -> bool:
        return not self.scheduled
