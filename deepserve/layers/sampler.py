"""The sampler: logits [B, V] -> one token per row, plus logprobs when asked.

Order, as in vLLM v1: logprobs from the raw logits; structured output's allowed-token bitmask masks the
rest; logit_bias adds to its tokens' logits; min_tokens masks stop tokens; penalties;
greedy rows take the argmax; the other rows divide by temperature, then min_p, top_k and top_p
filter, and a token is drawn by the exponential race argmax(probs / q), q ~ Exp(1).

On the GPU, a step that asks only for temperature or greedy rows takes one fused Triton pass instead
(kernels/sampling.py: the same distribution, other random numbers; DEEPSERVE_FUSED_SAMPLING=0 turns it off).

Every stage is out-of-place, so the caller's logits are never modified (the raw logprobs are
read from them after sampling).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from deepserve import envs
from deepserve.layers.sampling_metadata import SamplingMetadata

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "apply_logit_bias",
    "apply_min_tokens",
    "apply_penalties",
    "apply_token_bitmask",
    "apply_top_k_top_p",
    "compute_token_logprobs",
    "target_probs",
]


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [B] int64
    # Set only when some row asked for logprobs; K = meta.max_num_logprobs.
    # Column 0 is the sampled token, columns 1..K the top-K in descending order.
    logprob_token_ids: torch.Tensor | None = None  # [B, K+1] int64
    logprobs: torch.Tensor | None = None  # [B, K+1] float32
    ranks: torch.Tensor | None = None  # [B] int64, 1-based rank of the sampled token


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        fused = _fused_sampler() if _fusable(logits, meta) else None
        if fused is not None:
            # One Triton pass over the raw logits (kernels/sampling.py) instead of ~8 [B, V] kernels.
            options = _split_options(meta)
            # torch's CPU generator: a global seed replays. An all-greedy step draws none (the kernel reads no seed
            # then), so it leaves the stream as torch.argmax did.
            seed = GREEDY_SEED if options.get("all_greedy") else int(torch.randint(2**31 - 1, (1,)))
            sampled = fused(logits, meta.temperature, meta.greedy, seed, meta.allowed_token_bitmask, **options)
        else:
            x = logits.float()  # [B, V]; aliases `logits` when already float32
            x = apply_token_bitmask(x, meta.allowed_token_bitmask)
            x = apply_logit_bias(x, meta)
            x = apply_min_tokens(x, meta)
            x = apply_penalties(x, meta)
            sampled = _sample(x, meta)  # [B]
        if meta.max_num_logprobs is None:
            return SamplerOutput(sampled)
        ids, logprobs, ranks = compute_token_logprobs(logits, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled, ids, logprobs, ranks)


# What the fused Gumbel kernel cannot do, by name: a step with any of these takes the torch path. The
# kernel itself does temperature sampling (greedy rows included) over bf16/fp16/fp32 logits on the GPU.
FUSED_SAMPLER_EXCLUDES: dict[str, Callable[[torch.Tensor, SamplingMetadata], bool]] = {
    "not on the GPU": lambda logits, meta: not logits.is_cuda,
    "2**31 logits or more (int32 offsets)": lambda logits, meta: logits.numel() >= 2**31,
    # unless the rows' vocabularies split (small batches): one program a row is slower than torch.argmax
    "every row greedy (argmax is cheaper)": lambda logits, meta: meta.all_greedy and not _greedy_splits(logits),
    "min_tokens": lambda logits, meta: meta.min_tokens_index is not None,
    "logit_bias": lambda logits, meta: meta.logit_bias is not None,
    "penalties": lambda logits, meta: meta.output_counts is not None,
    "top_k": lambda logits, meta: meta.top_k is not None,
    "top_p": lambda logits, meta: meta.top_p is not None,
    "min_p": lambda logits, meta: meta.min_p is not None,
    "seeded rows": lambda logits, meta: bool(meta.generators),
}


# The seed an all-greedy launch passes (unread there): one of the two the start-up warm-up compiles for
# (warm_up_fused_sampler's WARM_SEEDS), so the launch meets a compiled variant.
WARM_SEEDS = (17, 32)  # Triton specializes integers divisible by 16: one seed of each kind
GREEDY_SEED = WARM_SEEDS[1]


@functools.cache
def _sampling_split() -> bool:
    """DEEPSERVE_SAMPLING_SPLIT, read once (as _fused_sampler reads its switch)."""
    return bool(envs.DEEPSERVE_SAMPLING_SPLIT)


def _greedy_splits(logits: torch.Tensor) -> bool:
    """Whether an all-greedy step takes the fused kernel: only where its rows split (kernels/sampling.vocab_splits).
    H200 device times (bench/sampling_probe.py, bench/RESULTS.md): V 102,400, 1 row 3.8 µs against torch.argmax's
    24.1, 64 rows (2 splits) 36.7 against 46.3, but 256 rows (one program a row) 151.9 against 118.5."""
    if not _sampling_split() or logits.dim() != 2:
        return False
    try:
        from deepserve.kernels.sampling import vocab_splits
    except ImportError:  # no Triton: no fused sampler either
        return False
    return vocab_splits(logits.shape[0], logits.shape[1]) > 1


def _split_options(meta: SamplingMetadata) -> dict:
    # DEEPSERVE_SAMPLING_SPLIT=0: the launch as before the split (one program a row, noise drawn for every row)
    if not _sampling_split():
        return {"splits": 1}
    return {"all_greedy": meta.all_greedy}


def unfused_reasons(logits: torch.Tensor, meta: SamplingMetadata) -> list[str]:
    """Why this step cannot take the fused sampler; empty when it can."""
    return [name for name, applies in FUSED_SAMPLER_EXCLUDES.items() if applies(logits, meta)]


def _fusable(logits: torch.Tensor, meta: SamplingMetadata) -> bool:
    return not any(applies(logits, meta) for applies in FUSED_SAMPLER_EXCLUDES.values())


@functools.cache
def _fused_sampler() -> Callable[..., torch.Tensor] | None:
    """kernels.sampling.gumbel_sample, or None without Triton or with DEEPSERVE_FUSED_SAMPLING=0 (looked
    up once, as the MoE layer's fused kernels are)."""
    if not envs.DEEPSERVE_FUSED_SAMPLING:
        return None
    try:
        from deepserve.kernels.sampling import gumbel_sample
    except ImportError:
        return None
    return gumbel_sample


def warm_up_fused_sampler(logits: torch.Tensor) -> int:
    """Compile (or load) every variant of the fused sampling kernel a serving step can meet, at start-up: with
    and without a grammar mask, with and without noise (all-greedy steps), and for the seeds Triton specializes
    on (divisible by 16 or not; the sampler draws a fresh seed per step). Without this, the first sampled step,
    and the first constrained one, waited for a compile inside serving (two in each W1 with a JSON schema on the
    H200).
    logits [B, V] on the GPU. -> launches made (0 where the fused sampler is off or not on a GPU)."""
    fused = _fused_sampler()
    if fused is None or not logits.is_cuda:
        return 0
    logits = logits[:8]  # the variants do not depend on the row count (the grid does)
    rows, vocab = logits.shape
    temperature = torch.ones(rows, dtype=torch.float32, device=logits.device)
    greedy = torch.zeros(rows, dtype=torch.bool, device=logits.device)
    allow_all = torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32, device=logits.device)
    launches = 0
    for seed in WARM_SEEDS:
        for mask in (None, allow_all):
            for all_greedy in (False, True):  # an all-greedy step's variant draws no noise
                fused(logits, temperature, greedy, seed, mask, all_greedy=all_greedy)
                launches += 1
    return launches


