"""Tool calling and thinking controls end to end: the official openai client against a real `deepserve
serve` of the demo model (random weights, so only the grammar makes the calls valid). Arguments are checked
with jsonschema; the reasoning budget is counted in the demo tokenizer's own tokens (transformers)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from serverkit import ADMIN

from deepserve import demo

MODEL = "deepserve-demo"
MSG = [{"role": "user", "content": "What is the weather in Paris for the next days?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 5}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory(["--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v3",
                           "--reasoning-parser", "deepseek_r1"])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=ADMIN, max_retries=0, timeout=120)


def _validate(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_always_gives_valid_calls(client):
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=400)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        _validate(choice.message.tool_calls)


def test_named_function_gives_exactly_that_call(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice=named,
                                           temperature=1.0, seed=seed, max_tokens=200)
        calls = r.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["get_time"]
        _validate(calls)


def test_stream_reassembles_into_the_same_calls(client):
    kwargs = dict(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required", temperature=1.0, seed=7,
                  max_tokens=400)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish, chunks_with_args = None, 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                if d.id is not None:  # the first delta of a call: id, type and the name
                    assert d.index not in calls and d.type == "function" and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                if d.function.arguments:
                    chunks_with_args += 1
                    calls[d.index]["arguments"] += d.function.arguments
    assert finish == "tool_calls"
    assert chunks_with_args > len(calls)  # arguments arrived in fragments, not whole
    got = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    assert got == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_tool_history_renders_and_continues(client):
    first = client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=1, max_tokens=400).choices[0].message
    history = [*MSG, first.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"} for c in first.tool_calls]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, seed=2, max_tokens=400)
    _validate(r.choices[0].message.tool_calls)
    # The prompt grew by the rendered calls and results: the template's markup, one token per marker.
    base = client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert r.usage.prompt_tokens > base.usage.prompt_tokens + 10


def _prompt_tokens(c, **kwargs) -> int:
    return c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1, **kwargs).usage.prompt_tokens


def _tokenize(srv, **body) -> int:
    r = httpx.post(f"{srv.url}/tokenize", json={"messages": MSG, **body}, headers={"Authorization": f"Bearer {ADMIN}"},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_auto_without_the_flag_names_it_and_template_kwargs_reach_the_template(server_factory, server, client):
    srv = server_factory(["--default-chat-template-kwargs", '{"thinking": true}'])
    c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=ADMIN, max_retries=0, timeout=60)
    # thinking (server default, or the request's own) adds the <think> token to the generation prompt.
    base = _prompt_tokens(client)
    assert _prompt_tokens(c) == base + 1
    assert _prompt_tokens(client, extra_body={"chat_template_kwargs": {"thinking": True}}) == base + 1
    # /tokenize counts the prompt a chat request gets: the server's defaults under the request's own kwargs.
    assert _tokenize(server) == base and _tokenize(srv) == base + 1
    assert _tokenize(server, chat_template_kwargs={"thinking": True}) == base + 1
    assert _tokenize(srv, chat_template_kwargs={"thinking": False}) == _prompt_tokens(
        c, extra_body={"chat_template_kwargs": {"thinking": False}})
    assert _tokenize(server, add_generation_prompt=False) < base
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, max_tokens=4)
    advice = e.value.message
    assert "--enable-auto-tool-choice" in advice and "--tool-call-parser" in advice
    # The advice holds on this server: each tool_choice it offers as an alternative without flags works.
    offered = [choice for choice in ("required", "none") if f'send tool_choice "{choice}"' in advice]
    assert offered == ["none"], advice
    assert c.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="none", max_tokens=2).choices
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required", max_tokens=4)
    assert "--tool-call-parser" in e.value.message


def test_bad_tool_requests_are_400_naming_the_field(client):
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                             "properties": {"a": {"type": 7}}}}}]
    cases = [
        (dict(tools=bad_schema, tool_choice="required"), "tools.0.function.parameters"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice.function.name"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=TOOLS, extra_body={"chat_template_kwargs": {"tools": []}}), "chat_template_kwargs.tools"),
        # a stop string could end the output inside an enforced call's arguments
        (dict(tools=TOOLS, tool_choice="required", stop=["}"]), "stop"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, **kwargs)
        assert e.value.body["param"] == param, e.value.body


def test_thinking_token_budget_is_respected(client):
    for budget, seed in ((0, 0), (3, 1), (12, 2)):
        for kwargs in ({"thinking": True}, {}):  # the template opens <think>, or the grammar writes it
            r = client.chat.completions.create(
                model=MODEL, messages=MSG, temperature=1.0, seed=seed, max_tokens=60, logprobs=True,
                extra_body={"thinking_token_budget": budget, "chat_template_kwargs": kwargs})
            # The sampled tokens themselves: </think> comes after at most `budget` reasoning tokens.
            tokens = [t.token for t in r.choices[0].logprobs.content]
            end = tokens.index(demo.END_THINK)
            start = tokens.index(demo.THINK) + 1 if not kwargs else 0
            assert end - start <= budget, (budget, kwargs, tokens)
            assert demo.END_THINK not in (r.choices[0].message.reasoning_content or "")
            # The usage counts the same tokens (vLLM's reasoning_tokens: neither marker): it read N + 1, and
            # N + 2 where the grammar wrote <think>.
            assert r.usage.completion_tokens_details.reasoning_tokens == end - start, (budget, kwargs, tokens)


def test_reasoning_then_required_calls(client):
    """A thinking budget and a required call in one grammar: reasoning, </think>, then the calls; the
    reasoning parser and the tool parser each take their part, streamed and not."""
    kwargs = dict(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required", temperature=1.0, seed=5,
                  max_tokens=400, extra_body={"thinking_token_budget": 4, "chat_template_kwargs": {"thinking": True}})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    _validate(choice.message.tool_calls)
    assert choice.message.content is None and demo.END_THINK not in (choice.message.reasoning_content or "")
    reasoning, names = "", []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            names += [d.function.name for d in c.delta.tool_calls or [] if d.id is not None]
    assert reasoning == (choice.message.reasoning_content or "")
    assert names == [c.function.name for c in choice.message.tool_calls]


def test_parallel_calls_take_v3s_newline_and_still_end(client):
    """The demo writes DeepSeek-V3's markup, whose template puts one "\\n" between two calls: the grammar
    makes the model write exactly that between calls (read from the sampled tokens), the markup still
    ends, and a streamed response with several calls reassembles into the same calls."""
    several = None
    for seed in range(6):
        kwargs = dict(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
                      max_tokens=600)
        choice = client.chat.completions.create(logprobs=True, **kwargs).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        _validate(choice.message.tool_calls)
        tokens = [t.token for t in choice.logprobs.content]
        ends = [i for i, t in enumerate(tokens) if t == demo.CALL_END]
        assert len(ends) == len(choice.message.tool_calls)
        for i in ends[:-1]:  # between two calls: exactly the newline
            assert tokens[i + 1:i + 3] == ["\n", demo.CALL_BEGIN], tokens[i:i + 3]
        assert tokens[ends[-1] + 1:] == [demo.CALLS_END]
        if len(ends) > 1 and several is None:
            several = kwargs, choice.message.tool_calls
    assert several is not None, "no seed gave two calls: the gap was never exercised"
    kwargs, calls = several
    streamed: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for d in (d for c in chunk.choices for d in c.delta.tool_calls or []):
            if d.id is not None:
                streamed[d.index] = [d.function.name, ""]
            streamed[d.index][1] += d.function.arguments or ""
    assert [tuple(streamed[k]) for k in sorted(streamed)] == [(c.function.name, c.function.arguments) for c in calls]


def test_thinking_on_with_required_calls_reasons_first(client, server):
    """DeepSeek-V3.1's thinking mode (the template opens <think>) with tool_choice required and no budget:
    the output starts in the reasoning, which the reasoning parser returns as reasoning_content; the calls
    may only follow </think>, which logit_bias forbids here, so the output runs to max_tokens in the reasoning.
    With thinking off (the prompt closes </think>) the calls come at once."""
    end_think = httpx.post(f"{server.url}/tokenize", json={"prompt": demo.END_THINK, "add_special_tokens": False},
                           headers={"Authorization": f"Bearer {ADMIN}"}).json()["tokens"]
    assert len(end_think) == 1
    base = dict(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required", temperature=1.0, seed=3)
    think = dict(extra_body={"chat_template_kwargs": {"thinking": True}}, logit_bias={str(end_think[0]): -100})
    choice = client.chat.completions.create(max_tokens=24, logprobs=True, **think, **base).choices[0]
    tokens = [t.token for t in choice.logprobs.content]
    assert choice.finish_reason == "length" and demo.END_THINK not in tokens
    assert not set(tokens) & {demo.CALLS_BEGIN, demo.CALL_BEGIN}  # no call inside the reasoning
    assert choice.message.reasoning_content and not choice.message.tool_calls and choice.message.content is None
    reasoning = ""
    for chunk in client.chat.completions.create(max_tokens=24, stream=True, **think, **base):
        for c in chunk.choices:
            assert not c.delta.tool_calls and not c.delta.content
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
    assert reasoning == choice.message.reasoning_content
    off = client.chat.completions.create(max_tokens=400, extra_body={"chat_template_kwargs": {"thinking": False}},
                                         **base).choices[0]
    assert off.finish_reason == "tool_calls" and off.message.model_extra.get("reasoning_content") is None
    _validate(off.message.tool_calls)


class Forecast(BaseModel):
    city: str = Field(max_length=6)
    days: int = Field(ge=1, le=7)


def test_structured_output_is_content_under_the_reasoning_parser(client):
    """A response_format grammar holds from the first token (no thinking budget): the JSON is the answer, so
    the reasoning parser leaves it in content and the openai client's parse() fills .parsed, streamed too.
    With thinking off (the prompt closes </think>) it is content as before."""
    for extra in ({}, {"chat_template_kwargs": {"thinking": False}}):
        r = client.chat.completions.parse(model=MODEL, messages=MSG, temperature=1.0, seed=4, max_tokens=200,
                                          response_format=Forecast, extra_body=extra)
        message = r.choices[0].message
        assert isinstance(message.parsed, Forecast), message
        assert (message.model_extra or {}).get("reasoning_content") is None
    rf = {"type": "json_object"}
    whole = client.chat.completions.create(model=MODEL, messages=MSG, temperature=1.0, seed=6, max_tokens=200,
                                           response_format=rf).choices[0]
    assert whole.finish_reason == "stop" and isinstance(json.loads(whole.message.content), dict)
    content, reasoning = "", ""
    for chunk in client.chat.completions.create(model=MODEL, messages=MSG, temperature=1.0, seed=6, max_tokens=200,
                                                response_format=rf, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
    assert (content, reasoning) == (whole.message.content, "")


def test_thinking_budget_then_json_keeps_the_reasoning_apart(client):
    """With a thinking budget the reasoning comes first (reasoning_content) and the JSON follows </think>
    as content: that split stays."""
    r = client.chat.completions.parse(model=MODEL, messages=MSG, temperature=1.0, seed=2, max_tokens=200,
                                      response_format=Forecast, extra_body={"thinking_token_budget": 3})
    message = r.choices[0].message
    assert isinstance(message.parsed, Forecast), message
    assert demo.THINK not in message.content and demo.END_THINK not in message.content


def test_thinking_budget_then_regex_and_choice(client):
    """A regex or choice answer follows a bounded reasoning too (the prompt opens <think>): the answer is
    content and matches; the reasoning is reasoning_content."""
    for structured, check in (({"regex": "(yes|no)-[0-9]"}, lambda c: re.fullmatch("(yes|no)-[0-9]", c)),
                              ({"choice": ["alpha", "beta"]}, lambda c: c in ("alpha", "beta"))):
        r = client.chat.completions.create(
            model=MODEL, messages=MSG, temperature=1.0, seed=4, max_tokens=60,
            extra_body={"structured_outputs": structured, "thinking_token_budget": 3,
                        "chat_template_kwargs": {"thinking": True}})
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "stop" and check(message.content), message
        assert demo.END_THINK not in (message.reasoning_content or "")


def test_a_function_without_parameters_works_with_every_tool_choice(client):
    """OpenAI lets a function leave out `parameters` (it takes none): the template and the grammar both
    get an empty object schema, so required gives arguments {} and auto is not refused by the template."""
    bare = [{"type": "function", "function": {"name": "ping"}}, *TOOLS]
    named = {"type": "function", "function": {"name": "ping"}}
    schemas = {**SCHEMAS, "ping": {"type": "object", "maxProperties": 0}}
    for seed in range(2):
        r = client.chat.completions.create(model=MODEL, messages=MSG, tools=bare, temperature=1.0, seed=seed,
                                           max_tokens=400, tool_choice=named)
        calls = r.choices[0].message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("ping", {})]
    for choice in ("required", "auto"):
        r = client.chat.completions.create(model=MODEL, messages=MSG, tools=bare, tool_choice=choice, seed=1,
                                           temperature=1.0, max_tokens=400)
        calls = r.choices[0].message.tool_calls or []
        if choice == "required":  # the grammar makes the output one or more calls, and ends them
            assert r.choices[0].finish_reason == "tool_calls" and calls, r.choices[0]
        else:  # the model may write text, or nothing the parser reads as a call
            assert r.choices[0].finish_reason in ("tool_calls", "stop", "length")
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
