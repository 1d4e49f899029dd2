"""N-gram (prompt lookup) drafts: the tokens that followed an earlier occurrence of the sequence's tail.

For n from prompt_lookup_max down to prompt_lookup_min, the last n tokens are looked for earlier in the
sequence (prompt and output); at the first n that matches, the draft is the (up to) k tokens that
followed the earliest match. Deterministic, so the draft distribution is a point mass on its tokens,
which is what the rejection sampler's acceptance rule assumes (layers/rejection_sampler.py).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from deepserve.engine.request import Request


class NgramProposer:
    lookahead = 0  # KV slots past a step's tokens that drafting needs (ModelDrafts: k)

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def drafts_for(self, request: Request, limit: int) -> list[int]:
        return self.propose(request.token_ids, limit)

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """At most min(k, max_tokens) draft tokens to follow token_ids; [] when no n-gram matches."""
        limit = min(self.k, max_tokens)
        length = len(token_ids)
        if limit <= 0 or length <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows that start at 0 .. length - 1 - n: each is followed by at least one token, and the
            # tail itself (starting at length - n) is not among them.
            windows = sliding_window_view(tokens[: length - 1], n)  # [length - n, n]
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n
                return token_ids[start: start + limit]
        return []


class ModelDrafts:
    """Drafts a model proposed in the runner (DeepSeek's MTP layer), handed back with the step's tokens
    (RunnerOutput.draft_token_ids) and kept on the request until its next step. The runner drafts k
    positions past the step's last token, writing the draft layer's KV there: `lookahead` slots that
    every allocation reserves."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = self.lookahead = num_speculative_tokens

    def drafts_for(self, request: Request, limit: int) -> list[int]:
        drafts, request.draft_token_ids = request.draft_token_ids, []
        return drafts[:max(0, limit)]