def compute_token_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of `target_ids` and of the top-k tokens, from the raw logits [N, V].

    Returns (ids [N, k+1] int64, logprobs [N, k+1] float32, ranks [N] int64); column 0 is the
    target, columns 1..k the top-k in descending order. k is clamped to V. The rank counts the
    tokens at least as likely as the target, the target included (ties rank it lower), as vLLM.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    target_ids = target_ids.long()
    target_logprobs = logprobs.gather(-1, target_ids[:, None])  # [N, 1]
    ranks = (logprobs >= target_logprobs).sum(-1)  # [N]
    top_logprobs, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)  # [N, k] each
    ids = torch.cat([target_ids[:, None], top_ids], dim=1)  # [N, k+1]
    return ids, torch.cat([target_logprobs, top_logprobs], dim=1), ranks


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
    """-inf on every token whose bit is clear in the row's allowed-token bitmask [B, ceil(V / 32)] int32
    (structured output; also the torch reference of the fused kernel's mask). The one hook structured
    output has in the sampler: None leaves the logits untouched at no cost."""
    if bitmask is None:
        return logits
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask[:, :, None] >> shifts) & 1  # [B, W, 32]
    allowed = bits.view(bitmask.shape[0], -1)[:, :vocab].bool()  # [B, V]
    return logits.masked_fill(~allowed, float("-inf"))


