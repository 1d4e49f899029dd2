"""SchedulerOutput -> the flat tensors of one step (host lists first, one copy to the device)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from deepserve.engine.request import SchedulerOutput
from deepserve.forward_context import AttentionMetadata, PrefillGroup


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    sample_rows: torch.Tensor  # [S] int64: row of hidden states whose logits sample a token
    sample_indices: list[int]  # [S]: index into out.scheduled of each sampling row
    has_placeholders: bool = False  # some input is a token the previous step is still sampling


def prepare_inputs(out: SchedulerOutput, block_size: int, device: torch.device) -> StepInputs:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    sample_rows: list[int] = []
    sample_indices: list[int] = []
    placeholders = False
    for i, sched in enumerate(out.scheduled):
        request, start, end = sched.request, sched.start, sched.start + sched.num_new_tokens
        blocks = request.block_ids
        if end - start == 1:  # decode: the common case, kept free of generator overhead
            token = request.token_ids[start]
            placeholders = placeholders or token < 0  # only a decode input can be one (Request)
            input_ids.append(token)
            positions.append(start)
            slots.append(blocks[start // block_size] * block_size + start % block_size)
        elif sched.spec_token_ids:
            # A verify step: the last known token, then the drafts, each its own one-token attention
            # sequence over the request's blocks, seeing the cache up to its own position. Several
            # query tokens per request then run as decode rows (the paged-decode kernels, the decode
            # CUDA graphs); the keys of the step's earlier rows are stored before any row attends.
            input_ids.append(request.token_ids[start])
            input_ids.extend(sched.spec_token_ids)
            for p in range(start, end):
                positions.append(p)
                slots.append(blocks[p // block_size] * block_size + p % block_size)
                query_start_loc.append(len(positions))  # this row ends after its one token
                seq_lens.append(p + 1)
            query_start_loc.pop()  # the request's last row is closed below, as every sequence's is
            seq_lens.pop()
        else:
            input_ids.extend(request.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_start_loc.append(len(input_ids))
        seq_lens.append(end)
        if sched.num_sampled == 1:  # the last new token's logits sample the next token
            sample_rows.append(len(input_ids) - 1)
            sample_indices.append(i)
        elif sched.num_sampled:  # a verify step: every new position samples (the last token's and each draft's)
            sample_rows.extend(range(len(input_ids) - sched.num_sampled, len(input_ids)))
            sample_indices.extend([i] * sched.num_sampled)
    # Attention sequences: the scheduled requests, a verify step's request counting once per row. Every
    # sequence has one new token exactly when there are as many tokens as sequences.
    decode_only = len(input_ids) == len(seq_lens)
    num_new = None if decode_only else np.diff(query_start_loc)  # [B] new tokens per attention sequence
    # The decode-row indices exist only for mixed steps; a decode-only step needs none.
    decode_idx = [] if decode_only else np.flatnonzero(num_new == 1).tolist()
    decode_tokens = [query_start_loc[i] for i in decode_idx]
    block_rows = [s.request.block_ids for s in out.scheduled] if not out.num_draft_tokens else [
        s.request.block_ids for s in out.scheduled for _ in range(s.num_new_tokens if s.spec_token_ids else 1)]
    block_tables = _block_table(block_rows)  # [B, max_blocks]
    plans = [] if decode_only else _plan_prefill_groups(num_new, seq_lens, query_start_loc, block_tables, block_size)
    # Two host -> device copies per step: one of every int64 vector, one of every int32 one.
    group_longs = [part for plan in plans for part in (plan.row_ids, plan.kv_slots)]
    group_ints = [part for plan in plans for part in (plan.cu_q, plan.cu_k)]
    longs = _to_device([input_ids, positions, slots, sample_rows, decode_idx, decode_tokens, *group_longs],
                       torch.int64, device)
    ints = _to_device([query_start_loc, seq_lens, block_tables, *group_ints], torch.int32, device)
    groups = [plan.build(longs[6 + 2 * j: 8 + 2 * j], ints[3 + 2 * j: 5 + 2 * j]) for j, plan in enumerate(plans)]
    attn = AttentionMetadata(
        slot_mapping=longs[2],
        query_start_loc=ints[0],
        seq_lens=ints[1],
        block_tables=ints[2].view(block_tables.shape),
        block_size=block_size,
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        decode_only=decode_only,
        decode_seq_idx=None if decode_only else longs[4],
        decode_token_idx=None if decode_only else longs[5],
        prefill_seqs_cpu=[] if decode_only else np.flatnonzero(num_new != 1).tolist(),
        prefill_fresh=next((g for g, p in zip(groups, plans, strict=True) if p.fresh), None),
        prefill_cached=[g for g, p in zip(groups, plans, strict=True) if not p.fresh],
    )
    return StepInputs(input_ids=longs[0], positions=longs[1], attn=attn, sample_rows=longs[3],
                      sample_indices=sample_indices, has_placeholders=placeholders)


@dataclass
class _GroupPlan:
    """A PrefillGroup's host side, before the step's copies."""

    fresh: bool
    seqs: list[int]
    rows: slice | None  # the group's token rows when they are contiguous
    row_ids: list[int]  # else their ids (empty when `rows` is set)
    cu_q: list[int]
    cu_k: list[int]
    kv_slots: np.ndarray  # empty for a fresh group

    def build(self, longs: list[torch.Tensor], ints: list[torch.Tensor]) -> PrefillGroup:
        return PrefillGroup(seqs=self.seqs, rows=self.rows if self.rows is not None else longs[0],
                            cu_q=ints[0], cu_k=ints[1], cu_q_cpu=self.cu_q, cu_k_cpu=self.cu_k,
                            kv_slots=None if self.fresh else longs[1])


# The most history keys one ragged batch of chunks over a cached prefix gathers from the cache (the
# transient [K, Hkv, D] key and value copies): about a step's own token budget, which the start-up
# profile step's activations reserve room for. A longer single history goes alone, as it always did.
MAX_GATHERED_KEYS = 8192


def _plan_prefill_groups(num_new: np.ndarray, seq_lens: list[int], query_start_loc: list[int],
                         block_tables: np.ndarray, block_size: int) -> list[_GroupPlan]:
    """The step's sequences with several new tokens, split into fresh prompts (start 0), one ragged
    batch, and chunks over a cached prefix, ragged batches of at most MAX_GATHERED_KEYS history keys."""
    starts = np.asarray(seq_lens) - num_new  # [B] tokens computed before this step
    fresh = np.flatnonzero((num_new != 1) & (starts == 0)).tolist()
    cached = np.flatnonzero((num_new != 1) & (starts > 0)).tolist()
    plans = []
    parts = [(True, fresh)] + [(False, seqs) for seqs in _bounded(cached, seq_lens, MAX_GATHERED_KEYS)]
    for is_fresh, seqs in parts:
        if not seqs:
            continue
        new = [query_start_loc[b + 1] - query_start_loc[b] for b in seqs]
        lens = [seq_lens[b] for b in seqs]
        rows = _rows(query_start_loc, seqs)
        plans.append(_GroupPlan(
            fresh=is_fresh, seqs=seqs, rows=rows if isinstance(rows, slice) else None,
            row_ids=[] if isinstance(rows, slice) else rows, cu_q=_offsets(new), cu_k=_offsets(lens),
            kv_slots=np.empty(0, np.int64) if is_fresh else _history_slots(block_tables[seqs], lens, block_size),
        ))
    return plans


def _bounded(seqs: list[int], seq_lens: list[int], limit: int) -> list[list[int]]:
    """seqs in order, cut into runs whose histories (start + new tokens) add up to at most limit each."""
    runs: list[list[int]] = []
    total = limit + 1
    for b in seqs:
        length = seq_lens[b]
        if total + length > limit:
            runs.append([])
            total = 0
        runs[-1].append(b)
        total += length
    return runs


def _rows(query_start_loc: list[int], seqs: list[int]) -> slice | list[int]:
    """The token rows of `seqs` (in order): a slice when the sequences are adjacent in the step."""
    if seqs == list(range(seqs[0], seqs[-1] + 1)):
        return slice(query_start_loc[seqs[0]], query_start_loc[seqs[-1] + 1])
    return [t for b in seqs for t in range(query_start_loc[b], query_start_loc[b + 1])]


def _offsets(lengths: list[int]) -> list[int]:
    return np.concatenate([[0], np.cumsum(lengths)]).tolist()


def _history_slots(tables: np.ndarray, lens: list[int], block_size: int) -> np.ndarray:
    """Cache slots of positions 0 .. len - 1 of each sequence, concatenated: [sum(lens)] int64."""
    lengths = np.asarray(lens, dtype=np.int64)
    seq = np.repeat(np.arange(len(lens)), lengths)
    pos = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return tables[seq, pos // block_size].astype(np.int64) * block_size + pos % block_size


# Triton compiles one kernel variant per specialization of its arguments: integers by divisibility by 16
# (and == 1), pointers by 16-byte alignment. A step's block-table width and the offsets of its views into
# one copied buffer varied with the batch, so eager steps compiled decode-attention variants the graphs
# never had (two or three inside W1 on the H200, each stalling the step that met it). Widths rounded up
# to 16 columns and every view starting 16-byte aligned give each step the arguments the captured graphs
# compiled for (cuda_graph.py rounds its width the same way). Still varying: the split count eager steps
# pick from their longest sequence (one merge-kernel variant still compiled inside W1; bench/RESULTS.md).
TABLE_WIDTH_MULTIPLE = 16
VIEW_ALIGN_BYTES = 16


def table_width(num_blocks: int) -> int:
    """Columns of a block table whose longest row has num_blocks blocks: a multiple of TABLE_WIDTH_MULTIPLE."""
    return max(1, -(-num_blocks // TABLE_WIDTH_MULTIPLE)) * TABLE_WIDTH_MULTIPLE


def _block_table(rows: list[list[int]]) -> np.ndarray:
    """[B, W] int32, each row's block ids padded with 0, W the longest row rounded up to a multiple of
    TABLE_WIDTH_MULTIPLE; built from one flat array, since converting a nested list element by element
    cost ~1 ms a step at batch 256."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    table = np.zeros((len(rows), table_width(int(lengths.max()))), dtype=np.int32)
    flat = np.fromiter(chain.from_iterable(rows), dtype=np.int32, count=int(lengths.sum()))
    table[np.arange(table.shape[1]) < lengths[:, None]] = flat  # row-major fill = the rows in order
    return table


def _to_device(parts: list, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Concatenate lists / arrays, copy once (asynchronously on CUDA), return views split as given, each
    starting VIEW_ALIGN_BYTES-aligned (the parts are padded apart; see TABLE_WIDTH_MULTIPLE)."""
    np_dtype = np.int64 if dtype == torch.int64 else np.int32
    arrays = [np.asarray(p, dtype=np_dtype).reshape(-1) for p in parts]
    per_view = VIEW_ALIGN_BYTES // np.dtype(np_dtype).itemsize
    padded = [-(-a.size // per_view) * per_view for a in arrays]
    host = np.zeros(sum(padded), dtype=np_dtype)
    starts = np.cumsum([0, *padded[:-1]])
    for start, a in zip(starts, arrays, strict=True):
        host[start:start + a.size] = a
    flat = torch.from_numpy(host)
    flat = flat.to(device, non_blocking=True) if device.type == "cuda" else flat
    return [view[:a.size] for view, a in zip(flat.split(padded), arrays, strict=True)]
