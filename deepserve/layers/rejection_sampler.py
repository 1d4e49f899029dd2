"""Verification of draft tokens (speculative decoding) that keeps the target's distribution exactly.

A verify step gives the sampler one row per position of a request's last known token and its drafts:
row j holds the target's logits after draft j - 1 and the draft d_j proposed for that position (none
on the last row). Rows are processed as the plain sampler would (min_tokens, penalties; greedy rows
take the argmax; random rows temperature, min_p, top_k, top_p) into the target distribution p_j, then:

- greedy row: the draft is accepted iff it is the argmax; the row's own token is the argmax.
- random row: the drafts are deterministic (n-gram, a greedy MTP head), so the draft distribution is a
  point mass on d_j and the speculative-sampling rule reduces to: accept d_j with probability
  p_j(d_j); else draw from p_j with d_j removed, renormalised. The emitted token then has law
  p_j(d_j) [t = d_j] + (1 - p_j(d_j)) p_j(t) [t != d_j] / (1 - p_j(d_j)) = p_j(t): exactly the target's.

A request keeps drafts up to its first rejection and then that row's own token (or, all accepted, the
last row's). Seeded rows draw their uniform and their exponentials from the row's own generator, seeded
by (seed, output tokens before the row) as the plain sampler's, so a seeded request replays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from deepserve.layers.sampler import (
    _exponential,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    compute_token_logprobs,
    target_probs,
)
from deepserve.layers.sampling_metadata import SamplingMetadata


def target_probability(p_draft: torch.Tensor) -> torch.Tensor:
    """The lossless acceptance probability of a point-mass draft: the target's probability of it."""
    return p_draft


@dataclass
class VerifyOutput:
    # The token each row emits if the request gets that far: its draft where accepted, else the
    # target's own (the argmax, or a draw from the residual distribution).
    chosen: torch.Tensor  # [S] int64
    accepted: torch.Tensor  # [S] bool; False on rows without a draft
    logprob_token_ids: torch.Tensor | None = None  # [S, K+1] int64, column 0 = chosen
    logprobs: torch.Tensor | None = None  # [S, K+1] float32
    ranks: torch.Tensor | None = None  # [S] int64


class RejectionSampler(nn.Module):
    def __init__(self, acceptance_probability: Callable[[torch.Tensor], torch.Tensor] = target_probability) -> None:
        """acceptance_probability maps the target's probability of each draft [S] to the probability of
        accepting it; anything but the default biases the output (the distribution test injects one)."""
        super().__init__()
        self.acceptance_probability = acceptance_probability

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata, draft_ids: torch.Tensor) -> VerifyOutput:
        """logits [S, V] (model dtype), draft_ids [S] int64 with -1 where a row has no draft."""
        x = apply_penalties(apply_min_tokens(apply_logit_bias(logits.float(), meta), meta), meta)  # [S, V]
        has_draft = draft_ids >= 0  # [S]
        drafts = draft_ids.clamp(min=0)[:, None]  # [S, 1]
        greedy = None if meta.all_random else x.argmax(dim=-1)  # [S]
        if meta.all_greedy:
            chosen, accepted = greedy, has_draft & (greedy == draft_ids)
        else:
            probs = target_probs(x, meta)  # [S, V]
            p_draft = probs.gather(1, drafts)[:, 0]  # [S]
            accepted = has_draft & (_uniform(p_draft, meta) < self.acceptance_probability(p_draft))
            # The residual: p with the draft's mass removed (rows without a draft keep all of p); the
            # exponential race draws in proportion to it, so no renormalisation is needed.
            residual = probs.scatter(1, drafts, torch.where(has_draft, 0.0, p_draft)[:, None])  # [S, V]
            drawn = residual.div_(_exponential(residual, meta)).argmax(dim=-1)  # [S]
            chosen = torch.where(accepted, draft_ids, drawn)
            if greedy is not None:
                chosen = torch.where(meta.greedy, greedy, chosen)
                accepted = torch.where(meta.greedy, has_draft & (greedy == draft_ids), accepted)
        if meta.max_num_logprobs is None:
            return VerifyOutput(chosen, accepted)
        ids, logprobs, ranks = compute_token_logprobs(logits, chosen, meta.max_num_logprobs)
        return VerifyOutput(chosen, accepted, ids, logprobs, ranks)


def _uniform(like: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """u ~ U[0, 1) per row [S]; seeded rows from their own generator (drawn before their exponentials)."""
    u = torch.rand(like.shape, device=like.device)
    for row, gen in meta.generators.items():
        u[row] = torch.rand((), device=like.device, generator=gen)
    return u