def apply_logit_bias(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Each row's logit_bias added to its tokens' logits (a masked -inf stays -inf)."""
    if meta.logit_bias is None:
        return logits
    rows, tokens, biases = meta.logit_bias
    return logits.index_put((rows, tokens), biases.to(logits.dtype), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """-inf on every stop token of the rows that have not yet produced min_tokens."""
    if meta.min_tokens_index is None:
        return logits
    # torch.full, not torch.tensor(..., device=): the latter copies from the host and waits for the
    # device, which would stall the host behind the step (async scheduling launches ahead).
    neg_inf = torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device)
    return logits.index_put(meta.min_tokens_index, neg_inf)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt and output), then frequency and presence (output only)."""
    if meta.output_counts is None:
        return logits
    counts = meta.output_counts  # [B, V]
    rep = meta.repetition_penalty[:, None]  # [B, 1]
    seen = meta.prompt_mask | (counts > 0)  # [B, V]
    # Dividing positive and multiplying negative logits both make a seen token less likely.
    repeated = torch.where(logits > 0, logits / rep, logits * rep)  # [B, V]
    logits = torch.where(seen, repeated, logits)
    logits = logits - meta.frequency_penalty[:, None] * counts
    return logits - meta.presence_penalty[:, None] * (counts > 0).float()


def apply_top_k_top_p(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """-inf outside each row's top_k, then outside its top_p nucleus (mass after top_k).

    Ties with the k-th value survive top_k. top_p keeps the smallest set of the most likely
    tokens whose mass reaches top_p, and always the most likely token.
    """
    if meta.top_p is None:
        if meta.top_k is None:
            return logits
        # Without top_p a partial top-k is enough: the k-th largest value is the threshold.
        top = logits.topk(meta.max_top_k, dim=-1).values  # [B, max_k]
        kth = top.gather(-1, meta.top_k[:, None] - 1)  # [B, 1]
        return logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1)  # [B, V] each, ascending
    if meta.top_k is not None:
        kth = sorted_logits.gather(-1, logits.shape[-1] - meta.top_k[:, None])  # [B, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # Ascending cumulative mass: a token goes when it and all less likely ones hold <= 1 - top_p,
    # i.e. when the more likely tokens alone already reach top_p.
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    drop = cum <= 1.0 - meta.top_p[:, None]  # [B, V]
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return sorted_logits.scatter(-1, order, sorted_logits)


def _sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    greedy = None if meta.all_random else logits.argmax(dim=-1)  # [B]
    if meta.all_greedy:
        return greedy
    drawn = _sample_random(logits, meta)  # [B]
    return drawn if greedy is None else torch.where(meta.greedy, greedy, drawn)


def _sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    probs = target_probs(logits, meta)  # [B, V]
    return probs.div_(_exponential(probs, meta)).argmax(dim=-1)


def target_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution a random row draws from: softmax of logits / temperature after min_p, top_k and
    top_p. logits [B, V] float32, penalties and min_tokens already applied. -> [B, V] float32."""
    logits = logits / meta.temperature[:, None]  # [B, V]
    if meta.min_p is not None:
        probs = logits.softmax(dim=-1)  # [B, V]
        threshold = meta.min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [B, 1]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    logits = apply_top_k_top_p(logits, meta)
    return logits.softmax(dim=-1)  # [B, V]


def _exponential(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """q ~ Exp(1) of probs' shape; seeded rows from their own generator, the rest in one call."""
    q = torch.empty_like(probs)  # [B, V]
    if len(meta.generators) < probs.shape[0]:
        q.exponential_()
    for row, gen in meta.generators.items():
        # A fresh [V] draw per row, so the values do not depend on the row's position.
        q[row] = torch.empty_like(probs[row]).exponential_(generator=gen)
    # Exp(1) can return exactly 0; a zero would make 0/0 on a filtered token.
    return q.clamp_(min=torch.finfo(q.dtype).tiny)
