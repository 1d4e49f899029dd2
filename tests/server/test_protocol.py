"""Request validation: every bad value is a 400 naming the field; good requests map to SamplingParams."""

from __future__ import annotations

import json
import sys

import pytest

from deepserve.server.errors import APIError
from deepserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestLimits,
    TokenizeRequest,
    parse_body,
    to_sampling_params,
)

LIMITS = RequestLimits()
MSGS = [{"role": "user", "content": "hi"}]


def chat(**kw) -> ChatCompletionRequest:
    return parse_body(json.dumps({"messages": MSGS, **kw}).encode(), ChatCompletionRequest, LIMITS)


def error_param(raw: bytes, model=CompletionRequest) -> str | None:
    with pytest.raises(APIError) as e:
        parse_body(raw, model, LIMITS)
    assert e.value.status == 400
    return e.value.param


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", "NaN"), ("temperature", "-Infinity"), ("temperature", "3"), ("temperature", "true"),
    ("temperature", '"0.5"'), ("top_p", "0"), ("top_p", "1.5"), ("top_k", "-2"), ("min_p", "2"),
    ("presence_penalty", "2.5"), ("repetition_penalty", "0"), ("n", "0"), ("n", "17"), ("n", "2.0"),
    ("max_tokens", "0"), ("seed", "-9223372036854775809"), ("seed", "1e3"), ("logprobs", "-1"),
    ("min_tokens", "-1"), ("stop_token_ids", "[-1]"), ("user", '"' + "u" * 300 + '"'),
])
def test_bad_number_names_field(field, value):
    param = error_param(f'{{"prompt": "x", "{field}": {value}}}'.encode())
    assert param.split(".")[0] == field


def test_limits_and_rules():
    assert error_param(json.dumps({"messages": MSGS, "stop": ["s"] * 9}).encode(), ChatCompletionRequest) == "stop"
    assert error_param(json.dumps({"messages": MSGS, "stop": "s" * 257}).encode(), ChatCompletionRequest) == "stop"
    assert error_param(json.dumps({"messages": MSGS, "stream_options": {"include_usage": True}}).encode(),
                       ChatCompletionRequest) == "stream_options"
    assert error_param(json.dumps({"messages": MSGS, "tools": [{"type": "function"}]}).encode(),
                       ChatCompletionRequest) == "tools.0.function"
    assert error_param(json.dumps({"messages": MSGS, "logit_bias": {"1": 5, "x2": 1}}).encode(),
                       ChatCompletionRequest) == "logit_bias.x2"
    assert error_param(json.dumps({"messages": MSGS, "logit_bias": {str(t): 1 for t in range(1025)}}).encode(),
                       ChatCompletionRequest) == "logit_bias"
    assert to_sampling_params(chat(logit_bias={"1": 5, "30": -100}), None).logit_bias == {1: 5.0, 30: -100.0}
    assert error_param(json.dumps({"messages": MSGS, "max_tokens": 3, "max_completion_tokens": 4}).encode(),
                       ChatCompletionRequest) == "max_completion_tokens"
    assert error_param(b'{"prompt": ["a", ""]}') == "prompt.1"
    for mixed, says in ((b'{"prompt": ["hi", null]}', "element 1 is null"),
                        (b'{"prompt": ["hi", [5]]}', "element 1 is [5]"),
                        (b'{"prompt": [[5], "hi"]}', 'element 1 is "hi"'),
                        (b'{"prompt": [1, true]}', "element 1 is true")):
        with pytest.raises(APIError) as e:
            parse_body(mixed, CompletionRequest, LIMITS)
        assert e.value.param == "prompt" and says in e.value.message, e.value.message
    assert error_param(json.dumps({"prompt": ["a"] * 257}).encode()) == "prompt"
    assert error_param(b'{"prompt": "x", "suffix": "y"}') == "suffix"
    assert error_param(b'{"prompt": "x", "best_of": 3}') == "best_of"
    assert error_param(b'{"prompt": "x", "min_tokens": 5, "max_tokens": 2}') == "min_tokens"
    assert error_param(b'{"prompt": "x", "messages": []}', TokenizeRequest) == "messages"
    assert error_param(b'{}', TokenizeRequest) == "prompt"


