"""RejectionSampler against the target distribution itself: many independent rows on a tiny vocabulary,
compared by Pearson's chi-square; the same test must fail with a biased acceptor (the check has power).
Greedy verification against torch.argmax; seeded rows replay."""

from __future__ import annotations

import pytest
import torch

from deepserve.layers.rejection_sampler import RejectionSampler
from deepserve.layers.sampling_metadata import SamplingMetadata
from deepserve.sampling_params import SamplingParams

V = 6
N = 20000


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(X >= observed) for Pearson's statistic over the categories with positive expected count;
    chi-square's survival function is the regularized upper incomplete gamma Q(df / 2, x / 2)."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    expected = probs[keep] * counts.sum()
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


def meta_for(params: list[SamplingParams], outputs: list[list[int]] | None = None) -> SamplingMetadata:
    outputs = outputs or [[] for _ in params]
    return SamplingMetadata.build(params, [[0]] * len(params), outputs, [frozenset()] * len(params), V,
                                  torch.device("cpu"))


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])


def target(params: SamplingParams) -> torch.Tensor:
    """The distribution the plain sampler draws from, written out independently of our code."""
    x = LOGITS / params.temperature
    if params.top_k > 0:
        x = x.masked_fill(x < x.topk(params.top_k).values[-1], float("-inf"))
    return x.softmax(-1)


def emitted(sampler: RejectionSampler, params: SamplingParams, draft: int) -> torch.Tensor:
    """Counts over V of the token a request emits at its first row: the draft when accepted, else the
    row's own draw (each of N rows is an independent request with the same logits and draft)."""
    torch.manual_seed(0)
    meta = meta_for([params] * N)
    out = sampler(LOGITS.expand(N, V).clone(), meta, torch.full((N,), draft))
    token = torch.where(out.accepted, torch.full((N,), draft), out.chosen)
    assert torch.equal(token, out.chosen)  # an accepted row's chosen token is its draft
    return torch.bincount(token, minlength=V).double()


CASES = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
         SamplingParams(temperature=1.3, top_k=3)]


@pytest.mark.parametrize("params", CASES, ids=["t1", "t0.7-top4", "t1.3-top3"])
@pytest.mark.parametrize("draft", [0, 3, 4])  # likely, unlikely, and (under top_k) filtered out
def test_emitted_token_follows_the_target_distribution(params, draft):
    p_value = chi_square_p_value(emitted(RejectionSampler(), params, draft), target(params))
    assert p_value > 1e-3, p_value


@pytest.mark.parametrize("draft", [2, 3])
def test_a_biased_acceptor_fails_the_same_check(draft):
    # Accepting with probability sqrt(p) instead of p over-produces the draft: the check must see it.
    biased = RejectionSampler(acceptance_probability=torch.sqrt)
    params = SamplingParams(temperature=1.0)
    assert chi_square_p_value(emitted(biased, params, draft), target(params)) < 1e-6


@pytest.mark.parametrize("draft", [3, 4])
def test_logit_bias_is_in_the_target_the_drafts_are_judged_by(draft):
    bias = {4: 3.0, 0: -1.0}  # token 4 from unlikely to the most likely
    params = SamplingParams(temperature=1.0, logit_bias=bias)
    biased_logits = LOGITS + torch.tensor([bias.get(t, 0.0) for t in range(V)])
    assert chi_square_p_value(emitted(RejectionSampler(), params, draft), biased_logits.softmax(-1)) > 1e-3
    greedy = SamplingParams(temperature=0.0, logit_bias=bias)
    out = RejectionSampler()(LOGITS.expand(2, V).clone(), meta_for([greedy] * 2), torch.tensor([4, 0]))
    assert out.chosen.tolist() == [4, 4] and out.accepted.tolist() == [True, False]


def test_second_position_after_an_accepted_draft_follows_its_own_row():
    # Two rows of one request: row 1's distribution applies only when row 0's draft was accepted.
    torch.manual_seed(1)
    second = torch.tensor([0.0, 0.0, 3.0, 0.0, 2.0, 1.0])
    params = SamplingParams(temperature=1.0)
    meta = meta_for([params] * (2 * N))
    logits = torch.stack([LOGITS, second]).repeat(N, 1)  # rows 0, 1, 0, 1, ...
    drafts = torch.tensor([5, -1]).repeat(N)
    out = RejectionSampler()(logits, meta, drafts)
    first_ok = out.accepted[0::2]
    counts = torch.bincount(out.chosen[1::2][first_ok], minlength=V).double()
    assert chi_square_p_value(counts, second.softmax(-1)) > 1e-3
    assert not out.accepted[1::2].any()  # the last row has no draft


def test_greedy_rows_accept_exactly_the_argmax():
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(3))
    argmax = logits.argmax(-1)
    drafts = torch.where(torch.arange(8) % 2 == 0, argmax, (argmax + 1) % V)
    drafts[7] = -1
    out = RejectionSampler()(logits, meta_for([SamplingParams(temperature=0.0)] * 8), drafts)
    assert torch.equal(out.chosen, argmax)
    assert out.accepted.tolist() == [True, False, True, False, True, False, True, False]


def test_seeded_rows_replay_whatever_their_neighbours():
    seeded = SamplingParams(temperature=1.0, seed=7)
    drafts = torch.tensor([1, 2, -1])
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    a = RejectionSampler()(logits, meta_for([seeded] * 3, [[], [1], [1, 2]]), drafts)
    other = SamplingParams(temperature=1.0)
    torch.manual_seed(123)
    b = RejectionSampler()(torch.cat([torch.randn(2, V), logits]),
                           meta_for([other, other] + [seeded] * 3, [[], [], [], [1], [1, 2]]),
                           torch.cat([torch.tensor([0, 0]), drafts]))
    assert torch.equal(a.chosen, b.chosen[2:]) and torch.equal(a.accepted, b.accepted[2:])
