from __future__ import annotations

import math
import random

import pytest
import torch

from deepserve.layers.sampler import (
    Sampler,
    SamplingMetadata,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    compute_token_logprobs,
)
from deepserve.layers.sampling_metadata import PenaltyHistory
from deepserve.sampling_params import SamplingParams

CPU = torch.device("cpu")
NEG_INF = float("-inf")
# Tests taking `device` also run on CUDA where there is one.
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


def build(
    params: list[SamplingParams],
    vocab_size: int,
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    eos: list[frozenset[int]] | None = None,
    device: torch.device = CPU,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        eos if eos is not None else [frozenset() for _ in range(n)],
        vocab_size,
        device,
    )


def sample(logits: torch.Tensor, params: list[SamplingParams], **kwargs: object) -> torch.Tensor:
    return Sampler()(logits, build(params, logits.shape[-1], device=logits.device, **kwargs)).sampled


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((observed - expected) ** 2 / expected).sum())


# 99.9th percentile of chi-square with 3 degrees of freedom (4-token vocab).
CHI2_3DOF_999 = 16.27


def test_greedy_is_argmax_and_leaves_logits_untouched() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    before = logits.clone()
    out = sample(logits, [SamplingParams(temperature=0.0)] * 5)
    assert out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(-1))
    assert torch.equal(logits, before)


def test_top_k_1_is_greedy_at_any_temperature() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    params = [SamplingParams(temperature=t, top_k=1) for t in (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 50.0, 100.0)]
    for _ in range(5):
        assert torch.equal(sample(logits, params), logits.argmax(-1))


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    for _ in range(5):
        out = sample(logits, [SamplingParams(temperature=3.0, top_p=1e-9)] * 8)
        assert torch.equal(out, logits.argmax(-1))


def test_top_p_keeps_smallest_set_reaching_mass() -> None:
    torch.manual_seed(0)
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().expand(4000, 4)
    # 0.5 < 0.7 <= 0.5 + 0.3: tokens 1 and 3, renormalised to 0.625 / 0.375.
    tokens = sample(logits, [SamplingParams(top_p=0.7)] * 4000)
    assert set(tokens.tolist()) == {1, 3}
    assert chi_square(tokens, torch.tensor([1e-9, 0.625, 1e-9, 0.375])) < CHI2_3DOF_999
    # 0.8 < 0.81: token 2 joins, token 0 does not.
    assert set(sample(logits, [SamplingParams(top_p=0.81)] * 4000).tolist()) == {1, 2, 3}


def test_top_k_renormalises_over_the_k_most_likely() -> None:
    torch.manual_seed(0)
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    tokens = sample(probs.log().expand(4000, 4), [SamplingParams(top_k=2)] * 4000)
    assert chi_square(tokens, torch.tensor([1e-9, 0.625, 1e-9, 0.375])) < CHI2_3DOF_999


def test_top_k_and_top_p_combined() -> None:
    torch.manual_seed(0)
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    # After top_k=3: {1: 0.5/0.95, 3: 0.3/0.95, 2: 0.15/0.95}; token 1 alone has 0.526 >= 0.5.
    tokens = sample(probs.log().expand(500, 4), [SamplingParams(top_k=3, top_p=0.5)] * 500)
    assert set(tokens.tolist()) == {1}
    # Disabled values in the same batch: top_k=0 and top_k=-1 keep every token.
    params = [SamplingParams(top_k=0), SamplingParams(top_k=-1), SamplingParams(top_k=2, top_p=0.9)] * 2000
    tokens = sample(probs.log().expand(6000, 4), params)
    assert set(tokens[0::3].tolist()) == set(tokens[1::3].tolist()) == {0, 1, 2, 3}
    assert set(tokens[2::3].tolist()) == {1, 3}


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4)
    # Threshold 0.35 * 0.5 = 0.175: tokens 0 and 1 survive, renormalised to 0.625 / 0.375.
    tokens = sample(logits, [SamplingParams(min_p=0.35)] * 4000)
    assert chi_square(tokens, torch.tensor([0.625, 0.375, 1e-9, 1e-9])) < CHI2_3DOF_999
    # Threshold 0.09: only token 3 goes.
    assert set(sample(logits, [SamplingParams(min_p=0.18)] * 4000).tolist()) == {0, 1, 2}


