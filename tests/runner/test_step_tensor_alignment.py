"""A step's device tensors give Triton the same specialization at every batch: each view starts 16-byte
aligned and block tables are a multiple of 16 columns wide, whatever the batch size and lengths, and the
values are the ones the step describes (padding never shows through)."""

from __future__ import annotations

import random

import pytest
import torch

from deepserve.engine.request import Request, ScheduledRequest, SchedulerOutput
from deepserve.runner.input_batch import TABLE_WIDTH_MULTIPLE, VIEW_ALIGN_BYTES, prepare_inputs
from deepserve.sampling_params import SamplingParams

BLOCK = 4


def _step(rng: random.Random, batch: int, decode_only: bool) -> tuple[SchedulerOutput, list[Request]]:
    scheduled, requests = [], []
    next_block = 0
    for i in range(batch):
        prompt = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 40))]
        request = Request(f"r{i}", prompt, SamplingParams())
        prefill = not decode_only and rng.random() < 0.5
        if not prefill:
            request.append_output_token(rng.randrange(1, 1000))
        total = request.num_tokens
        request.block_ids = list(range(next_block, next_block + -(-total // BLOCK)))
        next_block += len(request.block_ids)
        new = total if prefill else 1
        scheduled.append(ScheduledRequest(request, new, total - new))
        requests.append(request)
    return SchedulerOutput(scheduled), requests


def _tensors(inputs) -> dict[str, torch.Tensor]:
    attn = inputs.attn
    named = {"input_ids": inputs.input_ids, "positions": inputs.positions, "sample_rows": inputs.sample_rows,
             "slot_mapping": attn.slot_mapping, "query_start_loc": attn.query_start_loc,
             "seq_lens": attn.seq_lens, "block_tables": attn.block_tables}
    if not attn.decode_only:
        named.update(decode_seq_idx=attn.decode_seq_idx, decode_token_idx=attn.decode_token_idx)
    return {k: v for k, v in named.items() if v.numel()}


@pytest.mark.parametrize("decode_only", [True, False])
@pytest.mark.parametrize("batch", [1, 2, 3, 5, 7, 16, 17, 33])
def test_every_view_is_aligned_and_tables_are_padded_to_sixteen_columns(batch, decode_only):
    out, requests = _step(random.Random(batch * 2 + decode_only), batch, decode_only)
    inputs = prepare_inputs(out, BLOCK, torch.device("cpu"))
    for name, tensor in _tensors(inputs).items():
        assert tensor.data_ptr() % VIEW_ALIGN_BYTES == 0, name
        assert tensor.is_contiguous(), name
    tables = inputs.attn.block_tables
    assert tables.shape[0] == batch and tables.shape[1] % TABLE_WIDTH_MULTIPLE == 0
    assert tables.shape[1] - TABLE_WIDTH_MULTIPLE < max(len(r.block_ids) for r in requests) <= tables.shape[1]
    for row, request in zip(tables.tolist(), requests, strict=True):
        n = len(request.block_ids)
        assert row[:n] == request.block_ids and not any(row[n:])
    # The views hold the step's own values, in order: the slots are each new token's place in its blocks.
    assert inputs.attn.seq_lens.tolist() == [r.num_tokens for r in requests]
    expected_slots = []
    for s in out.scheduled:
        for p in range(s.start, s.start + s.num_new_tokens):
            expected_slots.append(s.request.block_ids[p // BLOCK] * BLOCK + p % BLOCK)
    assert inputs.attn.slot_mapping.tolist() == expected_slots
    assert inputs.attn.query_start_loc.tolist() == inputs.attn.query_start_loc_cpu


def test_a_verify_step_is_aligned_too_and_graph_tables_are_as_wide_as_any_step_table():
    from deepserve.runner.cuda_graph import DecodeGraphs

    prefilling = Request("p", list(range(10, 31)), SamplingParams())
    prefilling.block_ids = list(range(6))
    verifying = Request("v", [5, 6, 7, 5, 6], SamplingParams())
    verifying.append_output_token(7)
    verifying.block_ids = [6, 7]
    out = SchedulerOutput([ScheduledRequest(prefilling, 21, 0),
                           ScheduledRequest(verifying, 3, 5, spec_token_ids=[5, 6])], num_draft_tokens=2)
    inputs = prepare_inputs(out, BLOCK, torch.device("cpu"))
    for name, tensor in _tensors(inputs).items():
        assert tensor.data_ptr() % VIEW_ALIGN_BYTES == 0, name
    assert inputs.attn.block_tables.shape == (4, TABLE_WIDTH_MULTIPLE)  # the verify request counts per row
    # A graph's table is rounded up the same way, so the widest step table (max_model_len + lookahead
    # tokens, rounded up) always fits in it.
    for max_model_len, lookahead in ((4096, 0), (100, 0), (4095, 6), (17, 2)):
        graphs = DecodeGraphs(torch.nn.Identity(), 4, max_model_len, BLOCK, torch.device("cpu"), lookahead=lookahead)
        width = graphs.block_tables.shape[1]
        widest = -(-(max_model_len + lookahead) // BLOCK)
        assert width % TABLE_WIDTH_MULTIPLE == 0 and width >= -(-widest // TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE
