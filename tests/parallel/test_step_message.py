"""What rank 0 sends the other ranks travels as msgpack, not pickle: the engine config survives the
round trip for every architecture and preset (hf_config included, with overrides), and so does a step."""

from __future__ import annotations

import msgpack
import pytest
import torch

from deepserve.config import EngineArgs
from deepserve.runner.step_message import config_from_message, config_to_message


def _round_trip(msg):
    return msgpack.unpackb(msgpack.packb(msg, use_bin_type=True), raw=False, strict_map_key=False)


@pytest.mark.parametrize("preset, kw", [
    ("deepseek-llm-7b", {"tensor_parallel_size": 2}),
    ("r1-distill-qwen-7b", {"pipeline_parallel_size": 2, "max_num_batched_tokens": 1024}),
    # An override that the config class would refuse if it validated again (layer_types keeps 28).
    ("r1-distill-qwen-7b", {"tensor_parallel_size": 2, "hf_overrides": {"num_hidden_layers": 2}}),
    ("deepseek-v2-lite", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
    ("deepseek-v3", {"tensor_parallel_size": 8, "hf_overrides": {"num_hidden_layers": 4}}),
    # Every rank builds the MTP draft's layer: the speculative config travels too.
    ("deepseek-v3", {"tensor_parallel_size": 8, "hf_overrides": {"num_hidden_layers": 4},
                     "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}),
])
def test_engine_config_round_trips(preset, kw):
    config = EngineArgs(model=preset, load_format="dummy", device="cpu", max_model_len=512, **kw).create_engine_config()
    got = config_from_message(_round_trip(config_to_message(config)))
    assert type(got.model.hf_config) is type(config.model.hf_config)
    assert got.model.hf_config.to_dict() == config.model.hf_config.to_dict()
    for part in ("cache", "scheduler", "parallel", "speculative"):
        assert getattr(got, part) == getattr(config, part)
    for field in ("model", "dtype", "max_model_len", "load_format", "device", "enforce_eager", "tokenizer"):
        assert getattr(got.model, field) == getattr(config.model, field)


def test_step_command_round_trips():
    from deepserve.engine.request import Request, ScheduledRequest, SchedulerOutput
    from deepserve.runner.input_batch import prepare_inputs
    from deepserve.runner.step_message import describe_step, rebuild_step
    from deepserve.sampling_params import SamplingParams

    fresh = Request("a", list(range(10, 30)), SamplingParams(prompt_logprobs=2))
    fresh.block_ids = [3, 1]
    decoding = Request("b", [5, 6, 7], SamplingParams())
    decoding.append_output_token(8)
    decoding.block_ids = [0]
    out = SchedulerOutput([ScheduledRequest(fresh, 16, 0), ScheduledRequest(decoding, 1, 3)])
    rebuilt = rebuild_step(_round_trip(describe_step(out)))
    ours, theirs = (prepare_inputs(o, 16, torch.device("cpu")) for o in (out, rebuilt))
    for field in ("input_ids", "positions", "sample_rows"):
        assert torch.equal(getattr(ours, field), getattr(theirs, field))
    assert torch.equal(ours.attn.slot_mapping, theirs.attn.slot_mapping)
    assert ours.sample_indices == theirs.sample_indices == [1]
    assert [s.num_sampled for s in rebuilt.scheduled] == [0, 1]
    assert rebuilt.scheduled[0].request.sampling_params.prompt_logprobs == 2
    # Under the MTP draft each request also carries the token after the step's, where there is one: the
    # partial chunk's next prompt token (position 16), none past the decoding request's last token.
    ahead = rebuild_step(_round_trip(describe_step(out, next_token=True)))
    assert ahead.scheduled[0].request.token_ids[1:17] == list(range(11, 27))
    assert ahead.scheduled[1].request.token_ids[3:5] == [8]


def test_verify_step_round_trips():
    from deepserve.engine.request import Request, ScheduledRequest, SchedulerOutput
    from deepserve.runner.input_batch import prepare_inputs
    from deepserve.runner.step_message import describe_step, rebuild_step
    from deepserve.sampling_params import SamplingParams

    verifying = Request("v", [5, 6, 7, 5, 6], SamplingParams())
    verifying.append_output_token(7)
    verifying.block_ids = [2, 4]
    decoding = Request("d", [1, 2], SamplingParams())
    decoding.append_output_token(3)
    decoding.block_ids = [0]
    out = SchedulerOutput([ScheduledRequest(verifying, 3, 5, spec_token_ids=[5, 6]), ScheduledRequest(decoding, 1, 2)],
                          num_draft_tokens=2)
    rebuilt = rebuild_step(_round_trip(describe_step(out)))
    assert rebuilt.num_draft_tokens == 2 and rebuilt.scheduled[0].spec_token_ids == [5, 6]
    ours, theirs = (prepare_inputs(o, 4, torch.device("cpu")) for o in (out, rebuilt))
    for field in ("input_ids", "positions", "sample_rows"):
        assert torch.equal(getattr(ours, field), getattr(theirs, field))
    assert ours.input_ids.tolist() == [7, 5, 6, 3]
    assert ours.attn.seq_lens_cpu == theirs.attn.seq_lens_cpu == [6, 7, 8, 3]  # one decode row per position
    assert ours.attn.decode_only and ours.sample_indices == [0, 0, 0, 1]