def test_unseeded_frequencies_match_softmax() -> None:
    torch.manual_seed(1234)
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0])
    n = 8000
    params = [SamplingParams(temperature=1.0)] * n + [SamplingParams(temperature=0.5)] * n
    tokens = sample(logits.expand(2 * n, 4), params)
    assert chi_square(tokens[:n], logits.softmax(-1)) < CHI2_3DOF_999
    assert chi_square(tokens[n:], (logits / 0.5).softmax(-1)) < CHI2_3DOF_999


def _penalty_logits() -> torch.Tensor:
    return torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]] * 2)


def _penalised(params: SamplingParams) -> torch.Tensor:
    # Row 0 carries the penalty; row 1 has the same history and default params, and stays put.
    meta = build([params, SamplingParams()], 5, prompts=[[0, 1]] * 2, outputs=[[3, 3, 2]] * 2)
    out = apply_penalties(_penalty_logits(), meta)
    assert torch.equal(out[1], _penalty_logits()[1])
    return out[0]


def test_penalty_history_rows_of_different_lengths() -> None:
    pen = SamplingParams(repetition_penalty=1.2)
    freq = SamplingParams(frequency_penalty=0.5)  # no repetition penalty: its prompt is not needed
    params = [pen, SamplingParams(), freq]
    mask, counts = PenaltyHistory(4, CPU).rows(params, ["a", "b", "c"], [[3, 3], [0], [1]],
                                               [[0, 1, 1], [2], [2, 2, 2, 0]])
    assert counts.tolist() == [[1, 2, 0, 0], [0, 0, 0, 0], [1, 0, 3, 0]]
    assert mask.tolist() == [[False, False, False, True], [False] * 4, [False] * 4]


def _history_steps(seed: int, steps: int = 40):
    """Random steps of a changing batch: requests come, grow their outputs, leave and come back."""
    rng = random.Random(seed)
    vocab, outputs, prompts = 7, {}, {}
    for _ in range(steps):
        alive = [r for r in outputs if rng.random() < 0.8]
        alive += [f"r{rng.randrange(12)}" for _ in range(rng.randrange(3))]
        alive = list(dict.fromkeys(alive))
        rng.shuffle(alive)
        for r in alive:
            prompts.setdefault(r, [rng.randrange(vocab) for _ in range(rng.randrange(5))])
            outputs.setdefault(r, [])
            outputs[r] += [rng.randrange(vocab) for _ in range(rng.randrange(1, 3))]
        params = [SamplingParams(repetition_penalty=1.5 if int(r[1:]) % 3 else 1.0,
                                 presence_penalty=0.0 if int(r[1:]) % 4 == 1 else 0.3) for r in alive]
        yield vocab, alive, params, [prompts[r] for r in alive], [list(outputs[r]) for r in alive]


@pytest.mark.parametrize("seed", range(5))
def test_penalty_history_kept_across_steps_equals_a_fresh_one(seed: int) -> None:
    # The history the runner keeps (only new tokens counted each step, slots reused) must equal one
    # built from scratch at every step.
    kept = None
    for vocab, ids, params, prompts, outputs in _history_steps(seed):
        kept = kept or PenaltyHistory(vocab, CPU)
        got = kept.rows(params, ids, prompts, outputs)
        want = PenaltyHistory(vocab, CPU).rows(params, ids, prompts, outputs)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert kept.prompt_mask.shape[0] <= 2 * (1 + 12)  # slots are reused (12 ids at most), not one per step


def test_penalty_history_counts_a_placeholder_once_its_token_is_known() -> None:
    # Under async scheduling an output may end in placeholders (-(row + 1)) of tokens still in flight.
    history, params = PenaltyHistory(5, CPU), [SamplingParams(frequency_penalty=1.0)]
    _, counts = history.rows(params, ["a"], [[]], [[1, -1]])
    assert counts.tolist() == [[0, 1, 0, 0, 0]]
    _, counts = history.rows(params, ["a"], [[]], [[1, 3, -1]])
    assert counts.tolist() == [[0, 1, 0, 1, 0]]


