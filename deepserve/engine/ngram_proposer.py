"""N-gram (prompt lookup) drafts: the tokens that followed an earlier occurrence of the sequence's tail.

For n from prompt_lookup_max down to prompt_lookup_min, the last n tokens are looked for earlier in the
sequence (prompt and output); at the first n that matches, the draft is the (up to) k tokens that
followed the earliest match. Deterministic, so the draft distribution is a point mass on its tokens,
which is what the rejection sampler's acceptance rule assumes (layers/rejection_sampler.py).
"""

from __future__ import annotations

import numpy as np

from deepserve.engine.request import Request


class NgramProposer:
    lookahead = 0  # KV slots past a step's tokens that drafting needs (ModelDrafts: k)

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        # Each running request's tokens as an array, extended by the tokens since its last proposal:
        # converting a 1,000-token list anew took ~75-140 us a proposal on a 2-core machine, the search ~2.
        self._arrays: dict[int, tuple[np.ndarray, int]] = {}  # Request.serial -> (buffer, tokens in it)

    def drafts_for(self, request: Request, limit: int) -> list[int]:
        return self.propose(request.token_ids, limit, self._array(request))

    def forget(self, request: Request) -> None:
        self._arrays.pop(request.serial, None)

    def _array(self, request: Request) -> np.ndarray:
        ids = request.token_ids
        buf, n = self._arrays.get(request.serial, (None, 0))
        if buf is None or n > len(ids) or len(ids) > buf.size:  # new, shortened (never expected), or full
            old = buf
            buf = np.empty(max(64, 2 * len(ids)), dtype=np.int64)
            if old is not None and n <= len(ids):
                buf[:n] = old[:n]
            else:
                n = 0
        buf[n: len(ids)] = ids[n:]
        self._arrays[request.serial] = (buf, len(ids))
        return buf[: len(ids)]

    def propose(self, token_ids: list[int], max_tokens: int, tokens: np.ndarray | None = None) -> list[int]:
        """At most min(k, max_tokens) draft tokens to follow token_ids ([] when no n-gram matches); tokens:
        the same as an int64 array, if the caller has one."""
        limit = min(self.k, max_tokens)
        length = len(token_ids)
        if limit <= 0 or length <= self.min_n:
            return []
        if tokens is None:
            tokens = np.asarray(token_ids, dtype=np.int64)
        # Earlier positions holding the last token (each followed by at least one token): one pass over
        # the sequence; the longer tails are then checked on these few candidates only.
        ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            hits = ends[ends >= n - 1]
            for back in range(1, n):
                hits = hits[tokens[hits - back] == tokens[length - 1 - back]]
            if hits.size:
                start = int(hits[0]) + 1
                return token_ids[start: start + limit]
        return []


class ModelDrafts:
    """Drafts a model proposed in the runner (DeepSeek's MTP layer), handed back with the step's tokens
    (RunnerOutput.draft_token_ids) and kept on the request until its next step. The runner drafts k
    positions past the step's last token, writing the draft layer's KV there: `lookahead` slots that
    every allocation reserves."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = self.lookahead = num_speculative_tokens

    def forget(self, request: Request) -> None:
        pass

    def drafts_for(self, request: Request, limit: int) -> list[int]:
        drafts, request.draft_token_ids = request.draft_token_ids, []
        return drafts[:max(0, limit)]
