"""SchedulerOutput -> the flat tensors of one step (host lists first, one copy to the device)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from deepserve.engine.request import SchedulerOutput
from deepserve.runner.forward_context import AttentionMetadata


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
        else:
            input_ids.extend(request.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_start_loc.append(len(input_ids))
        seq_lens.append(end)
        if sched.samples:
            sample_rows.append(len(input_ids) - 1)
            sample_indices.append(i)
    decode_seqs = [i for i, s in enumerate(out.scheduled) if s.num_new_tokens == 1]
    decode_only = len(decode_seqs) == len(out.scheduled)
    # The decode-row indices exist only for mixed steps; a decode-only step needs none.
    decode_idx = [] if decode_only else decode_seqs
    decode_tokens = [query_start_loc[i] for i in decode_idx]
    # Two host -> device copies per step: one of every int64 vector, one of every int32 one.
    longs = _to_device([input_ids, positions, slots, sample_rows, decode_idx, decode_tokens], torch.int64, device)
    block_tables = _block_table([s.request.block_ids for s in out.scheduled])  # [B, max_blocks]
    ints = _to_device([query_start_loc, seq_lens, block_tables], torch.int32, device)
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
        prefill_seqs_cpu=[i for i, s in enumerate(out.scheduled) if s.num_new_tokens != 1],
    )
    return StepInputs(input_ids=longs[0], positions=longs[1], attn=attn, sample_rows=longs[3],
                      sample_indices=sample_indices, has_placeholders=placeholders)


def _block_table(rows: list[list[int]]) -> np.ndarray:
    """[B, max_blocks] int32, each row's block ids padded with 0; built from one flat array, since
    converting a nested list element by element cost ~1 ms a step at batch 256."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    table = np.zeros((len(rows), int(lengths.max())), dtype=np.int32)
    flat = np.fromiter(chain.from_iterable(rows), dtype=np.int32, count=int(lengths.sum()))
    table[np.arange(table.shape[1]) < lengths[:, None]] = flat  # row-major fill = the rows in order
    return table


def _to_device(parts: list, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Concatenate lists / arrays, copy once (asynchronously on CUDA), return views split as given."""
    arrays = [np.asarray(p, dtype=np.int64 if dtype == torch.int64 else np.int32).reshape(-1) for p in parts]
    host = torch.from_numpy(np.concatenate(arrays))
    flat = host.to(device, non_blocking=True) if device.type == "cuda" else host
    return list(flat.split([a.size for a in arrays]))