def test_penalty_history_grows_to_its_cap_only() -> None:
    # max_num_seqs + 1 rows is all a step can use (slot 0 is the zero row): doubling stops there.
    history = PenaltyHistory(5, CPU, max_rows=4)
    params = [SamplingParams(presence_penalty=0.5)] * 3
    history.rows(params, [1, 2, 3], [[]] * 3, [[0], [1], [2]])
    assert history.prompt_mask.shape[0] == history.output_counts.shape[0] == 4


def test_penalty_history_rebuilds_a_row_whose_output_shrank() -> None:
    history, params = PenaltyHistory(5, CPU), [SamplingParams(frequency_penalty=1.0)]
    history.rows(params, ["a"], [[]], [[1, 1, 2]])
    _, counts = history.rows(params, ["a"], [[]], [[4]])
    assert counts.tolist() == [[0, 0, 0, 0, 1]]


def test_repetition_penalty_hand_computed() -> None:
    # Seen = prompt {0, 1} and output {2, 3}; positive logits divide by 2, negative multiply.
    expected = torch.tensor([1.0, -2.0, 0.25, 1.5, -0.5])
    assert torch.allclose(_penalised(SamplingParams(repetition_penalty=2.0)), expected)


def test_frequency_and_presence_penalties_hand_computed() -> None:
    # Output counts: token 3 twice, token 2 once; the prompt is not counted.
    freq = torch.tensor([2.0, -1.0, 0.5 - 0.5, 3.0 - 1.0, -0.5])
    assert torch.allclose(_penalised(SamplingParams(frequency_penalty=0.5)), freq)
    pres = torch.tensor([2.0, -1.0, 0.5 - 0.25, 3.0 - 0.25, -0.5])
    assert torch.allclose(_penalised(SamplingParams(presence_penalty=0.25)), pres)


def test_all_penalties_together_repetition_first() -> None:
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # Token 3: 3 / 2 - 0.5 * 2 - 0.25; token 2: 0.5 / 2 - 0.5 * 1 - 0.25.
    expected = torch.tensor([1.0, -2.0, -0.5, 0.25, -0.5])
    assert torch.allclose(_penalised(params), expected)


def test_penalty_changes_greedy_choice_and_is_skipped_when_unset() -> None:
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    params = SamplingParams(temperature=0.0, presence_penalty=0.5)
    assert sample(logits, [params], outputs=[[0]]).tolist() == [1]
    meta = build([SamplingParams(temperature=0.0)], 3, outputs=[[0]])
    assert meta.output_counts is None and meta.prompt_mask is None


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4], ignore_eos=True)
    eos = [frozenset({5})]
    meta = build([params], 6, outputs=[[1, 1]], eos=eos)
    masked = apply_min_tokens(logits, meta)
    assert masked[0].tolist() == [0.0, 1.0, 2.0, 3.0, NEG_INF, NEG_INF]
    assert Sampler()(logits, meta).sampled.tolist() == [3]
    assert logits[0, 5] == 5.0
    assert sample(logits, [params], outputs=[[1, 1, 1]], eos=eos).tolist() == [5]
    # Eos ids outside the vocabulary are ignored rather than indexing out of range.
    assert sample(logits, [params], outputs=[[]], eos=[frozenset({5, 99})]).tolist() == [3]


def test_logit_bias_adds_to_its_rows_tokens_only_and_leaves_logprobs_raw() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0], [4.0, 0.0, 0.0, NEG_INF]])
    params = [SamplingParams(temperature=0.0, logit_bias={3: -100, 0: 2.5}), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=1, logit_bias={"1": 100, 3: 100})]
    meta = build(params, 4)
    biased = apply_logit_bias(logits, meta)
    assert biased.tolist() == [[2.5, 1.0, 2.0, -97.0], [0.0, 1.0, 2.0, 3.0], [4.0, 100.0, 0.0, NEG_INF]]
    assert logits[0, 3] == 3.0  # out of place
    out = Sampler()(logits, meta)
    assert out.sampled.tolist() == [0, 3, 1]
    raw = torch.log_softmax(logits[2], dim=-1)[1]  # logprobs are the model's, before the bias (as vLLM's)
    assert out.logprobs[2, 0].item() == pytest.approx(raw.item())
    assert build([SamplingParams(temperature=0.0)], 4).logit_bias is None  # no row asks: nothing built


