"""Per-key limits (429 + Retry-After + x-ratelimit-*) and the global wait queue (503) on a real server
whose engine runs one sequence at a time, so a second long request is deterministically waiting."""

from __future__ import annotations

import httpx
import openai
import pytest
from serverkit import ADMIN, auth, wait_until, write_keys

from deepserve.server.auth import hash_key

LIMITED, TOKENS, CONC = "sk-test-limited-0000", "sk-test-tokens-0000", "sk-test-conc-0000"
DEFAULTS = "sk-test-defaults-0000"
LONG = {"prompt": "go", "max_tokens": 1000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def srv(server_factory, tmp_path_factory):
    keys = write_keys(str(tmp_path_factory.mktemp("limits") / "keys.yaml"), [
        {"name": "limited", "key_hash": hash_key(LIMITED), "role": "user", "requests_per_minute": 2},
        {"name": "tokens", "key_hash": hash_key(TOKENS), "role": "user", "tokens_per_minute": 300},
        {"name": "conc", "key_hash": hash_key(CONC), "role": "user", "max_concurrent": 1},
        {"name": "defaults", "key_hash": hash_key(DEFAULTS), "role": "user", "tokens_per_minute": 1000},
    ])
    return server_factory(["--api-keys", keys, "--max-num-seqs", "1", "--max-waiting-requests", "1"])


def complete(srv, key: str, **body) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1, **body},
                      headers=auth(key), timeout=60)


def in_flight(srv) -> int:
    return httpx.get(f"{srv.url}/admin/usage", headers=auth(ADMIN)).json()["in_flight"]


def test_chat_content_without_reasoning_parser(srv):
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=ADMIN, max_retries=0)
    r = client.chat.completions.create(model="deepserve-demo", max_tokens=6,
                                       messages=[{"role": "user", "content": "hi"}])
    assert isinstance(r.choices[0].message.content, str)
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
    assert r.usage.completion_tokens_details is None


def test_requests_per_minute(srv):
    first, second = complete(srv, LIMITED), complete(srv, LIMITED)
    assert first.status_code == second.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    third = complete(srv, LIMITED)
    assert third.status_code == 429
    assert int(third.headers["Retry-After"]) >= 1
    assert third.json()["error"]["type"] == "rate_limit_error"
    assert "requests per minute" in third.json()["error"]["message"]


def test_tokens_per_minute_reserve_then_settle(srv):
    assert complete(srv, TOKENS, max_tokens=200, ignore_eos=True).status_code == 200
    r = complete(srv, TOKENS, max_tokens=200)  # about 95 tokens left this minute
    assert r.status_code == 429 and "tokens per minute" in r.json()["error"]["message"]
    assert r.headers["x-ratelimit-limit-tokens"] == "300"
    too_big = complete(srv, TOKENS, max_tokens=400)
    assert too_big.status_code == 429 and "lower max_tokens" in too_big.json()["error"]["message"]


def test_reservation_uses_the_default_max_tokens(srv):
    # Completions default to 16 tokens, so 16 is what is reserved; chat defaults to the rest of the
    # 1024-token context, more than this key's 1000 tokens per minute.
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "ignore_eos": True},
                   headers=auth(DEFAULTS), timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 16
    assert r.headers["x-ratelimit-remaining-tokens"] == str(1000 - usage["prompt_tokens"] - 16)
    chat = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                      headers=auth(DEFAULTS), timeout=60)
    assert chat.status_code == 429 and "lower max_tokens" in chat.json()["error"]["message"]


def test_concurrency_limit(srv):
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=LONG, headers=auth(CONC), timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        busy = complete(srv, CONC)
        assert busy.status_code == 429 and "max_concurrent" in busy.json()["error"]["message"]
        assert busy.headers["Retry-After"] == "1"
    assert wait_until(lambda: in_flight(srv) == 0, timeout=10)
    assert complete(srv, CONC).status_code == 200


def test_overload_is_503(srv):
    url = f"{srv.url}/v1/completions"
    with httpx.Client(timeout=60) as a, httpx.Client(timeout=60) as b:
        with a.stream("POST", url, json=LONG, headers=auth(ADMIN)) as ra:
            lines = ra.iter_lines()
            next(lines)  # A runs: the engine's only sequence slot
            with b.stream("POST", url, json=LONG, headers=auth(ADMIN)) as rb:
                assert rb.status_code == 200  # B is admitted and waits for the slot
                c = complete(srv, ADMIN)
                assert c.status_code == 503, c.text
                assert c.headers["Retry-After"] == "1" and "overloaded" in c.json()["error"]["message"]
    assert wait_until(lambda: in_flight(srv) == 0, timeout=10)
    assert complete(srv, ADMIN).status_code == 200
