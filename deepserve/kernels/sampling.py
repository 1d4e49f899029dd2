"""Fused sampling for the common case: temperature or greedy, one draw per row, in one pass over
the logits (bf16 or fp32) with no [B, V] temporaries.

A random row takes argmax_v(logits[v] / T + g_v) with g_v ~ Gumbel(0, 1) = -log(-log(u_v)): the
Gumbel-max trick, which draws from softmax(logits / T). It is the torch sampler's exponential race
argmax(softmax(logits / T) / q), q ~ Exp(1), written with q = -log(u). A greedy row takes
argmax(logits). Ties go to the lowest token id, as torch.argmax.

Small batches cut each row's columns among programs (vocab_splits) and a second one-program-a-row pass keeps
the best part; the draw is the same for any cut (the noise is keyed by column). On one H200, one row of
102,400 logits: 6.1 µs of device time with noise, 3.8 all greedy, against 89 for one program a row
(bench/sampling_probe.py, bench/RESULTS.md).

The uniforms come from Triton's Philox generator keyed by (seed, row * V + v); the caller draws a
fresh `seed` from torch's CPU generator each step, so a global seed reproduces a run. Rows that need
anything else (their own seed, top-k/top-p/min-p, penalties, min_tokens) stay on the torch path in
layers/sampler.py, which is also the reference the tests compare this kernel's distribution with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048  # (host-side) vocabulary entries per loop iteration; 8 warps keep 2048 lanes busy
TINY = tl.constexpr(1e-20)  # lower bound on the uniform: -log(-log(0)) would be -inf, a token that can never win
# Small batches split each row's vocabulary among programs (vocab_splits): one program reading a 100k-token row
# alone is latency-bound (torch.argmax took 23 µs of a W2 step on the H200, bench/RESULTS.md). Aim: about one
# program an SM (132: the H200's SM count, where it was measured); MAX_VOCAB_SPLITS bounds the second pass's vector.
SPLIT_TARGET_PROGRAMS = 132
MAX_VOCAB_SPLITS = 64


@triton.jit(do_not_specialize=["chunk"])
def _gumbel_argmax_kernel(logits_ptr, stride_row, temperature_ptr, greedy_ptr, out_ptr, part_score_ptr, part_id_ptr,
                          seed, vocab, chunk, mask_ptr, mask_stride, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr,
                          ALL_GREEDY: tl.constexpr):
    # One program = one row's columns [s * chunk, (s + 1) * chunk) (all of them when the launch has one split).
    # Each lane keeps its best score and token over the columns it visits; strict > keeps the lowest column
    # within a lane, tl.min the lowest across lanes. The noise of column v depends on (seed, row * V + v) only,
    # so a split launch draws exactly what one program a row draws.
    row = tl.program_id(0)
    split = tl.program_id(1)
    if not ALL_GREEDY:
        greedy = tl.load(greedy_ptr + row) != 0
        inv_t = 1.0 / tl.load(temperature_ptr + row)  # greedy rows carry 1.0 (sampling_metadata.py)
    base = logits_ptr + row.to(tl.int64) * stride_row
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.full([BLOCK], 0, tl.int32)
    first = split * chunk
    end = tl.minimum(first + chunk, vocab)
    for start in range(first, end, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < end
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if HAS_MASK:  # structured output: bit v of the row's int32 words says whether token v is allowed
            words = tl.load(mask_ptr + row.to(tl.int64) * mask_stride + cols // 32, mask=mask, other=0)
            x = tl.where(((words >> (cols % 32)) & 1) != 0, x, float("-inf"))
        if ALL_GREEDY:  # every row greedy: no noise drawn
            score = x
        else:
            u = tl.maximum(tl.rand(seed, row * vocab + cols), TINY)  # int32 offsets: B * V < 2**31
            score = tl.where(greedy, x, x * inv_t - tl.log(-tl.log(u)))
        better = mask & (score > best)
        best = tl.where(better, score, best)
        best_id = tl.where(better, cols, best_id)
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, best_id, vocab), axis=0)
    if tl.num_programs(1) == 1:
        tl.store(out_ptr + row, token.to(tl.int64))
    else:  # the row's splits meet in _pick_split_kernel
        tl.store(part_score_ptr + row * tl.num_programs(1) + split, top)
        tl.store(part_id_ptr + row * tl.num_programs(1) + split, token)


@triton.jit(do_not_specialize=["splits"])
def _pick_split_kernel(part_score_ptr, part_id_ptr, out_ptr, splits, BLOCK_S: tl.constexpr):
    # One program = one row: the token of its best split; on equal scores the lowest split, whose columns
    # come first, so ties still go to the lowest token id.
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_S)
    ok = offs < splits
    score = tl.load(part_score_ptr + row * splits + offs, mask=ok, other=float("-inf"))
    token = tl.load(part_id_ptr + row * splits + offs, mask=ok, other=2**31 - 1)
    top = tl.max(score, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(ok & (score == top), token, 2**31 - 1), axis=0).to(tl.int64))


def vocab_splits(batch: int, vocab: int, target_programs: int = SPLIT_TARGET_PROGRAMS) -> int:
    """Programs a row's vocabulary is cut into: about target_programs over the batch, each at least one BLOCK_V
    of columns, at most MAX_VOCAB_SPLITS; 1 (one program a row, no second pass) for batches that fill the GPU
    alone or when target_programs is 0."""
    if target_programs <= 0 or batch <= 0:
        return 1
    return max(1, min(target_programs // batch, triton.cdiv(vocab, BLOCK_V), MAX_VOCAB_SPLITS))


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, seed: int,
                  allowed_bitmask: torch.Tensor | None = None, *, all_greedy: bool = False,
                  splits: int | None = None) -> torch.Tensor:
    """One token per row of logits [B, V]: argmax for greedy rows, a draw from softmax(logits / T)
    for the others. temperature [B] float32 (1.0 on greedy rows), greedy [B] bool. -> [B] int64.
    allowed_bitmask [B, ceil(V / 32)] int32 (structured output): only tokens whose bit is set can win;
    None (every unconstrained step) compiles the kernel without the mask load. all_greedy: every row is
    greedy (no noise is drawn; `greedy`, `temperature` and `seed` are then not read). splits: programs a row
    (vocab_splits' choice by default); the result does not depend on it. NaN logits never win (a row of NaN
    gives token 0), where torch.argmax would return the first NaN."""
    batch, vocab = logits.shape
    if allowed_bitmask is not None and (allowed_bitmask.dtype != torch.int32 or allowed_bitmask.stride(1) != 1
                                        or allowed_bitmask.shape != (batch, (vocab + 31) // 32)):
        raise ValueError("allowed_bitmask must be int32 [B, ceil(V / 32)], contiguous along its words")
    if logits.stride(1) != 1:
        raise ValueError("logits must be contiguous along the vocabulary")
    if temperature.shape != (batch,) or temperature.dtype != torch.float32 or not temperature.is_contiguous():
        raise ValueError("temperature must be contiguous float32 [B]")
    if greedy.shape != (batch,) or greedy.dtype != torch.bool or not greedy.is_contiguous():
        raise ValueError("greedy must be contiguous bool [B]")
    if batch * vocab >= 2**31:
        raise ValueError(f"batch x vocab ({batch} x {vocab}) must stay below 2**31 (the generator's offsets)")
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if not batch:
        return out
    splits = max(1, min(splits, MAX_VOCAB_SPLITS)) if splits is not None else vocab_splits(batch, vocab)
    block = min(BLOCK_V, triton.next_power_of_2(vocab))
    chunk = triton.cdiv(triton.cdiv(vocab, splits), block) * block  # whole loop iterations a split
    splits = triton.cdiv(vocab, chunk)  # none empty
    has_mask = allowed_bitmask is not None
    mask = allowed_bitmask if has_mask else out  # never read without HAS_MASK
    # the splits' best scores (float32) and tokens (int32) in one allocation; one split writes `out` and never
    # these, so it passes `out` viewed as the same types (one compiled variant for both, no allocation)
    words = torch.empty(2, batch, splits, dtype=torch.int32, device=logits.device) if splits > 1 else out.view(
        torch.int32).view(1, -1).expand(2, -1)
    parts = (words[0].view(torch.float32), words[1])
    _gumbel_argmax_kernel[(batch, splits)](logits, logits.stride(0), temperature, greedy, out, *parts, seed, vocab,
                                           chunk, mask, mask.stride(0) if has_mask else 0, BLOCK=block,
                                           HAS_MASK=has_mask, ALL_GREEDY=all_greedy, num_warps=8)
    if splits > 1:
        _pick_split_kernel[(batch,)](*parts, out, splits, BLOCK_S=triton.next_power_of_2(MAX_VOCAB_SPLITS),
                                     num_warps=1)
    return out


PLACEHOLDER_BLOCK = 1024  # input ids a program


@triton.jit(do_not_specialize=["tokens", "rows"])
def _fill_placeholders_kernel(ids_ptr, sampled_ptr, out_ptr, tokens, rows, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < tokens
    ids = tl.load(ids_ptr + offs, mask=ok, other=0)
    waiting = ids < 0
    row = tl.minimum(tl.maximum(-ids - 1, 0), rows - 1)  # clamped as the torch version is
    sampled = tl.load(sampled_ptr + row, mask=ok & waiting, other=0)
    tl.store(out_ptr + offs, tl.where(waiting, sampled, ids), mask=ok)


def fill_placeholders(input_ids: torch.Tensor, previous_sampled: torch.Tensor) -> torch.Tensor:
    """input_ids [T] int64 with each placeholder -(row + 1) replaced by previous_sampled[row] (int64 [R], R >= 1):
    one launch where the torch version (runner/model_runner.fill_placeholders_torch, the reference) takes six."""
    if input_ids.dtype != torch.int64 or previous_sampled.dtype != torch.int64 or input_ids.dim() != 1 \
            or not input_ids.is_contiguous() or not previous_sampled.is_contiguous() or previous_sampled.numel() < 1:
        raise ValueError("input_ids must be contiguous int64 [T], previous_sampled contiguous int64 [R], R >= 1")
    out = torch.empty_like(input_ids)
    if input_ids.numel():
        _fill_placeholders_kernel[(triton.cdiv(input_ids.numel(), PLACEHOLDER_BLOCK),)](
            input_ids, previous_sampled, out, input_ids.numel(), previous_sampled.numel(), BLOCK=PLACEHOLDER_BLOCK,
            num_warps=4)
    return out