@pytest.mark.parametrize("value", ["5", "[5]", '{"a": 1}', '["a", null]'])
def test_stop_of_the_wrong_shape_says_a_string_or_a_list_of_strings(value):
    # The union's own message named only one of its shapes: "stop: Input should be a valid string".
    for raw, model in ((f'{{"prompt": "x", "stop": {value}}}', CompletionRequest),
                       (f'{{"messages": {json.dumps(MSGS)}, "stop": {value}}}', ChatCompletionRequest)):
        with pytest.raises(APIError) as e:
            parse_body(raw.encode(), model, LIMITS)
        assert e.value.param == "stop"
        assert e.value.message == f"stop: must be a string or a list of strings, got {json.dumps(json.loads(value))}"
    assert chat(stop="a").stop == "a" and chat(stop=["a", "b"]).stop == ["a", "b"] and chat(stop=None).stop is None


def test_vllm_prompt_fields_are_taken_and_checked():
    """vLLM's extras: prompt_logprobs on both endpoints (never streamed, as in vLLM), echo on completions (with
    logprobs it asks for the prompt's too), continue_final_message on chat with add_generation_prompt false."""
    def completion(**kw):
        return parse_body(json.dumps({"prompt": "x", **kw}).encode(), CompletionRequest, LIMITS)

    assert to_sampling_params(completion(prompt_logprobs=3), None).prompt_logprobs == 3
    assert to_sampling_params(chat(prompt_logprobs=0), None).prompt_logprobs == 0
    assert to_sampling_params(completion(echo=True), None).prompt_logprobs is None
    assert to_sampling_params(completion(echo=True, logprobs=2), None).prompt_logprobs == 2
    assert to_sampling_params(completion(echo=True, logprobs=2, prompt_logprobs=5), None).prompt_logprobs == 5
    assert to_sampling_params(completion(echo=True, logprobs=1, stream=True), None).prompt_logprobs == 1
    # echo with max_tokens 0 scores the prompt: the engine runs one token (dropped by the server); without
    # echo, and on chat, 0 stays an error that names max_tokens.
    assert to_sampling_params(completion(echo=True, max_tokens=0, logprobs=1), 16).max_tokens == 1
    assert error_param(b'{"prompt": "x", "max_tokens": 0, "echo": false}') == "max_tokens"
    assert error_param(json.dumps({"messages": MSGS, "max_tokens": 0}).encode(), ChatCompletionRequest) == "max_tokens"
    req = chat(messages=[*MSGS, {"role": "assistant", "content": "Hel"}], add_generation_prompt=False,
               continue_final_message=True)
    assert (req.add_generation_prompt, req.continue_final_message) == (False, True)
    for body, param in [({"prompt": "x", "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
                        ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
                        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs")]:
        assert error_param(json.dumps(body).encode()) == param, body
    for body in ({"messages": MSGS, "prompt_logprobs": 1, "stream": True},
                 {"messages": MSGS, "prompt_logprobs": 1.5}):
        assert error_param(json.dumps(body).encode(), ChatCompletionRequest) == "prompt_logprobs", body
    assert error_param(json.dumps({"messages": MSGS, "continue_final_message": True}).encode(),
                       ChatCompletionRequest) == "continue_final_message"  # add_generation_prompt is true
    assert error_param(json.dumps({"prompt": "x", "continue_final_message": True}).encode(),
                       TokenizeRequest) == "continue_final_message"
    assert error_param(json.dumps({"messages": MSGS, "continue_final_message": True}).encode(),
                       TokenizeRequest) == "continue_final_message"


def test_tool_fields_name_what_is_wrong():
    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    cases = [
        ({"tools": [fn, fn]}, "tools.1.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [fn], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [fn], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
        ({"tools": [fn], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [fn], "tool_choice": "required", "stop": ["}"]}, "stop"),
        # as stop strings are: a stop token the grammar forces (a marker) would end the calls mid-markup
        ({"tools": [fn], "tool_choice": "required", "stop_token_ids": [5]}, "stop_token_ids"),
        ({"tools": [fn], "tool_choice": {"type": "function", "function": {"name": "f"}}, "stop_token_ids": [5]},
         "stop_token_ids"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
        ({"chat_template_kwargs": ["thinking"]}, "chat_template_kwargs"),
        ({"thinking_token_budget": -1}, "thinking_token_budget"),
    ]
    for extra, param in cases:
        assert error_param(json.dumps({"messages": MSGS, **extra}).encode(), ChatCompletionRequest) == param, extra
    history = [{"role": "user", "content": "x"}, {"role": "tool", "content": "result"}]
    assert error_param(json.dumps({"messages": history}).encode(), ChatCompletionRequest) == "messages.1.tool_call_id"
    history = [{"role": "user", "content": "x", "tool_calls": [{"id": "c", "type": "function",
                                                                 "function": {"name": "f", "arguments": "{}"}}]}]
    assert error_param(json.dumps({"messages": history}).encode(), ChatCompletionRequest) == "messages.0.tool_calls"
    ok = {"messages": MSGS, "tools": [fn], "tool_choice": {"type": "function", "function": {"name": "f"}},
          "chat_template_kwargs": {"thinking": True}, "thinking_token_budget": 0}
    parse_body(json.dumps(ok).encode(), ChatCompletionRequest, RequestLimits())


def test_tokenize_refuses_chat_template_fields_with_a_prompt():
    # A prompt is tokenized as it is: these were accepted and silently ignored.
    def tokenize_error(body: dict) -> str | None:
        return error_param(json.dumps(body).encode(), TokenizeRequest)

    assert tokenize_error({"prompt": "x", "chat_template_kwargs": {"thinking": True}}) == "chat_template_kwargs"
    assert tokenize_error({"prompt": "x", "add_generation_prompt": False}) == "add_generation_prompt"
    assert tokenize_error({"messages": MSGS, "chat_template_kwargs": {"add_generation_prompt": False}}) == \
        "chat_template_kwargs.add_generation_prompt"
    for ok in ({"prompt": "x", "add_generation_prompt": True, "chat_template_kwargs": {}},
               {"messages": MSGS, "add_generation_prompt": False, "chat_template_kwargs": {"thinking": True}}):
        parse_body(json.dumps(ok).encode(), TokenizeRequest, LIMITS)


def test_malformed_json_and_utf8():
    for raw in (b"{", b"\xc3\x28", b"null", b'"text"', b"[" * 100_000 + b"]" * 100_000):
        assert error_param(raw) is None


def test_an_integer_past_pythons_digit_limit_is_a_400_not_a_crash():
    digits = sys.get_int_max_str_digits() + 1
    with pytest.raises(APIError) as e:
        parse_body(b'{"prompt": "x", "max_tokens": 1' + b"0" * digits + b"}", CompletionRequest, LIMITS)
    assert e.value.status == 400 and "number too long to read" in e.value.message


def test_configurable_n_limit():
    raw = b'{"prompt": "x", "n": 20}'
    assert parse_body(raw, CompletionRequest, RequestLimits(max_n=32)).n == 20


def test_sampling_params_mapping():
    req = chat(max_completion_tokens=7, temperature=0.0, stop="END", logprobs=True, top_logprobs=2, seed=2**64 - 1,
               ignore_eos=True)
    sp = to_sampling_params(req, None)
    assert (sp.max_tokens, sp.temperature, sp.stop, sp.logprobs, sp.seed, sp.ignore_eos) == \
        (7, 0.0, ["END"], 2, 2**64 - 1, True)
    assert to_sampling_params(chat(), None).logprobs is None
    assert to_sampling_params(chat(), None).temperature == 1.0  # vLLM's default kept when unset


def test_accepts_openai_client_extras():
    req = chat(store=False, metadata={"a": "b"}, user="u1", parallel_tool_calls=True,
               response_format={"type": "text"}, stream=True, stream_options={"include_usage": True})
    assert req.stream_options.include_usage
    content_parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert parse_body(json.dumps({"messages": content_parts}).encode(), ChatCompletionRequest, LIMITS)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("extra, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, "json"),
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"structured_outputs": {"regex": "a+"}}, "regex"),
    ({"guided_json": json.dumps(SCHEMA)}, "json"),
    ({"guided_regex": "a+"}, "regex"),
    ({"guided_choice": ["x", "y"]}, "choice"),
    ({"guided_grammar": 'start: "x"'}, "grammar"),
])
def test_structured_output_spellings_map_to_one_params(extra, field):
    for req in (chat(**extra), parse_body(json.dumps({"prompt": "x", **extra}).encode(), CompletionRequest, LIMITS)):
        so = to_sampling_params(req, None).structured_outputs
        assert so is not None and so.set_fields() == [field]
    assert to_sampling_params(chat(response_format={"type": "text"}), None).structured_outputs is None


def test_structured_output_errors_name_the_field():
    def param(**kw):
        return error_param(json.dumps({"messages": MSGS, **kw}).encode(), ChatCompletionRequest)

    assert param(response_format={"type": "json_schema"}) == "response_format.json_schema"
    assert param(response_format={"type": "yaml"}) == "response_format.type"
    assert param(response_format={"type": "json_schema", "json_schema": {"schema": [1]}}) == \
        "response_format.json_schema.schema"
    assert param(structured_outputs={"regex": "a", "choice": ["b"]}) == "structured_outputs"
    assert param(structured_outputs={"json_shema": {}}) == "structured_outputs.json_shema"
    assert param(guided_choice=[]) == "guided_choice"
    assert param(guided_regex="a", response_format={"type": "json_object"}) == "guided_regex"
    assert param(guided_json=5) == "guided_json"