def test_logit_bias_shifts_a_random_rows_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.zeros(20000, 4)
    bias = math.log(3.0)  # token 2 three times as likely as each other: 1/2 against 1/6
    tokens = sample(logits, [SamplingParams(temperature=1.0, logit_bias={2: bias})] * 20000)
    probs = torch.tensor([1 / 6, 1 / 6, 1 / 2, 1 / 6])
    assert chi_square(tokens, probs) < CHI2_3DOF_999


def _seeded_run(seed: int, logits_row: torch.Tensor, others: int, position: int, steps: int) -> list[int]:
    """Tokens a seeded row draws over `steps` steps, sitting at `position` among unseeded rows."""
    vocab = logits_row.numel()
    tokens = []
    for step in range(steps):
        torch.manual_seed(1000 * others + 10 * position + step)  # the global RNG must not matter
        filler = torch.randn(others, vocab).to(logits_row.device)
        logits = torch.cat([filler[:position], logits_row[None], filler[position:]])
        params = [SamplingParams(temperature=0.9)] * (others + 1)
        params[position] = SamplingParams(temperature=0.9, seed=seed)
        outputs = [[0] * step for _ in range(others + 1)]
        tokens.append(sample(logits, params, outputs=outputs)[position].item())
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_ignore_batch_composition_and_position(device: str) -> None:
    logits_row = torch.zeros(1000, device=device)  # uniform: every step is a fresh draw
    alone = _seeded_run(7, logits_row, others=0, position=0, steps=12)
    assert len(set(alone)) > 1
    assert _seeded_run(7, logits_row, others=3, position=2, steps=12) == alone
    assert _seeded_run(7, logits_row, others=5, position=5, steps=12) == alone
    assert _seeded_run(8, logits_row, others=0, position=0, steps=12) != alone


def test_seeded_rows_follow_softmax() -> None:
    # Different seeds are independent draws, so their tokens follow the distribution.
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0])
    n = 3000
    tokens = sample(logits.expand(n, 4), [SamplingParams(seed=s) for s in range(n)])
    assert chi_square(tokens, logits.softmax(-1)) < CHI2_3DOF_999


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_greedy_random_seeded(device: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 64, device=device)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.0, seed=42),
        SamplingParams(temperature=0.0, seed=3),  # a seed on a greedy row changes nothing
    ]
    meta = build(params, 64, device=logits.device)
    assert not meta.all_greedy and not meta.all_random and set(meta.generators) == {2}
    seeded_alone = sample(logits[2:3], [params[2]]).item()
    top2 = logits[1].topk(2).indices.tolist()
    for _ in range(20):
        out = sample(logits, params)
        assert out[0] == logits[0].argmax() and out[3] == logits[3].argmax()
        assert out[1].item() in top2
        assert out[2].item() == seeded_alone


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax_with_ranks(device: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 20, dtype=torch.bfloat16, device=device)
    params = [
        SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.5),
        SamplingParams(temperature=0.7, logprobs=4, presence_penalty=1.0),
        SamplingParams(temperature=0.0),
    ]
    out = Sampler()(logits, build(params, 20, outputs=[[1, 2]] * 3, device=logits.device))
    expected = torch.log_softmax(logits.float(), -1)  # before penalties and temperature
    assert out.logprobs.shape == out.logprob_token_ids.shape == (3, 5)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int64
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled)
    assert torch.allclose(out.logprobs, expected.gather(-1, out.logprob_token_ids))
    top = expected.topk(4, -1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    assert torch.all(out.logprobs[:, 1:-1] >= out.logprobs[:, 2:])
    for row in range(3):
        lp = expected[row, out.sampled[row]]
        assert out.ranks[row].item() == int((expected[row] >= lp).sum())


def test_no_logprobs_unless_asked_and_zero_k() -> None:
    logits = torch.randn(2, 10)
    out = Sampler()(logits, build([SamplingParams()] * 2, 10))
    assert out.logprobs is None and out.logprob_token_ids is None and out.ranks is None
    out = Sampler()(logits, build([SamplingParams(logprobs=0), SamplingParams()], 10))
    assert out.logprobs.shape == (2, 1) and torch.equal(out.logprob_token_ids[:, 0], out.sampled)


def test_compute_token_logprobs_hand_checked() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    ids, logprobs, ranks = compute_token_logprobs(logits, torch.tensor([1, 1]), k=2)
    log_z = math.log(sum(math.exp(v) for v in (0.0, 1.0, 2.0, 3.0)))
    assert ids.tolist() == [[1, 3, 2], [1, 0, 1]]
    expected = torch.tensor([[1.0, 3.0, 2.0], [2.0, 3.0, 2.0]]) - log_z
    assert torch.allclose(logprobs, expected)
    assert ranks.tolist() == [3, 2]
    # k larger than the vocabulary is clamped.
    ids, logprobs, _ = compute_token_logprobs(logits, torch.tensor([0, 0]), k=10)
    assert ids.shape == logprobs.shape == (2, 5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_any_float_dtype(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 30).to(dtype)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_p=0.9, min_p=0.05, seed=1)] * 2
    out = sample(logits, params)
    assert out.shape == (4,) and out[0] == logits[0].float().argmax()


