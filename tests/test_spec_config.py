"""speculative_config: vLLM's keys from LLM(...), EngineArgs and --speculative-config; bad values are
refused at start-up naming the field; MTP on a checkpoint without the layer names num_nextn_predict_layers."""

from __future__ import annotations

import pytest

from deepserve.config import EngineArgs, SpeculativeConfig
from deepserve.entrypoints.cli import build_parser, engine_args_from


@pytest.mark.parametrize(("value", "field"), [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 16}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_max"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "draft_model"),
    ("{not json", "--speculative-config"),
    ("[1, 2]", "JSON object"),
])
def test_bad_values_name_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_user(value)


def test_values_and_defaults():
    assert SpeculativeConfig.from_user(None) is None
    spec = SpeculativeConfig.from_user('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == \
        ("ngram", 4, 1, 3)
    assert SpeculativeConfig.from_user({"method": "deepseek_mtp", "num_speculative_tokens": 1}).is_mtp


def test_engine_refuses_mtp_without_the_layer():
    # DeepSeek-LLM-7B is a Llama: its config has no num_nextn_predict_layers.
    args = EngineArgs(model="deepseek-llm-7b", load_format="dummy", device="cpu",
                      speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        args.create_engine_config()


def test_engine_config_carries_it_and_turns_async_off():
    args = EngineArgs(device="cpu", async_scheduling=True,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    config = args.create_engine_config()
    assert config.speculative.num_speculative_tokens == 3
    assert not config.scheduler.async_scheduling
    assert EngineArgs(device="cpu").create_engine_config().speculative is None


def test_cli_flag_reaches_engine_args():
    parser = build_parser()
    for command in (["generate", "hi"], ["serve"], ["bench", "latency"], ["bench", "throughput"]):
        ns = parser.parse_args([*command, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
        model = getattr(ns, "model", None)
        args = engine_args_from(ns, model if isinstance(model, str) or model is None else None)
        assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}, command


def test_cli_flag_refuses_what_is_not_a_json_object(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--speculative-config", "[4]"])
    assert "--speculative-config must be a JSON object" in capsys.readouterr().err
