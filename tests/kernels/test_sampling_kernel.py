"""The fused Gumbel-max sampling kernel against torch: greedy rows equal torch.argmax (ties to the lowest
id), random rows follow softmax(logits / T) (a chi-square test over many rows), masked tokens never win,
and the draw depends on the seed alone. On CPU the kernel runs in the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import DEVICE, MARKS, ON_GPU, import_kernels

ks = import_kernels("deepserve.kernels.sampling")

pytestmark = MARKS


def _inputs(batch: int, temperatures: list[float], greedy: list[bool]):
    t = torch.tensor(temperatures, dtype=torch.float32, device=DEVICE)
    g = torch.tensor(greedy, dtype=torch.bool, device=DEVICE)
    assert t.shape == g.shape == (batch,)
    return t, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [5, 37, 3000])
def test_greedy_rows_equal_torch_argmax(dtype, vocab):
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab)).to(DEVICE, dtype)
    logits[2, vocab // 2] = logits[2, 0] = 50.0  # a tie: the lowest id wins, as torch.argmax
    t, g = _inputs(6, [1.0] * 6, [True] * 6)
    got = ks.gumbel_sample(logits, t, g, seed=7)
    assert torch.equal(got.cpu(), logits.float().argmax(-1).cpu())
    assert got[2].item() == 0


def test_the_vocabulary_splits_draw_what_one_program_a_row_draws():
    # A row's columns cut among programs (small batches): the same noise per column (keyed by row * V + v),
    # the splits' winners met in order, so every split count gives the one-program result, ties included.
    vocab = 3 * ks.BLOCK_V + 77  # four splits at most, the last one short
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    logits[0, 10] = logits[0, ks.BLOCK_V + 3] = 40.0  # a tie across two splits: the lower id wins
    logits[3, :] = float("-inf")
    logits[3, vocab - 1] = 0.0  # the only finite logit, in the last (short) split
    t, g = _inputs(4, [1.0, 0.8, 1.0, 1.3], [True, False, True, False])
    one = ks.gumbel_sample(logits, t, g, seed=21, splits=1)
    for splits in (2, 3, 4, 64):
        assert torch.equal(ks.gumbel_sample(logits, t, g, seed=21, splits=splits), one), splits
    assert torch.equal(ks.gumbel_sample(logits, t, g, seed=21), one)  # vocab_splits' own choice
    assert one[0].item() == 10 and one[3].item() == vocab - 1
    assert torch.equal(one[g].cpu(), logits[g].argmax(-1).cpu())
    # exactly three parts (V a multiple of BLOCK_V), and W2's shape: one row of 102,400 in vocab_splits' 50
    even = logits[:, :3 * ks.BLOCK_V].contiguous()
    assert torch.equal(ks.gumbel_sample(even, t, g, seed=2, splits=3), ks.gumbel_sample(even, t, g, seed=2, splits=1))
    row = torch.randn(1, 102_400, generator=torch.Generator().manual_seed(6)).to(DEVICE, torch.bfloat16)
    row[0, 77] = row[0, 102_000] = 60.0
    t1, g1 = _inputs(1, [1.0], [True])
    assert ks.vocab_splits(1, 102_400) == 50
    assert ks.gumbel_sample(row, t1, g1, seed=2, all_greedy=True).item() == 77


@pytest.mark.parametrize("splits", [1, 3])
def test_all_greedy_draws_no_noise_and_equals_argmax(splits):
    vocab = 2 * ks.BLOCK_V + 5
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(8)).to(DEVICE, torch.bfloat16)
    logits[1, 7] = logits[1, ks.BLOCK_V + 1] = 30.0
    # the rows' own flags say "random, hot": only all_greedy keeps the noise out (and they are not read then)
    t, g = _inputs(3, [50.0] * 3, [False] * 3)
    got = ks.gumbel_sample(logits, t, g, seed=3, all_greedy=True, splits=splits)
    assert torch.equal(got.cpu(), logits.float().argmax(-1).cpu()) and got[1].item() == 7


def test_vocab_splits_fill_about_one_program_an_sm():
    assert ks.vocab_splits(1, 102_400) == min(ks.SPLIT_TARGET_PROGRAMS, 50, ks.MAX_VOCAB_SPLITS)  # 50 BLOCK_V
    assert ks.vocab_splits(8, 102_400) == ks.SPLIT_TARGET_PROGRAMS // 8
    assert ks.vocab_splits(1, 1000) == 1  # one BLOCK_V of columns
    assert ks.vocab_splits(256, 102_400) == 1  # the batch fills the GPU alone
    assert ks.vocab_splits(1, 10**7) == ks.MAX_VOCAB_SPLITS
    assert ks.vocab_splits(4, 102_400, target_programs=0) == 1


def test_random_rows_follow_softmax_of_logits_over_temperature():
    # 6 tokens, one of them masked; many identical rows, each an independent draw.
    vocab, rows, temperature = 6, 250 if not ON_GPU else 200_000, 0.7  # interpreter: ~30 ms a row
    base = torch.tensor([1.0, 0.2, -0.5, 2.0, float("-inf"), 0.0])
    logits = base.expand(rows, vocab).contiguous().to(DEVICE)
    t, g = _inputs(rows, [temperature] * rows, [False] * rows)
    got = ks.gumbel_sample(logits, t, g, seed=1234).cpu()
    counts = torch.bincount(got, minlength=vocab).double()
    assert counts[4] == 0  # -inf never wins
    expected = torch.softmax(base.double() / temperature, -1) * rows
    keep = expected > 0
    chi2 = (((counts - expected)[keep]) ** 2 / expected[keep]).sum().item()
    assert chi2 < 20.5, (counts, expected)  # 5 degrees of freedom: p = 0.001


def test_mixed_batch_and_seed_reproducibility():
    vocab = 300
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    greedy = [True, False] * 4
    t, g = _inputs(8, [1.0 if x else 1.5 for x in greedy], greedy)
    a = ks.gumbel_sample(logits, t, g, seed=11)
    b = ks.gumbel_sample(logits, t, g, seed=11)
    assert torch.equal(a, b)
    assert torch.equal(a[g].cpu(), logits[g].argmax(-1).cpu())
    draws = {tuple(ks.gumbel_sample(logits, t, g, seed=s)[~g].tolist()) for s in range(6)}
    assert len(draws) > 1  # the random rows move with the seed


def test_inputs_are_checked():
    logits = torch.randn(2, 10, device=DEVICE)
    t, g = _inputs(2, [1.0, 1.0], [False, False])
    with pytest.raises(ValueError, match="temperature"):
        ks.gumbel_sample(logits, t.double(), g, seed=0)
    with pytest.raises(ValueError, match="greedy"):
        ks.gumbel_sample(logits, t, g.int(), seed=0)
    with pytest.raises(ValueError, match="contiguous"):
        ks.gumbel_sample(logits.t(), t, g, seed=0)


@pytest.mark.skipif(not ON_GPU, reason="the Sampler takes the fused path only for CUDA logits")
def test_sampler_uses_the_kernel_on_cuda_and_keeps_greedy_rows_exact():
    from deepserve.layers.sampler import Sampler, SamplingMetadata
    from deepserve.sampling_params import SamplingParams

    logits = torch.randn(4, 500, device=DEVICE)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8)] * 2
    meta = SamplingMetadata.build(params, [[1]] * 4, [[]] * 4, [frozenset()] * 4, 500, DEVICE)
    out = Sampler()(logits, meta).sampled
    assert torch.equal(out[0::2], logits[0::2].argmax(-1))


def test_allowed_bitmask_restricts_greedy_and_random_rows():
    from deepserve.layers.sampler import apply_token_bitmask

    vocab = 100
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    gen = torch.Generator().manual_seed(4)
    mask = torch.randint(-(2**31), 2**31 - 1, (4, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    mask[:, 0] &= ~1  # token 0 forbidden on every row
    mask = mask.to(DEVICE)
    allowed = apply_token_bitmask(torch.zeros(4, vocab, device=DEVICE), mask) == 0  # the torch reference
    t, g = _inputs(4, [1.0, 1.0, 0.8, 1.3], [True, True, False, False])
    want = apply_token_bitmask(logits, mask).argmax(-1)
    for seed in range(5):
        got = ks.gumbel_sample(logits, t, g, seed=seed, allowed_bitmask=mask)
        assert allowed[torch.arange(4, device=DEVICE), got].all()
        assert torch.equal(got[:2].cpu(), want[:2].cpu())


def test_fill_placeholders_kernel_equals_the_torch_version():
    # The one-launch fill against model_runner's torch ops (the reference, run on the CPU): placeholders
    # -(row + 1) take the previous step's sampled token of that row, real tokens stay, rows out of range clamp.
    from deepserve.runner.model_runner import fill_placeholders_torch as torch_fill

    gen = torch.Generator().manual_seed(4)
    for tokens, rows in ((1, 1), (7, 3), (1500, 40)):  # 1,500: two programs
        ids = torch.randint(-rows - 2, 50_000, (tokens,), generator=gen)
        ids[0] = -1
        sampled = torch.randint(0, 50_000, (rows,), generator=gen)
        got = ks.fill_placeholders(ids.to(DEVICE), sampled.to(DEVICE)).cpu()
        assert torch.equal(got, torch_fill(ids, sampled)), (tokens, rows)
        assert got[0] == sampled[0]
    assert ks.fill_placeholders(torch.empty(0, dtype=torch.int64, device=DEVICE),
                                torch.ones(1, dtype=torch.int64, device=DEVICE)).numel() == 0
    with pytest.raises(ValueError, match="int64"):
        ks.fill_placeholders(torch.zeros(3, dtype=torch.int32, device=DEVICE), torch.ones(1, dtype=torch.int64,
                                                                                          device=DEVICE))
