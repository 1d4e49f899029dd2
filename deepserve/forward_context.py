"""Per-step attention metadata, handed to every attention layer through one scoped context.

The model runner builds one `AttentionMetadata` per step and runs the forward pass inside
`with forward_context(meta):`; attention layers read it with `get_forward_context()`. Outside
that block there is no context, so a layer called by mistake outside a step fails loudly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from deepserve.kernels.paged_attention import PagedLayout


@dataclass
class PrefillGroup:
    """Sequences of a step with several new tokens, as one ragged batch for `varlen_attention`.
    Sequence j of the group (step sequence seqs[j]) owns query rows cu_q[j]:cu_q[j+1] of the group's
    queries and keys cu_k[j]:cu_k[j+1] of its keys: its whole history, this step's tokens last."""

    seqs: list[int]  # which of the step's sequences, in step order
    rows: torch.Tensor | slice  # their token rows in the step ([Tg] int64, or a slice when contiguous)
    cu_q: torch.Tensor  # [G + 1] int32
    cu_k: torch.Tensor  # [G + 1] int32
    cu_q_cpu: list[int]
    cu_k_cpu: list[int]
    # [Kg] int64: the cache slot of every key, sequence by sequence in position order; None for a group
    # of fresh prompts, whose keys are this step's own (rows) and need no gather from the cache.
    kv_slots: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Flat batch of T new tokens from B sequences (token order: sequence by sequence)."""

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset where each new token's KV goes
    query_start_loc: torch.Tensor  # [B + 1] int32: sequence b owns tokens query_start_loc[b]:[b+1]
    seq_lens: torch.Tensor  # [B] int32: tokens in cache after this step (computed before + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    block_size: int
    max_seq_len: int  # longest seq_len in the batch (host int: sizes kernel grids without a sync)
    # Host copies of the small per-sequence vectors, so reference paths need no device sync.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Sequences with exactly one new token take the decode kernel on the GPU; the rest the prefill path.
    # decode_only: every sequence decodes (CUDA-graph batches), so no index tensors are needed.
    decode_only: bool = False
    decode_seq_idx: torch.Tensor | None = None  # [Bd] int64: which sequences decode
    decode_token_idx: torch.Tensor | None = None  # [Bd] int64: their token rows
    # The other sequences; None for metadata built without the decode/prefill split (tests, the profile
    # step), which the fronts then run through their per-sequence references.
    prefill_seqs_cpu: list[int] | None = None
    # The same sequences split for the one-call GPU prefill path (built by prepare_inputs): prompts with
    # nothing cached before this step, and chunks over a cached prefix (chunked prefill, prefix hits),
    # the latter in batches of bounded history (input_batch.MAX_GATHERED_KEYS).
    prefill_fresh: PrefillGroup | None = None
    prefill_cached: list[PrefillGroup] = field(default_factory=list)
    # Derived per-step values that every layer would otherwise rebuild (e.g. mla.select_sequences):
    # computed by the first layer that needs them, read by the rest. Never part of equality.
    cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def paged(self) -> PagedLayout:
        """What the kernels' references take: plain tensors and host lists."""
        return PagedLayout(self.block_tables, self.block_size, self.query_start_loc_cpu, self.seq_lens_cpu)


_current: AttentionMetadata | None = None


@contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    global _current
    previous, _current = _current, meta
    try:
        yield meta
    finally:
        _current = previous


def get_forward_context() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention ran outside `with forward_context(meta):`; only the model runner calls it")
    return _current