def test_the_fused_sampler_names_what_it_leaves_to_torch():
    from deepserve.layers.sampler import unfused_reasons

    logits = torch.randn(2, 50)
    plain = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)]
    assert unfused_reasons(logits, build(plain, 50)) == ["not on the GPU"]
    greedy = [SamplingParams(temperature=0.0)] * 2
    assert "every row greedy (argmax is cheaper)" in unfused_reasons(logits, build(greedy, 50))  # one split a row
    wide = torch.randn(2, 5000)  # small batch, a vocabulary of three BLOCK_V: the rows split, the kernel is faster
    assert "every row greedy (argmax is cheaper)" not in unfused_reasons(wide, build(greedy, 5000))
    many = torch.randn(200, 5000)  # a batch that fills the GPU alone: one program a row, torch.argmax is faster
    assert "every row greedy (argmax is cheaper)" in unfused_reasons(many, build(greedy * 100, 5000))
    mixed = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0.7, seed=3, top_p=0.9)]
    assert {"top_k", "top_p", "seeded rows"} <= set(unfused_reasons(logits, build(mixed, 50)))
    biased = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, logit_bias={4: 1.0})]
    assert unfused_reasons(logits, build(biased, 50)) == ["not on the GPU", "logit_bias"]


def test_sampling_split_off_restores_one_program_a_row_and_argmax(monkeypatch):
    # DEEPSERVE_SAMPLING_SPLIT=0: all-greedy steps back on torch.argmax, the fused launch with one split a row
    from deepserve.layers import sampler as sampler_module

    greedy = [SamplingParams(temperature=0.0)] * 2
    wide = torch.randn(2, 5000)
    for value, split in (("0", False), ("1", True)):
        monkeypatch.setenv("DEEPSERVE_SAMPLING_SPLIT", value)
        sampler_module._sampling_split.cache_clear()
        reasons = sampler_module.unfused_reasons(wide, build(greedy, 5000))
        assert ("every row greedy (argmax is cheaper)" in reasons) is not split
        options = sampler_module._split_options(build(greedy, 5000))
        assert options == ({"all_greedy": True} if split else {"splits": 1})
    sampler_module._sampling_split.cache_clear()


