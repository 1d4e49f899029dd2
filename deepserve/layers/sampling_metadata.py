"""SamplingMetadata: one step's per-row sampling parameters as device tensors.

Built once per step from the scheduled requests; the Sampler reads it and never looks at
SamplingParams. A field left as None (or a flag left False) means no row needs that stage,
which is how the Sampler skips work: no sort without top-k/top-p, no count tensors without
penalties, no argmax when every row samples, no per-row generators without seeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import torch

from deepserve.sampling_params import SamplingParams

_MASK64 = 2**64 - 1


@dataclass
class SamplingMetadata:
    greedy: torch.Tensor  # [B] bool
    # 1.0 on greedy rows, so dividing the whole batch by it never divides by ~0.
    temperature: torch.Tensor  # [B] float32
    all_greedy: bool
    all_random: bool
    # Filters. Greedy rows and rows that disable a filter carry its neutral value.
    top_k: torch.Tensor | None = None  # [B] int64 in [1, V]; V keeps everything
    max_top_k: int = 0  # max of top_k, known on the host so top-k needs no device sync
    top_p: torch.Tensor | None = None  # [B] float32; 1.0 keeps everything
    min_p: torch.Tensor | None = None  # [B] float32; 0.0 keeps everything
    # Penalties: these five are all set together, or all None.
    repetition_penalty: torch.Tensor | None = None  # [B] float32
    frequency_penalty: torch.Tensor | None = None  # [B] float32
    presence_penalty: torch.Tensor | None = None  # [B] float32
    prompt_mask: torch.Tensor | None = None  # [B, V] bool, token occurs in the prompt
    output_counts: torch.Tensor | None = None  # [B, V] float32, occurrences in the output
    # (row ids, token ids) that min_tokens forbids this step.
    min_tokens_index: tuple[torch.Tensor, torch.Tensor] | None = None  # [M] int64 each
    # Seeded random rows only: row -> generator seeded from (seed, number of output tokens).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # Top logprobs to return per row (max over rows, clamped to V); None: no row wants logprobs.
    max_num_logprobs: int | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        eos_token_ids: list[frozenset[int]],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        greedy = [p.greedy for p in params]
        # Greedy rows ignore temperature and the filters: they get the neutral values.
        rnd = [None if g else p for p, g in zip(params, greedy, strict=True)]
        temperature = [1.0 if p is None else p.temperature for p in rnd]
        top_k = [p.top_k if p is not None and 0 < p.top_k < vocab_size else vocab_size for p in rnd]
        top_p = [1.0 if p is None else p.top_p for p in rnd]
        min_p = [0.0 if p is None else p.min_p for p in rnd]
        meta = cls(
            greedy=_to(greedy, torch.bool, device),
            temperature=_f32(temperature, device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
        )
        if min(top_k, default=vocab_size) < vocab_size:
            meta.top_k = _to(top_k, torch.int64, device)
            meta.max_top_k = max(top_k)
        if min(top_p, default=1.0) < 1.0:
            meta.top_p = _f32(top_p, device)
        if max(min_p, default=0.0) > 0.0:
            meta.min_p = _f32(min_p, device)
        if any(p.has_penalties for p in params):
            meta._set_penalties(params, prompt_token_ids, output_token_ids, vocab_size, device)
        meta.min_tokens_index = _min_tokens_index(params, output_token_ids, eos_token_ids, vocab_size, device)
        for i, (p, out) in enumerate(zip(rnd, output_token_ids, strict=True)):
            if p is not None and p.seed is not None:
                gen = torch.Generator(device=device)
                gen.manual_seed(row_seed(p.seed, len(out)))
                meta.generators[i] = gen
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        if wanted:
            meta.max_num_logprobs = min(max(wanted), vocab_size)
        return meta

    def _set_penalties(
        self,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.repetition_penalty = _f32([p.repetition_penalty for p in params], device)
        self.frequency_penalty = _f32([p.frequency_penalty for p in params], device)
        self.presence_penalty = _f32([p.presence_penalty for p in params], device)
        # Rows that would not use a history contribute an empty one, so a long prompt
        # without repetition_penalty costs nothing to pad and transfer.
        prompts = [
            ids if p.repetition_penalty != 1.0 else []
            for p, ids in zip(params, prompt_token_ids, strict=True)
        ]
        outputs = [ids if p.has_penalties else [] for p, ids in zip(params, output_token_ids, strict=True)]
        self.prompt_mask = token_counts(prompts, vocab_size, device) > 0  # [B, V]
        self.output_counts = token_counts(outputs, vocab_size, device)  # [B, V]


def token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] float32 count of each token id in each row, by one scatter_add over all rows' ids."""
    ids = _to(list(chain.from_iterable(rows)), torch.int64, device)  # [N]
    lengths = _to([len(r) for r in rows], torch.int64, device)  # [B]
    # Unpadded: flat position row * V + id, so rows of very different lengths cost only their ids.
    # output_size keeps repeat_interleave from syncing with the device to learn N.
    row_of = torch.arange(len(rows), device=device).repeat_interleave(lengths, output_size=ids.numel())
    counts = torch.zeros(len(rows) * vocab_size, dtype=torch.float32, device=device)  # [B * V]
    counts.scatter_add_(0, row_of * vocab_size + ids, torch.ones(ids.shape, device=device))
    return counts.view(len(rows), vocab_size)


def row_seed(seed: int, num_output_tokens: int) -> int:
    """The generator seed for one seeded row at one step.

    It depends on nothing but the request's seed and how many tokens it has produced, so the
    draw is the same whatever else is in the batch, wherever the row sits, and after a
    recompute. Two rounds of the splitmix64 finaliser keep nearby (seed, step) pairs apart.
    """
    return _mix64(_mix64(seed & _MASK64) ^ num_output_tokens)


def _mix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _min_tokens_index(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    eos_token_ids: list[frozenset[int]],
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    # Like vLLM, eos is masked too when ignore_eos is set: min_tokens forbids every stop token.
    rows: list[int] = []
    cols: list[int] = []
    for i, (p, out, eos) in enumerate(zip(params, output_token_ids, eos_token_ids, strict=True)):
        if len(out) < p.min_tokens:
            stops = sorted(t for t in eos.union(p.stop_token_ids) if t < vocab_size)
            rows += [i] * len(stops)
            cols += stops
    if not rows:
        return None
    return (
        _to(rows, torch.int64, device),
        _to(cols, torch.int64, device),
    )


def _f32(values: list[float], device: torch.device) -> torch.Tensor:
    return _to(values, torch.float32, device)


def _to(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Built on the host, then copied without blocking: `torch.tensor(..., device="cuda")` would wait
    # for the whole forward pass queued before it, so the sampler could not be queued behind it.
    host = torch.tensor(values, dtype=dtype)
    return host.to(device, non_blocking=True) if device.type == "cuda" else host
