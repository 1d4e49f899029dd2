"""SamplingParams validates once, naming the field; the input processor re-checks what it fills in."""

from __future__ import annotations

import math

import pytest

from deepserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from deepserve.engine.processors import InputProcessor
from deepserve.sampling_params import SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize("field, value", [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -0.1),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("n", 0), ("max_tokens", 0),
    ("min_p", 1.5), ("presence_penalty", math.nan), ("repetition_penalty", 0.0),
    ("seed", 2**64), ("logprobs", -1), ("min_tokens", -1), ("n", 1.5), ("top_k", True),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_unknown_field_is_named():
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams(temprature=0.5)


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_stop_may_be_one_string_and_defaults_are_vllms():
    p = SamplingParams(stop="###")
    assert p.stop == ["###"] and p.max_tokens == 16 and p.temperature == 1.0 and p.top_k == -1


class _Config:
    vocab_size = 100


def processor(max_model_len: int = 32) -> InputProcessor:
    config = EngineConfig(ModelConfig("m", None, _Config(), "float32", max_model_len), CacheConfig(),
                          SchedulerConfig(max_model_len=max_model_len), ParallelConfig())
    return InputProcessor(config, None, frozenset([1]))


def test_filled_in_max_tokens_is_checked_against_min_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        processor().process("r", [5] * 10, SamplingParams(max_tokens=None, min_tokens=30))
    (req,) = processor().process("r", [5] * 10, SamplingParams(max_tokens=None, min_tokens=3))
    assert req.sampling_params.max_tokens == 22  # the rest of the context


def test_too_long_prompt_names_the_limit():
    with pytest.raises(ValueError, match="maximum context length is 32 tokens"):
        processor().process("r", [5] * 30, SamplingParams(max_tokens=5))


def test_logprobs_beyond_the_vocabulary_are_refused():
    with pytest.raises(ValueError, match="logprobs"):
        processor().process("r", [5], SamplingParams(logprobs=101))


def test_token_ids_outside_the_vocabulary_are_refused():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        processor().process("r", [5, 100], SamplingParams())


def test_stop_token_ids_outside_the_vocabulary_are_refused_naming_the_field():
    # Offline and served alike (the server's 400 names the field from this message): an id the model
    # can never sample would silently never stop anything.
    with pytest.raises(ValueError, match=r"stop_token_ids: token id 100 is outside the vocabulary \[0, 100\)"):
        processor().process("r", [5], SamplingParams(stop_token_ids=[3, 100]))
    processor().process("r", [5], SamplingParams(stop_token_ids=[99]))


def test_logit_bias_takes_string_or_integer_ids_and_names_what_is_wrong():
    assert SamplingParams(logit_bias={"7": -100, 3: 2}).logit_bias == {7: -100, 3: 2}
    assert SamplingParams(logit_bias=[[7, 1.5]]).logit_bias == {7: 1.5}  # the pairs EngineCoreRequest sends
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bad in ({"x": 1}, {-1: 1}, {3: 101}, {3: math.nan}, {3: "1"}, [1, 2], 5):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match=r"logit_bias: token id 100 is outside the vocabulary \[0, 100\)"):
        processor().process("r", [5], SamplingParams(logit_bias={99: 1, 100: 1}))
    processor().process("r", [5], SamplingParams(logit_bias={99: 1}))


def test_logit_bias_crosses_the_engine_process_boundary():
    from deepserve.engine.core import EngineCoreRequest
    from deepserve.engine.core_process import AddRequests, decode, encode

    req = EngineCoreRequest("r", [5], SamplingParams(logit_bias={7: -100.0, 3: 2.0}), [1], 0.0)
    msg = decode(encode(AddRequests([req.to_dict()]))[4:])
    assert EngineCoreRequest.from_dict(msg.requests[0]).sampling_params.logit_bias == {7: -100.0, 3: 2.0}


def test_n_children_get_distinct_seeds_that_stay_64_bit():
    children = processor().process("r", [5], SamplingParams(n=3, seed=2**64 - 1))
    assert [c.request_id for c in children] == ["0_r", "1_r", "2_r"]
    assert [c.sampling_params.seed for c in children] == [2**64 - 1, 0, 1]
    assert [c.wait_for for c in children] == [None, "0_r", "0_r"]


@pytest.mark.parametrize("field, value", [("stop", 5), ("stop", {"a": 1}), ("stop_token_ids", 7),
                                          ("stop_token_ids", "12")])
def test_stop_fields_of_the_wrong_kind_name_the_field(field, value):
    # Once a TypeError from list(5); the README promises a ValueError naming the field.
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_a_regex_ending_in_a_lone_backslash_is_refused():
    # llguidance would silently drop the backslash ("a\\" matching "a") instead of refusing it.
    with pytest.raises(ValueError, match="lone backslash"):
        StructuredOutputsParams(regex="a\\")
    assert StructuredOutputsParams(regex="a\\\\").regex == "a\\\\"


def test_a_callers_later_edit_of_its_logit_bias_reaches_the_next_request_only():
    from deepserve import LLM

    llm = LLM(device="cpu", num_gpu_blocks_override=64, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias={7: 100.0})
    assert llm.generate([[5, 6]], params, use_tqdm=False)[0].outputs[0].token_ids == [7, 7, 7]
    params.logit_bias[7] = -100.0
    params.logit_bias[11] = 100.0
    assert llm.generate([[5, 6]], params, use_tqdm=False)[0].outputs[0].token_ids == [11, 11, 11]
