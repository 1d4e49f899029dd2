"""What rank 0 sends the other ranks travels as msgpack, not pickle: the engine config survives the
round trip for every architecture and preset (hf_config included), and a step command too."""

from __future__ import annotations

import msgpack
import pytest

from deepserve.config import EngineArgs
from deepserve.runner.step_message import config_from_message, config_to_message


def _round_trip(msg):
    return msgpack.unpackb(msgpack.packb(msg, use_bin_type=True), raw=False, strict_map_key=False)


@pytest.mark.parametrize("preset, kw", [
    ("deepseek-llm-7b", {"tensor_parallel_size": 2}),
    ("r1-distill-qwen-7b", {"pipeline_parallel_size": 2, "max_num_batched_tokens": 1024}),
    ("deepseek-v2-lite", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
    ("deepseek-v3", {"tensor_parallel_size": 8, "hf_overrides": {"num_hidden_layers": 4}}),
])
def test_engine_config_round_trips(preset, kw):
    config = EngineArgs(model=preset, load_format="dummy", device="cpu", max_model_len=512, **kw).create_engine_config()
    got = config_from_message(_round_trip(config_to_message(config)))
    assert type(got.model.hf_config) is type(config.model.hf_config)
    assert got.model.hf_config.to_dict() == config.model.hf_config.to_dict()
    for part in ("cache", "scheduler", "parallel"):
        assert getattr(got, part) == getattr(config, part)
    for field in ("model", "dtype", "max_model_len", "load_format", "device", "enforce_eager", "tokenizer"):
        assert getattr(got.model, field) == getattr(config.model, field)
