"""End to end against a real server (demo model, engine core process, reasoning parser on):
the openai client for the OpenAI surface, raw httpx and sockets for auth, validation and disconnects."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time

import httpx
import openai
import pytest
from serverkit import ADMIN, METRICS, OTHER_MODEL, USER, auth, metric, wait_until, write_keys

from deepserve.server.audit import verify_chain
from deepserve.server.auth import hash_key

MODEL = "deepserve-demo"
MSG = [{"role": "user", "content": "Tell me about paged attention."}]


@pytest.fixture(scope="module")
def srv(server_factory, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    keys = write_keys(str(tmp / "keys.yaml"))
    audit = str(tmp / "audit.jsonl")
    s = server_factory(["--api-keys", keys, "--reasoning-parser", "deepseek_r1", "--audit-log", audit,
                        "--audit-log-prompts", "--max-body-bytes", "200000"])
    s.keys_path, s.audit_path = keys, audit
    return s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=USER, max_retries=0, timeout=60)


def post(srv, path: str, body, key: str = USER, **kw) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{srv.url}{path}", content=data, headers={**auth(key), **kw.pop("headers", {})},
                      timeout=60, **kw)


# ------------------------------------------------------------------ the OpenAI surface


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    card = client.models.retrieve(MODEL)  # GET /v1/models/{id}
    assert card.id == MODEL and card.object == "model" and card.model_dump()["max_model_len"] == 1024
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found" and MODEL in e.value.body["message"]


def test_chat_reasoning_and_usage(client):
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_completion_tokens=12, seed=1)
    choice = r.choices[0]
    # The random demo model never writes </think>, so with deepseek_r1 everything is reasoning.
    assert choice.message.model_extra["reasoning_content"]
    assert choice.message.content is None
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.completion_tokens_details.reasoning_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_stream_equals_non_stream(client):
    kw = dict(model=MODEL, messages=MSG, max_tokens=16, seed=7, temperature=0.8)
    whole = client.chat.completions.create(**kw).choices[0].message.model_extra["reasoning_content"]
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    streamed = "".join((c.choices[0].delta.model_extra.get("reasoning_content") or "")
                       for c in chunks if c.choices)
    assert streamed == whole
    # Each choice opens with its role alone (OpenAI's and vLLM's first chunk), whatever the first token brought.
    assert chunks[0].choices[0].delta.model_dump(exclude_none=True) == {"role": "assistant", "content": ""}
    assert not any(c.choices[0].delta.role for c in chunks[1:] if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_each_streamed_chat_choice_opens_with_its_role(client):
    kw = dict(model=MODEL, messages=MSG, max_tokens=6, n=2, seed=4, temperature=0.9, logprobs=True, top_logprobs=2)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}))
    for index in (0, 1):
        mine = [c for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].choices[0].delta.model_dump(exclude_none=True) == {"role": "assistant", "content": ""}
        assert mine[0].choices[0].logprobs is None and mine[0].usage is not None  # every chunk's running usage
        tokens = [lp for c in mine[1:] for lp in c.choices[0].logprobs.content]
        assert len(tokens) == 6 and all(len(t.top_logprobs) == 2 for t in tokens)


def test_completions_n2_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, n=2, logprobs=3, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        assert len(c.logprobs.tokens) == 8 == len(c.logprobs.token_logprobs)
        assert all(1 <= len(top) <= 4 for top in c.logprobs.top_logprobs)
    assert r.usage.completion_tokens == 16


def test_completions_stream_n2(client):
    kw = dict(model=MODEL, prompt="Hello", max_tokens=10, n=2, seed=11, temperature=0.7)
    whole = {c.index: c.text for c in client.completions.create(**kw).choices}
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == whole


def test_chat_top_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=5, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob <= 0 for t in content)


def test_stop_string_cuts_text(client):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=24, seed=5, temperature=0.9)
    full = client.completions.create(**kw).choices[0].text
    # A stop string from the middle of the unconstrained text: same seed, so same text up to it.
    starts = [i for i in range(4, len(full) - 2) if full[i:i + 2].isalpha()]
    if not starts:
        pytest.skip("generated text has no usable stop string")
    stop = full[starts[len(starts) // 2]: starts[len(starts) // 2] + 2]
    r = client.completions.create(**kw, stop=[stop]).choices[0]
    assert r.finish_reason == "stop"
    assert r.text == full[: full.index(stop)]


def test_seed_is_reproducible(client):
    kw = dict(model=MODEL, prompt="seeded", max_tokens=8, seed=1234, temperature=1.0)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_completions_default_to_16_tokens(srv):
    r = post(srv, "/v1/completions", {"prompt": "no limit given", "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_n2_with_the_largest_seed(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, n=2, seed=2**64 - 1)
    assert sorted(c.index for c in r.choices) == [0, 1]


def test_bad_request_never_kills_the_engine(srv):
    # No max_tokens: chat may run to the end of the context, which is shorter than min_tokens.
    for stream in (False, True):
        r = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                               "min_tokens": 100000, "stream": stream})
        if r.status_code == 200:  # refused once the stream had started: one error event, no [DONE]
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            assert "[DONE]" not in r.text
            error = events[-1]["error"]
        else:
            assert r.status_code == 400, r.text
            error = r.json()["error"]
        assert error["param"] == "min_tokens" and "min_tokens" in error["message"], error
    r = post(srv, "/v1/completions", {"prompt": "hi", "min_tokens": 20})  # above the default 16
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
    assert httpx.get(f"{srv.url}/health").status_code == 200
    assert post(srv, "/v1/chat/completions", {"messages": MSG, "max_tokens": 3}).status_code == 200


def sse_chunks(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_stream_sends_no_empty_chunks(srv):
    # A long stop string holds back 19 characters, so the first tokens produce no text to send.
    body = {"prompt": "The quick brown fox", "max_tokens": 24, "seed": 5, "temperature": 0.9,
            "ignore_eos": True, "stop": ["QQQQQQQQQQQQQQQQQQQQ"]}
    whole = post(srv, "/v1/completions", body).json()["choices"][0]["text"]
    chunks = sse_chunks(post(srv, "/v1/completions", {**body, "stream": True}))
    assert all(c["choices"][0]["text"] or c["choices"][0]["finish_reason"] for c in chunks), chunks
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    chat = {"messages": MSG, "max_tokens": 24, "seed": 5, "stream": True, "stop": ["QQQQQQQQQQQQQQQQQQQQ"]}
    chunks = sse_chunks(post(srv, "/v1/chat/completions", chat))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    for c in chunks:
        choice = c["choices"][0]
        assert any(choice["delta"].get(k) for k in ("role", "content", "reasoning_content")) \
            or choice["finish_reason"], chunks


def test_request_id_header_matches_body(srv):
    r = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert r.json()["id"] == f"cmpl-{r.headers['x-request-id']}"
    # A refusal carries the id too: the audit log's record of it holds the same.
    refused = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 9})
    assert refused.status_code == 400 and re.fullmatch(r"[0-9a-f]{32}", refused.headers["x-request-id"])
    records = [json.loads(line) for line in open(srv.audit_path)]
    assert [r["outcome"] for r in records if r.get("request_id") == refused.headers["x-request-id"]] == \
        ["rejected_400"]
    # A caller's X-Request-ID (a router's, a gateway's) is audited beside ours; one that is not a plain token
    # of at most 128 characters is ignored.
    traced = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers={"X-Request-ID": "gw:trace-7"})
    odd = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers={"X-Request-ID": "a b"})
    records = {r.get("request_id"): r for r in map(json.loads, open(srv.audit_path))}
    assert records[traced.headers["x-request-id"]]["upstream_request_id"] == "gw:trace-7"
    assert "upstream_request_id" not in records[odd.headers["x-request-id"]]


def test_a_slow_tokenize_body_holds_up_no_other_tokenize(srv):
    # The one-at-a-time gate of /tokenize covers the tokenizer's work, not the wait for a body: a sender
    # trickling its bytes (here: stopped after one) must not make another key's /tokenize wait for it.
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as slow:
        slow.sendall(f"POST /tokenize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 40\r\n\r\n{".encode())
        time.sleep(0.3)  # its handler is now waiting for the rest of the body
        started = time.monotonic()
        r = post(srv, "/tokenize", {"prompt": "hello"})
        assert r.status_code == 200 and time.monotonic() - started < 5, time.monotonic() - started


def test_tokenize_detokenize(srv):
    tok = post(srv, "/tokenize", {"prompt": "hello world", "add_special_tokens": False}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 1024
    assert post(srv, "/detokenize", {"tokens": tok["tokens"]}).json()["prompt"] == "hello world"
    chat = post(srv, "/tokenize", {"messages": MSG}).json()
    assert chat["count"] > tok["count"]
    # add_special_tokens: a prompt gets the tokenizer's by default; messages do not (their template wrote
    # them, as a chat request's prompt), unless asked: then they come on top of the template's.
    with_special = post(srv, "/tokenize", {"prompt": "hello world"}).json()["tokens"]
    added = len(with_special) - len(tok["tokens"])
    assert added > 0, "the demo tokenizer adds a BOS; without one this test checks nothing"
    asked = post(srv, "/tokenize", {"messages": MSG, "add_special_tokens": True}).json()["tokens"]
    assert len(asked) == chat["count"] + added and asked[:added] == with_special[:added]
    assert post(srv, "/tokenize", {"messages": MSG, "add_special_tokens": False}).json() == chat
    assert post(srv, "/detokenize", {"tokens": [10**6]}).json()["error"]["param"] == "tokens"


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": MSG, "chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs.add_generation_prompt"),  # reserved: the server passes it itself
    ({"prompt": "hi", "chat_template_kwargs": {"thinking": True}}, "chat_template_kwargs"),  # no template
    ({"prompt": "hi", "add_generation_prompt": False}, "add_generation_prompt")])
def test_tokenize_refuses_template_fields_it_would_not_use(srv, body, param):
    r = post(srv, "/tokenize", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ------------------------------------------------------------------ vLLM's prompt fields


def _prompt_ids(srv, **body) -> list[int]:
    return post(srv, "/tokenize", body).json()["tokens"]


def _check_prompt_logprobs(lps: list, ids: list[int], k: int) -> None:
    """vLLM's shape: None for the first token, then by token id the prompt's own token and the top k."""
    assert len(lps) == len(ids) and lps[0] is None
    for tid, pos in zip(ids[1:], lps[1:], strict=True):
        assert str(tid) in pos and 1 <= len(pos) <= k + 1
        assert all(set(v) == {"logprob", "rank", "decoded_token"} and v["logprob"] <= 0 for v in pos.values())


def test_prompt_logprobs_on_both_endpoints(client, srv):
    ids = _prompt_ids(srv, prompt="Paged attention keeps the cache")
    r = client.completions.create(model=MODEL, prompt="Paged attention keeps the cache", max_tokens=2,
                                  extra_body={"prompt_logprobs": 2})
    _check_prompt_logprobs(r.choices[0].model_extra["prompt_logprobs"], ids, 2)
    assert r.usage.prompt_tokens == len(ids)
    # Chat: beside the choices, as vLLM returns it; the ids are the templated prompt's.
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, extra_body={"prompt_logprobs": 0})
    _check_prompt_logprobs(r.model_extra["prompt_logprobs"], _prompt_ids(srv, messages=MSG), 0)
    for create, kw in ((client.completions.create, {"prompt": "hi"}), (client.chat.completions.create,
                                                                      {"messages": MSG})):
        with pytest.raises(openai.BadRequestError) as e:  # as in vLLM: not with stream
            create(model=MODEL, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1}, **kw)
        assert e.value.body["param"] == "prompt_logprobs"


def test_echo_prepends_the_prompt_and_its_logprobs(client, srv):
    prompt = "The quick brown fox"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=6, seed=4, temperature=0.9)
    plain = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw, echo=True).choices[0].text == prompt + plain
    r = client.completions.create(**kw, echo=True, logprobs=2)
    lps, ids = r.choices[0].logprobs, _prompt_ids(srv, prompt=prompt)
    assert len(lps.tokens) == len(ids) + 6 == len(lps.token_logprobs) == len(lps.text_offset)
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None and lps.text_offset[0] == 0
    # one running total of the tokens' lengths through prompt (its bos included) and output, as vLLM's
    assert lps.text_offset == [sum(len(t) for t in lps.tokens[:i]) for i in range(len(lps.tokens))]
    assert all(x is not None and x <= 0 for x in lps.token_logprobs[1:])
    assert r.choices[0].text == prompt + plain and r.usage.completion_tokens == 6
    # The prompt tokens' logprobs are the prompt_logprobs of those tokens (echo with logprobs asks for them).
    prompt_lps = r.choices[0].model_extra["prompt_logprobs"]
    _check_prompt_logprobs(prompt_lps, ids, 2)
    assert lps.token_logprobs[1:len(ids)] == [prompt_lps[i][str(t)]["logprob"] for i, t in enumerate(ids) if i]
    # Streamed: the prompt comes first, in the choice's first chunk, and the rest follows as without echo.
    chunks = list(client.completions.create(**kw, echo=True, logprobs=2, stream=True))
    assert chunks[0].choices[0].text.startswith(prompt)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt + plain
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert streamed == lps.tokens and offsets == lps.text_offset
    # A token-id prompt is echoed as its text.
    r = client.completions.create(**{**kw, "prompt": ids}, echo=True)
    assert r.choices[0].text.startswith(post(srv, "/detokenize", {"tokens": ids}).json()["prompt"])


def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(client, srv):
    """What evaluation harnesses send for loglikelihoods (vLLM's and the legacy OpenAI API's form): the prompt
    comes back with its logprobs, the same as the prompt part of an echo that generates, and no output."""
    prompt = "The quick brown fox"
    ids = _prompt_ids(srv, prompt=prompt)
    kw = dict(model=MODEL, prompt=prompt, echo=True, logprobs=1, temperature=0)
    full = client.completions.create(**kw, max_tokens=3).choices[0].logprobs
    ttft = "deepserve:time_to_first_token_seconds_count"
    before = metric(httpx.get(f"{srv.url}/metrics", headers=auth(METRICS)).text, ttft)
    r = client.completions.create(**kw, max_tokens=0)
    assert metric(httpx.get(f"{srv.url}/metrics", headers=auth(METRICS)).text, ttft) == before + 1  # its answer
    lps = r.choices[0].logprobs
    assert r.choices[0].text == prompt and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    assert lps.tokens == full.tokens[:len(ids)] and lps.token_logprobs == full.token_logprobs[:len(ids)]
    assert lps.text_offset == full.text_offset[:len(ids)]
    chunks = list(client.completions.create(**kw, max_tokens=0, stream=True))
    assert [c.choices[0].text for c in chunks] == [prompt]
    assert chunks[0].choices[0].finish_reason == "length" and chunks[0].choices[0].logprobs.tokens == lps.tokens
    assert client.completions.create(**{**kw, "logprobs": None}, max_tokens=0).choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)
    assert e.value.body["param"] == "max_tokens" and "echo" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # a prompt as long as the context: the sampled token's room
        client.completions.create(model=MODEL, prompt=[5] * 1024, max_tokens=0, echo=True)
    assert e.value.body["param"] == "prompt" and "max_tokens 0 still samples one token" in e.value.message


def test_logit_bias_bans_and_forces_tokens_on_both_endpoints(client, srv):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=4, temperature=0, logprobs=0,
              extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0]
    first = _prompt_ids(srv, prompt=plain.logprobs.tokens[0], add_special_tokens=False)[0]
    banned = client.completions.create(**kw, logit_bias={str(first): -100}).choices[0]
    assert banned.logprobs.tokens[0] != plain.logprobs.tokens[0]
    forced_id = _prompt_ids(srv, prompt=" fox", add_special_tokens=False)[-1]
    forced = client.completions.create(**kw, logit_bias={str(forced_id): 100}).choices[0]
    one = post(srv, "/detokenize", {"tokens": [forced_id]}).json()["prompt"]
    assert forced.text == one * 4
    # the logprobs stay the model's own (vLLM's default): the forced token was not the model's first choice
    assert forced.logprobs.token_logprobs[0] < plain.logprobs.token_logprobs[0]
    chat = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3, temperature=0.8,
                                          logit_bias={str(forced_id): 100}, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == one * 3 or chat.choices[0].message.reasoning_content == one * 3
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        **{**kw, "logprobs": None}, logit_bias={str(forced_id): 100}, stream=True) if c.choices)
    assert streamed == one * 4
    for bias, param in (({"99999999": 1}, "logit_bias"), ({"5": 101}, "logit_bias.5"),
                        ({"five": 1}, "logit_bias.five")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1, logit_bias=bias)
        assert e.value.body["param"] == param, e.value.message


def test_continue_final_message_leaves_the_last_message_open(client, srv):
    history = [*MSG, {"role": "assistant", "content": "Paged attention is"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    ids = _prompt_ids(srv, messages=history, **flags)
    text = post(srv, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert text.endswith("Paged attention is")  # not closed: no end-of-sentence, no new assistant turn
    r = client.chat.completions.create(model=MODEL, messages=history, max_tokens=3, extra_body=flags)
    assert r.usage.prompt_tokens == len(ids)
    closed = client.chat.completions.create(model=MODEL, messages=history, max_tokens=3)
    assert closed.usage.prompt_tokens == len(_prompt_ids(srv, messages=history)) != len(ids)
    with pytest.raises(openai.BadRequestError) as e:  # as in vLLM: not with a new generation prompt
        client.chat.completions.create(model=MODEL, messages=history, max_tokens=3,
                                       extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "continue_final_message"


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(("raw", "param"), [
    (b'{"prompt": "x", "temperature": NaN}', "temperature"),
    (b'{"prompt": "x", "top_p": Infinity}', "top_p"),
    (b'{"prompt": "x", "temperature": 1e999}', "temperature"),
    (b'{"prompt": "x", "max_tokens": -1}', "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 100000000000000000000}', "max_tokens"),
    (b'{"prompt": "x", "n": 17}', "n"),
    (b'{"prompt": "x", "n": 1.5}', "n"),
    (b'{"prompt": "x", "logprobs": 21}', "logprobs"),
    (b'{"prompt": "x", "seed": 18446744073709551616}', "seed"),
    (b'{"prompt": "x", "frequency_penalty": -3}', "frequency_penalty"),
    (b'{"prompt": "x", "stop": ["a","b","c","d","e","f","g","h","i"]}', "stop"),
    (b'{"prompt": "x", "temprature": 0.5}', "temprature"),
    (b'{"prompt": [1, -2]}', "prompt.1"),
    (b'{"prompt": ""}', "prompt"),
    (b'{"prompt": [""]}', "prompt"),  # was 200 while "" was 400
    (b'{"prompt": [[]]}', "prompt"),
    (b'{"prompt": "x", "model": "nope"}', "model"),
])
def test_bad_numbers_name_the_field(srv, raw, param):
    r = post(srv, "/v1/completions", raw)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_a_number_too_long_for_python_is_a_counted_400(srv):
    r = post(srv, "/v1/completions", b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}")
    assert r.status_code == 400 and "number too long to read" in r.json()["error"]["message"], r.text
    assert r.headers["x-request-id"]  # a refusal, with its id (it was an uncaught 500 without one)
    assert post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200


def test_stop_token_ids_outside_the_vocabulary_are_refused_like_prompt_ids(client):
    """The vocabulary size comes from the prompt-id check; stop_token_ids is held to the same bound, on both
    endpoints, and the largest id in the vocabulary is still accepted."""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[10**6], max_tokens=1)
    vocab = int(re.search(r"outside the vocabulary \[0, (\d+)\)", e.value.message).group(1))
    for stop in ([vocab], [5, 999999]):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"stop_token_ids": stop})
        assert e.value.body["param"] == "stop_token_ids" and f"[0, {vocab})" in e.value.message
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1,
                                           extra_body={"stop_token_ids": stop})
        assert e.value.body["param"] == "stop_token_ids"
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"stop_token_ids": [vocab - 1]})
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_several_prompts_answer_as_that_many_requests_in_one_body(client, srv):
    """OpenAI's list form: prompt i's n choices at indices i * n .. i * n + n - 1, each what the prompt alone
    gets (greedy), usage summed; text and token-id prompts alike; a list of one is that prompt."""
    prompts = ["The quick brown fox", "Hello", "Paged attention is"]
    kw = dict(model=MODEL, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=one, **kw) for one in prompts]
    both = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in both.choices] == list(range(6))
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert both.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone) == 30
    ids = [_prompt_ids(srv, prompt=one) for one in prompts[:2]]
    by_ids = client.completions.create(prompt=ids, **kw)
    assert [c.text for c in by_ids.choices] == [a.choices[0].text for a in alone[:2]]
    scored = client.completions.create(prompt=prompts[:2], echo=True, logprobs=1, **{**kw, "max_tokens": 0})
    assert [c.text for c in scored.choices] == prompts[:2] and scored.usage.completion_tokens == 0
    assert [len(c.logprobs.tokens) for c in scored.choices] == [len(i) for i in ids]
    for one in (["Hello"], [[5, 6]]):
        assert len(client.completions.create(model=MODEL, prompt=one, max_tokens=1).choices) == 1
    # Streamed: each choice's chunks carry its index in the list; their text and the usage as without stream.
    chunks = list(client.completions.create(prompt=prompts, n=2, stream=True, stream_options={"include_usage": True},
                                            **kw))
    texts = {}
    for c in chunks[:-1]:
        texts[c.choices[0].index] = texts.get(c.choices[0].index, "") + c.choices[0].text
    assert [texts[i] for i in range(6)] == [c.text for c in both.choices]
    assert not chunks[-1].choices and chunks[-1].usage.model_dump() == both.usage.model_dump()
    assert len({c.id for c in chunks}) == 1
    echoed = list(client.completions.create(prompt=prompts[:2], echo=True, stream=True, **kw))
    firsts = {}
    for c in echoed:
        firsts.setdefault(c.choices[0].index, c.choices[0].text)
    assert [firsts[i].startswith(prompts[i]) for i in range(2)] == [True, True]


def test_a_bad_prompt_in_a_list_refuses_the_request_naming_it(client, srv):
    for body, param in (({"prompt": ["fine", ""]}, "prompt.1"), ({"prompt": [[5], [5] * 5000]}, "prompt.1"),
                        ({"prompt": ["x"] * 257}, "prompt")):
        r = post(srv, "/v1/completions", {**body, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "maximum context length" in post(srv, "/v1/completions", {"prompt": [[5], [5] * 5000]}).json()[
        "error"]["message"]


def test_chat_validation(srv):
    bad = [({"messages": MSG, "top_logprobs": 30, "logprobs": True}, "top_logprobs"),
           ({"messages": MSG, "chat_template": "{{ evil }}"}, "chat_template"),
           ({"messages": [{"role": "user", "content": "x" * 10}], "stop": "y" * 300}, "stop"),
           ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
           ({"messages": []}, "messages")]
    for body, param in bad:
        r = post(srv, "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_malformed_bodies(srv):
    for raw in (b"{not json", b'{"prompt": "\xff\xfe"}', b"[1, 2]", b"", b'{"prompt": "\\ud800"}'):
        r = post(srv, "/v1/completions", raw)
        assert r.status_code == 400, (raw, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_context_length(srv):
    r = post(srv, "/v1/completions", {"prompt": [5] * 1000, "max_tokens": 100})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 5000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_size_limits(srv):
    r = post(srv, "/v1/completions", {"prompt": "x" * 300_000})
    assert r.status_code == 413
    r = httpx.get(f"{srv.url}/health", headers={"x-pad": "a" * 20_000})
    assert r.status_code == 431


# ------------------------------------------------------------------ auth


ROUTES = [("GET", "/v1/models", {}), ("GET", f"/v1/models/{MODEL}", None),
          ("POST", "/v1/completions", {"prompt": "a", "max_tokens": 1}),
          ("POST", "/v1/chat/completions", {"messages": MSG, "max_tokens": 1}),
          ("POST", "/tokenize", {"prompt": "a"}), ("POST", "/detokenize", {"tokens": [5]}),
          ("GET", "/metrics", None), ("GET", "/admin/usage", None), ("POST", "/admin/keys/reload", None),
          ("GET", "/admin/openapi.json", None)]
ALLOWED = {"admin": {r[1] for r in ROUTES},
           "user": {"/v1/models", f"/v1/models/{MODEL}", "/v1/completions", "/v1/chat/completions", "/tokenize",
                    "/detokenize"},
           "metrics": {"/metrics"}}


def call(srv, method: str, path: str, body, headers: dict) -> httpx.Response:
    content = json.dumps(body).encode() if body is not None else None
    return httpx.request(method, f"{srv.url}{path}", content=content, headers=headers, timeout=60)


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
def test_auth_matrix(srv, method, path, body):
    for headers in ({}, auth("sk-wrong-key-123"), {"Authorization": f"Basic {USER}"}, {"Authorization": USER},
                    {"X-Api-Key": ADMIN}):
        assert call(srv, method, path, body, headers).status_code == 401, headers
    for role, key in (("admin", ADMIN), ("user", USER), ("metrics", METRICS)):
        status = call(srv, method, path, body, auth(key)).status_code
        assert (status == 200) == (path in ALLOWED[role]), (role, path, status)
        if path not in ALLOWED[role]:
            assert status == 403


def test_key_for_another_model(srv):
    r = post(srv, "/v1/chat/completions", {"model": MODEL, "messages": MSG}, key=OTHER_MODEL)
    assert r.status_code == 403 and r.json()["error"]["param"] == "model"
    models = httpx.get(f"{srv.url}/v1/models", headers=auth(OTHER_MODEL)).json()["data"]
    assert models == []
    hidden = httpx.get(f"{srv.url}/v1/models/{MODEL}", headers=auth(OTHER_MODEL))
    assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "model_not_found"  # as in the list


def test_public_probes(srv):
    assert httpx.get(f"{srv.url}/health").status_code == 200
    assert httpx.get(f"{srv.url}/ready").json() == {"status": "ready"}


def raw_status(srv, target: str, extra_headers: str = "", host: str = "127.0.0.1") -> int:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\n{extra_headers}Connection: close\r\n\r\n".encode())
        return int(s.recv(4096).split(b" ", 2)[1])


@pytest.mark.parametrize("target", ["/metrics/", "//metrics", "/health/../metrics", "/v1/../metrics",
                                    "/METRICS", "/metrics%2F", "/health/%2e%2e/metrics", "/ready/../admin/usage",
                                    "/metrics?x=/health", "/./metrics", "/health%00/metrics",
                                    "http://127.0.0.1/metrics"])
def test_path_tricks_never_bypass_auth(srv, target):
    assert raw_status(srv, target) in (401, 404)


@pytest.mark.parametrize("host", ["127.0.0.1/health", "localhost:1/../health", "evil.example"])
def test_host_tricks_never_bypass_auth(srv, host):
    assert raw_status(srv, "/metrics", host=host) == 401
    assert raw_status(srv, "/health", host=host) == 200


@pytest.mark.parametrize("headers", ["X-Original-URL: /health\r\n",
                                     "X-Rewrite-URL: /health\r\n", "X-Forwarded-Prefix: /health\r\n",
                                     "X-Forwarded-For: 127.0.0.1\r\nX-Real-IP: 127.0.0.1\r\n"])
def test_header_tricks_never_bypass_auth(srv, headers):
    assert raw_status(srv, "/metrics", headers) == 401


def test_duplicate_authorization_headers_refused(srv):
    extra = f"Authorization: Bearer {ADMIN}\r\nAuthorization: Bearer {ADMIN}\r\n"
    assert raw_status(srv, "/metrics", extra) == 401


# ------------------------------------------------------------------ disconnects, metrics, audit, reload


def running(srv) -> float:
    return metric(httpx.get(f"{srv.url}/metrics", headers=auth(ADMIN)).text, "deepserve:num_requests_running")


def aborted(srv) -> int:
    usage = httpx.get(f"{srv.url}/admin/usage", headers=auth(ADMIN)).json()["keys"]
    return usage.get("user", {}).get("outcome_aborted", 0)


def test_stream_disconnect_aborts(srv):
    before = aborted(srv)
    body = {"prompt": "go", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, headers=auth(USER), timeout=60) as r:
        lines = r.iter_lines()  # keep a reference: a collected iterator closes the connection
        next(lines)
        assert wait_until(lambda: running(srv) == 1, timeout=10)
    # Closed mid-stream: aborted in the engine within a step, long before 1000 tokens.
    assert wait_until(lambda: running(srv) == 0, timeout=10)
    assert wait_until(lambda: aborted(srv) == before + 1, timeout=5)
    assert post(srv, "/v1/completions", {"prompt": "still", "max_tokens": 2}).status_code == 200


def test_non_stream_disconnect_aborts(srv):
    before = aborted(srv)
    body = json.dumps({"prompt": "go", "max_tokens": 1000, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {USER}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert wait_until(lambda: running(srv) == 1, timeout=10)
    assert wait_until(lambda: running(srv) == 0, timeout=10)
    assert wait_until(lambda: aborted(srv) == before + 1, timeout=5)


def test_metrics_names(srv):
    text = httpx.get(f"{srv.url}/metrics", headers=auth(METRICS)).text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
                 "request_queue_time_seconds_count", "num_preemptions_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_swapped_out_blocks_total", "num_swapped_in_blocks_total",
                 "prefix_cache_host_hits_total", "prefix_cache_host_stores_total"):
        metric(text, f"deepserve:{name}")
    assert metric(text, "deepserve:generation_tokens_total") > 0
    assert 'deepserve:key_requests_total{key="user",outcome="ok"}' in text
    assert 'deepserve:key_generation_tokens_total{key="user"}' in text


def sample(text: str, name: str, labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_move_with_the_usage_reported(srv, client):
    def scrape() -> dict[str, float]:
        text = httpx.get(f"{srv.url}/metrics", headers=auth(METRICS)).text
        ok = 'key="user",outcome="ok"'
        return {"prompt": metric(text, "deepserve:prompt_tokens_total"),
                "generation": metric(text, "deepserve:generation_tokens_total"),
                "user_ok": sample(text, "deepserve:key_requests_total", ok),
                "user_requests": sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                     if line.startswith('deepserve:key_requests_total{key="user",')),
                "user_prompt": sample(text, "deepserve:key_prompt_tokens_total", 'key="user"'),
                "user_generation": sample(text, "deepserve:key_generation_tokens_total", 'key="user"'),
                "running": metric(text, "deepserve:num_requests_running")}

    before = scrape()
    usages = [client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=7).usage,
              client.completions.create(model=MODEL, prompt="two of them", max_tokens=5, n=2).usage]
    stream = client.completions.create(model=MODEL, prompt="streamed", max_tokens=6, stream=True,
                                       stream_options={"include_usage": True})
    usages.append([c for c in stream][-1].usage)
    after = scrape()
    prompt, completion = sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages)
    assert completion > 0
    assert after["prompt"] - before["prompt"] == prompt == after["user_prompt"] - before["user_prompt"]
    assert after["generation"] - before["generation"] == completion
    assert after["user_generation"] - before["user_generation"] == completion
    assert after["user_ok"] - before["user_ok"] == 3 == after["user_requests"] - before["user_requests"]
    assert wait_until(lambda: scrape()["running"] == 0, timeout=10)


def test_audit_log_is_chained(srv):
    count, problem = verify_chain(srv.audit_path)
    assert problem is None and count > 10
    records = [json.loads(line) for line in open(srv.audit_path)]
    ok = [r for r in records if r["outcome"] == "ok"]
    assert ok and all(r["key"] in ("user", "api-key") and r["model"] == MODEL and r["latency_s"] > 0 for r in ok)
    assert any(r["key"] == "user" for r in ok) and any(r["key"] == "api-key" for r in ok)
    assert any("prompt" in r for r in ok)
    assert any(r["outcome"] == "denied_401" for r in records)


def test_audit_names_a_known_key_its_role_refuses(srv):
    """A 403 for a key the server knows (its role may not use the route) is recorded under that key's
    name; only an unknown or missing key (401) has none."""
    before = len(open(srv.audit_path).readlines())
    assert httpx.get(f"{srv.url}/admin/usage", headers=auth(METRICS), timeout=30).status_code == 403
    assert httpx.get(f"{srv.url}/admin/usage", headers=auth("sk-nobody-0000"), timeout=30).status_code == 401
    records = [json.loads(line) for line in open(srv.audit_path).readlines()[before:]]
    denied = [r for r in records if r["endpoint"] == "/admin/usage"]
    assert {(r["outcome"], r["key"]) for r in denied} == {("denied_403", "scraper"), ("denied_401", None)}


def test_sighup_reloads_keys(srv):
    new_key = "sk-test-added-later-0000"
    assert httpx.get(f"{srv.url}/v1/models", headers=auth(new_key)).status_code == 401
    write_keys(srv.keys_path, [{"name": "late", "key_hash": hash_key(new_key), "role": "user"}])
    os.kill(srv.proc.pid, signal.SIGHUP)
    assert wait_until(lambda: httpx.get(f"{srv.url}/v1/models", headers=auth(new_key)).status_code == 200, 10)
    time.sleep(0.1)
    assert srv.proc.poll() is None


def test_sighup_reopens_a_rotated_audit_log_and_the_chain_goes_on(srv, client):
    rotated = srv.audit_path + ".1"
    os.rename(srv.audit_path, rotated)  # what logrotate does, then it signals the server
    os.kill(srv.proc.pid, signal.SIGHUP)
    time.sleep(0.5)  # the signal is handled by the server's event loop
    client.completions.create(model=MODEL, prompt="after rotation", max_tokens=2)
    assert wait_until(lambda: os.path.exists(srv.audit_path) and os.path.getsize(srv.audit_path) > 0, 10)
    count, problem = verify_chain(rotated, srv.audit_path)
    assert problem is None and count > 10
    assert verify_chain(srv.audit_path)[1] is not None  # alone, the new file does not start the chain
    assert verify_chain(srv.audit_path, continues=True)[1] is None


def test_reloading_a_broken_key_file_is_a_4xx_and_keeps_the_keys(srv, client):
    good = open(srv.keys_path).read()
    try:
        with open(srv.keys_path, "w") as f:
            f.write("keys: [ {name: broken")
        r = httpx.post(f"{srv.url}/admin/keys/reload", headers=auth(ADMIN), timeout=30)
        assert r.status_code == 422 and "previous keys stay" in r.json()["error"]["message"]
        assert client.models.list().data  # the user key still works
    finally:
        with open(srv.keys_path, "w") as f:
            f.write(good)
    assert httpx.post(f"{srv.url}/admin/keys/reload", headers=auth(ADMIN), timeout=30).status_code == 200
    # Both reloads are in the audit log: who asked, and whether it took.
    reloads = [r for r in map(json.loads, open(srv.audit_path)) if r.get("endpoint") == "/admin/keys/reload"]
    assert [(r["key"], r["outcome"], "error" in r) for r in reloads[-2:]] == [
        ("api-key", "admin_rejected_422", True), ("api-key", "admin_ok", False)]
