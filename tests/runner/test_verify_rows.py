"""A verify step's rows are one-token attention sequences wherever they sit in the step: after a prefill
chunk too, each row's query range is its own one token (the offsets count tokens, not rows)."""

from __future__ import annotations

import torch

from deepserve.engine.request import Request, ScheduledRequest, SchedulerOutput
from deepserve.runner.input_batch import prepare_inputs
from deepserve.sampling_params import SamplingParams


def test_verify_rows_after_a_prefill_chunk_have_one_token_each():
    prefilling = Request("p", list(range(10, 20)), SamplingParams())
    prefilling.block_ids = [0, 1, 2]
    verifying = Request("v", [5, 6, 7, 5, 6], SamplingParams())
    verifying.append_output_token(7)
    verifying.block_ids = [3, 4]
    out = SchedulerOutput([ScheduledRequest(prefilling, 10, 0),
                           ScheduledRequest(verifying, 3, 5, spec_token_ids=[5, 6])], num_draft_tokens=2)
    inputs = prepare_inputs(out, 4, torch.device("cpu"))
    assert inputs.input_ids.tolist() == [*range(10, 20), 7, 5, 6]
    assert inputs.attn.query_start_loc_cpu == [0, 10, 11, 12, 13]
    assert inputs.attn.seq_lens_cpu == [10, 6, 7, 8]