def _bitmask(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    """int32 [B, ceil(V / 32)] words with the bits of `allowed` set, built bit by bit from Python ints."""
    words = (vocab + 31) // 32
    rows = []
    for row in allowed:
        value = sum(1 << t for t in row)
        rows.append([((value >> (32 * w)) & 0xFFFFFFFF) - (1 << 32 if (value >> (32 * w + 31)) & 1 else 0)
                     for w in range(words)])
    return torch.tensor(rows, dtype=torch.int32)


def test_token_bitmask_leaves_only_allowed_tokens(device: str = "cpu") -> None:
    vocab = 70  # three words, the last one partly past the vocabulary
    allowed = [[3, 31, 32, 69], list(range(vocab)), [0]]
    logits = torch.randn(3, vocab)
    meta = build([SamplingParams(temperature=1.0)] * 3, vocab)
    meta.allowed_token_bitmask = _bitmask(allowed, vocab)
    for _ in range(20):
        out = Sampler()(logits, meta).sampled.tolist()
        assert all(t in row for t, row in zip(out, allowed, strict=True))
    greedy = build([SamplingParams(temperature=0.0)] * 3, vocab)
    greedy.allowed_token_bitmask = meta.allowed_token_bitmask
    expect = [max(row, key=lambda t: logits[i, t].item()) for i, row in enumerate(allowed)]
    assert Sampler()(logits, greedy).sampled.tolist() == expect


def test_no_bitmask_means_no_mask_tensor() -> None:
    meta = build([SamplingParams(temperature=1.0)] * 2, 50)
    assert meta.allowed_token_bitmask is None
    data = _bitmask([[1], [2, 3]], 50).numpy().tobytes()
    meta = SamplingMetadata.build([SamplingParams()] * 2, [[0]] * 2, [[]] * 2, [frozenset()] * 2, 50, CPU,
                                  grammar_bitmask=data)
    assert torch.equal(meta.allowed_token_bitmask, _bitmask([[1], [2, 3]], 50))


def test_verify_rows_read_the_history_plus_their_earlier_drafts() -> None:
    # A verify step's rows (speculative decoding): row j of a request sees its kept output and drafts
    # 0..j-1. From the runner's history they must equal rows built from scratch on output + drafts, and
    # the history must keep only kept tokens, so a second step with one draft accepted still agrees.
    rng = random.Random(7)
    vocab = 23
    prompts = [[rng.randrange(vocab) for _ in range(9)] for _ in range(3)]
    outputs = [[rng.randrange(vocab) for _ in range(5)] for _ in range(3)]
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4), SamplingParams(),
              SamplingParams(presence_penalty=0.7)]
    history = PenaltyHistory(vocab, CPU)
    for _ in range(2):
        # Drafts [3, 3, 8] for request 0 (4 rows), none for 1 (one row), [5] for 2 (2 rows).
        row_request = [0, 0, 0, 0, 1, 2, 2]
        before = [[], [3], [3, 3], [3, 3, 8], [], [], [5]]
        row_outputs = [outputs[r] + b for r, b in zip(row_request, before, strict=True)]
        rows = len(row_request)
        want = SamplingMetadata.build([params[r] for r in row_request], [prompts[r] for r in row_request],
                                      row_outputs, [frozenset()] * rows, vocab, CPU)
        got = SamplingMetadata.build([params[r] for r in row_request], [prompts[r] for r in row_request],
                                     row_outputs, [frozenset()] * rows, vocab, CPU, penalties=False)
        got.set_verify_penalties(params, [10, 11, 12], prompts, outputs, history, row_request, before)
        x = torch.randn(rows, vocab)
        assert torch.equal(apply_penalties(x.clone(), got), apply_penalties(x.clone(), want))
        assert torch.equal(got.output_counts, want.output_counts)
        outputs = [outputs[0] + [3, 9], outputs[1] + [4], outputs[2] + [6]]  # what the step kept


def test_fused_sampler_warm_up_meets_every_variant_a_step_can(monkeypatch) -> None:
    # Start-up compiles the fused kernel with and without a grammar mask, with and without noise (all-greedy
    # steps) and for both seed specializations (the sampler draws a fresh seed each step; Triton specializes
    # integers divisible by 16), so no serving step waits for a compile. On CPU there is no fused sampler to warm.
    from deepserve.layers import sampler as sampler_module

    calls = []

    def fake_fused(logits, temperature, greedy, seed, mask, all_greedy):
        calls.append((seed, None if mask is None else (tuple(mask.shape), int(mask.min()), int(mask.max())),
                      all_greedy))
        assert temperature.shape == greedy.shape == (logits.shape[0],) and not greedy.any()

    class GpuLogits:  # what the warm-up reads of a CUDA tensor
        is_cuda, shape, device = True, (8, 100), torch.device("cpu")

        def __getitem__(self, rows):
            return self

    monkeypatch.setattr(sampler_module, "_fused_sampler", lambda: fake_fused)
    assert sampler_module.warm_up_fused_sampler(GpuLogits()) == 8
    assert {seed % 16 == 0 for seed, _, _ in calls} == {True, False}
    want = [(seed, mask, all_greedy) for seed in (17, 32) for mask in (None, ((8, 4), -1, -1))
            for all_greedy in (False, True)]
    assert sorted(calls, key=str) == sorted(want, key=str)
    assert sampler_module.warm_up_fused_sampler(torch.zeros(2, 100)) == 0  # a CPU tensor: nothing to warm


