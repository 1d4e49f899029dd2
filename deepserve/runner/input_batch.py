"""SchedulerOutput -> the flat tensors of one step (host lists first, one copy to the device)."""

from __future__ import annotations

from dataclasses import dataclass

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


def prepare_inputs(out: SchedulerOutput, block_size: int, device: torch.device) -> StepInputs:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    sample_rows: list[int] = []
    sample_indices: list[int] = []
    for i, sched in enumerate(out.scheduled):
        request, start, end = sched.request, sched.start, sched.start + sched.num_new_tokens
        blocks = request.block_ids
        if end - start == 1:  # decode: the common case, kept free of generator overhead
            input_ids.append(request.token_ids[start])
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
    max_blocks = max(len(s.request.block_ids) for s in out.scheduled)
    block_tables = [s.request.block_ids + [0] * (max_blocks - len(s.request.block_ids)) for s in out.scheduled]

    def to_device(values: list, dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype)
        return host.to(device, non_blocking=True) if device.type == "cuda" else host

    decode_seqs = [i for i, s in enumerate(out.scheduled) if s.num_new_tokens == 1]
    decode_only = len(decode_seqs) == len(out.scheduled)
    attn = AttentionMetadata(
        slot_mapping=to_device(slots, torch.int64),
        query_start_loc=to_device(query_start_loc, torch.int32),
        seq_lens=to_device(seq_lens, torch.int32),
        block_tables=to_device(block_tables, torch.int32),
        block_size=block_size,
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        decode_only=decode_only,
        decode_seq_idx=None if decode_only else to_device(decode_seqs, torch.int64),
        decode_token_idx=None if decode_only else to_device([query_start_loc[i] for i in decode_seqs], torch.int64),
        prefill_seqs_cpu=[i for i, s in enumerate(out.scheduled) if s.num_new_tokens != 1],
    )
    return StepInputs(
        input_ids=to_device(input_ids, torch.int64),
        positions=to_device(positions, torch.int64),
        attn=attn,
        sample_rows=to_device(sample_rows, torch.int64),
        sample_indices=sample_indices,
    )