def test_mask_buffers_hand_out_slots_in_turn_all_bits_set() -> None:
    # DEEPSERVE_PINNED_GRAMMAR_MASKS: each take is the next of the slots, every byte 0xFF whatever the
    # slot held before, grown when a step's masks are larger; the fifth take is the first slot again.
    from deepserve.layers.sampling_metadata import MaskBuffers

    buffers = MaskBuffers(slots=4, initial_bytes=12)
    taken = [buffers.take(n) for n in (8, 16, 8, 8)]
    pointers = [t.view.untyped_storage().data_ptr() for t in taken]
    assert len(set(pointers)) == 4 and [t.index for t in taken] == [0, 1, 2, 3]
    for t in taken:
        assert t.view.dtype == torch.uint8 and bool((t.view == 0xFF).all()) and t.address == t.view.data_ptr()
        t.view.zero_()
    again = buffers.take(12)  # slot 0 was made at its initial 12 bytes: reused, not grown
    assert again.view.untyped_storage().data_ptr() == pointers[0] and bool((again.view == 0xFF).all())
    grown = buffers.take(64)  # slot 1 held 16 bytes
    assert grown.view.numel() == 64 and grown.view.untyped_storage().data_ptr() != pointers[1]


def test_masks_from_a_buffer_slot_equal_the_bytearray_path_and_outlive_the_slot() -> None:
    from deepserve.layers.sampling_metadata import MaskBuffers, bitmask_tensor

    allowed, vocab = [[1, 40], [2, 3, 63, 64]], 70
    data = _bitmask(allowed, vocab).numpy().tobytes()
    slot = MaskBuffers().take(len(data))
    slot.view.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    got = bitmask_tensor(slot, 2, vocab, torch.device("cpu"))
    assert torch.equal(got, _bitmask(allowed, vocab))
    slot.view.fill_(0)  # the slot is handed out again later: the step's masks are its own
    assert torch.equal(got, _bitmask(allowed, vocab))
    with pytest.raises(ValueError, match="grammar bitmask has 24 bytes, expected 1 rows"):
        bitmask_tensor(slot, 1, vocab, torch.device("cpu"))
    with pytest.raises(ValueError, match="does not belong"):
        MaskBuffers().copied(slot, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned buffers are for CUDA copies")
def test_pinned_mask_slots_arrive_unchanged_and_wait_for_their_copy() -> None:
    # A slot is rewritten only after the copy out of it ran: with a long kernel queued before the copies,
    # every step's masks still arrive as filled, though the slots are refilled at once (two slots, six
    # steps: takes 3-6 each wait for a copy still queued behind the kernel when they start).
    from deepserve.layers.sampling_metadata import MaskBuffers, bitmask_tensor

    device, vocab, rows = torch.device("cuda"), 152064, 64
    buffers = MaskBuffers(slots=2)
    busy = torch.randn(4096, 4096, device=device)
    for _ in range(20):
        busy = busy @ busy / 64  # keeps the stream busy well past the host's loop below
    got, want, busy_at_reuse = [], [], []
    for step in range(6):
        if step == 2:
            busy_at_reuse.append(not torch.cuda.current_stream().query())
        slot = buffers.take(rows * ((vocab + 31) // 32) * 4)
        assert slot.view.is_pinned()
        values = torch.randint(0, 255, (slot.view.numel(),), dtype=torch.uint8)
        slot.view.copy_(values)
        want.append(values.view(torch.int32).view(rows, -1).clone())
        got.append(bitmask_tensor(slot, rows, vocab, device))
    torch.cuda.synchronize()
    assert busy_at_reuse == [True]  # the first reuse came while the copies were still queued
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))


def test_logit_bias_cannot_bring_back_a_token_the_grammar_forbids() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 2)
    params = [SamplingParams(temperature=0.0, logit_bias={3: 100, 0: 100}), SamplingParams(temperature=1.0,
                                                                                          logit_bias={3: 100})]
    meta = build(params, 4)
    meta.allowed_token_bitmask = _bitmask([[0, 1], [1, 2]], 4)
    torch.manual_seed(0)
    for _ in range(20):
        sampled = Sampler()(logits, meta).sampled.tolist()
        assert sampled[0] == 0 and sampled[1] in (1, 2)
