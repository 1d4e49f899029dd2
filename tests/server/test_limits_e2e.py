"""Per-key limits (429 + Retry-After + x-ratelimit-*) and the global wait queue (503) on a real server
whose engine runs one sequence at a time, so a second long request is deterministically waiting; and
the read timeouts (--request-read-timeout 2) against clients that never finish sending."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import openai
import pytest
from serverkit import ADMIN, auth, wait_until, write_keys

from deepserve.server.auth import hash_key

LIMITED, TOKENS, CONC = "sk-test-limited-0000", "sk-test-tokens-0000", "sk-test-conc-0000"
TOKENIZER = "sk-test-tokenizer-0000"
DEFAULTS = "sk-test-defaults-0000"
LONG = {"prompt": "go", "max_tokens": 1000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def srv(server_factory, tmp_path_factory):
    keys = write_keys(str(tmp_path_factory.mktemp("limits") / "keys.yaml"), [
        {"name": "limited", "key_hash": hash_key(LIMITED), "role": "user", "requests_per_minute": 2},
        {"name": "tokens", "key_hash": hash_key(TOKENS), "role": "user", "tokens_per_minute": 300},
        {"name": "conc", "key_hash": hash_key(CONC), "role": "user", "max_concurrent": 1},
        {"name": "defaults", "key_hash": hash_key(DEFAULTS), "role": "user", "tokens_per_minute": 1000},
        {"name": "tokenizer", "key_hash": hash_key(TOKENIZER), "role": "user", "requests_per_minute": 2},
    ])
    return server_factory(["--api-keys", keys, "--max-num-seqs", "1", "--max-waiting-requests", "1",
                           "--request-read-timeout", "2"])


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


def test_tokenize_and_detokenize_count_against_the_keys_requests(srv):
    def call(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{srv.url}{path}", json=body, headers=auth(TOKENIZER), timeout=60)

    assert call("/tokenize", {"prompt": "hi"}).status_code == 200
    assert call("/detokenize", {"tokens": [5]}).status_code == 200
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
        r = call(path, body)
        assert r.status_code == 429 and "requests per minute" in r.json()["error"]["message"], r.text
    assert complete(srv, TOKENIZER).status_code == 429  # the same budget as its completions


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
        tokenize = httpx.post(f"{srv.url}/tokenize", json={"prompt": "hi"}, headers=auth(CONC), timeout=60)
        assert tokenize.status_code == 429 and "max_concurrent" in tokenize.json()["error"]["message"]
    assert wait_until(lambda: in_flight(srv) == 0, timeout=10)
    assert complete(srv, CONC).status_code == 200


def test_a_list_of_prompts_is_admitted_whole_or_not_at_all(srv):
    # Each prompt takes a concurrency slot: two never fit a key with one, which a 429 naming prompt says
    # without Retry-After (waiting would not help), and the refusal takes nothing from the key.
    two = complete(srv, CONC, prompt=["hi", "there"])
    assert two.status_code == 429 and "max_concurrent" in two.json()["error"]["message"]
    assert two.json()["error"]["param"] == "prompt" and "Retry-After" not in two.headers
    assert in_flight(srv) == 0 and complete(srv, CONC).status_code == 200
    # The wait queue (--max-waiting-requests 1) takes a list whole when it is empty, as it takes any prompt.
    many = complete(srv, ADMIN, prompt=["a", "b", "c"], max_tokens=2)
    assert many.status_code == 200 and [c["index"] for c in many.json()["choices"]] == [0, 1, 2]
    assert wait_until(lambda: in_flight(srv) == 0, timeout=10)
    # A client that leaves a streamed list mid-way leaves nothing running: every prompt's request is aborted.
    with httpx.stream("POST", f"{srv.url}/v1/completions", json={**LONG, "prompt": ["go", "on", "and on"]},
                      headers=auth(ADMIN), timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert in_flight(srv) == 3
    assert wait_until(lambda: in_flight(srv) == 0, timeout=10)


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


def _send_and_wait(srv, payload: bytes, close_after: float | None = None) -> tuple[float, bytes]:
    """Seconds until the server answers or closes, and what it sent (b"" when it just closed)."""
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(payload)
        if close_after is not None:
            time.sleep(close_after)
            return close_after, b""
        s.settimeout(20)
        start = time.monotonic()
        data = s.recv(4096)
        return time.monotonic() - start, data


POST = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN}\r\n"
        "Content-Type: application/json\r\n")


@pytest.mark.parametrize("payload,status", [
    (b"GET /ready HTTP/1.1\r\nHost: x\r\n", None),  # headers never end: closed, no answer
    (POST.encode() + b"Content-Length: 100\r\n\r\n{\"prompt\":", b"408"),  # a body shorter than declared
    (POST.encode() + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", b"408"),  # no last chunk
])
def test_slow_clients_are_cut_off_and_the_server_keeps_serving(srv, payload, status):
    waited, data = _send_and_wait(srv, payload)
    assert 1.5 < waited < 10, waited
    assert (data == b"") if status is None else data.startswith(b"HTTP/1.1 " + status)
    assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200


def test_an_endless_header_block_is_cut_off_at_its_size_limit(srv):
    # 100 KB of headers that never end, sent at once: closed at 4 x --max-header-bytes (16 KiB) whichever
    # HTTP parser uvicorn runs (httptools has no cap of its own), not buffered until the read timeout.
    pad = b"".join(b"x-pad-%d: %s\r\n" % (i, b"a" * 990) for i in range(100))
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.settimeout(20)
        try:
            s.sendall(b"GET /ready HTTP/1.1\r\nHost: x\r\n" + pad)
            data = s.recv(4096)
        except (ConnectionResetError, BrokenPipeError):  # closed with unread bytes: the reset may come first
            data = b""
    assert time.monotonic() - start < 10
    assert data == b"" or data.startswith(b"HTTP/1.1 431"), data[:100]
    # Closed for its size, not by the 2 s read timeout (which logs "took over"):
    assert wait_until(lambda: "request headers ran past 65536 bytes" in srv.tail(), 10)
    assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200


def test_a_client_gone_mid_body_is_one_log_line(srv):
    _send_and_wait(srv, POST.encode() + b"Content-Length: 100\r\n\r\n{\"pro", close_after=0.3)
    assert wait_until(lambda: "went away before its request body arrived" in srv.tail(), 10)
    assert "Traceback" not in srv.tail(20000)


def test_start_up_says_where_it_listens_and_probes_stay_out_of_the_access_log(srv):
    for _ in range(3):
        httpx.get(f"{srv.url}/health", timeout=5)
        httpx.get(f"{srv.url}/ready", timeout=5)
    complete(srv, ADMIN)
    log = srv.tail(200000)
    assert f"listening on http://127.0.0.1:{srv.port}" in log
    assert "INFO deepserve.server.api_server: engine ready" in log
    assert "loading " in log and "sizing the KV cache" in log  # progress by phase
    assert re.search(r"start-up: grammar_warmup [\d.]+ s, load [\d.]+ s", log)  # the core's own warm-up first
    assert '"POST /v1/completions HTTP/1.1" 200' in log
    assert '"GET /health' not in log and '"GET /ready' not in log


def test_health_answers_while_a_huge_prompt_is_tokenized(srv):
    # Tokenizing runs off the event loop: /health must not wait for it (it took 11-45 s once).
    import threading

    latencies, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            start = time.monotonic()
            httpx.get(f"{srv.url}/health", timeout=60)
            latencies.append(time.monotonic() - start)
            time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    start = time.monotonic()
    r = httpx.post(f"{srv.url}/tokenize", json={"prompt": "深度求索 attention " * 100_000}, headers=auth(ADMIN),
                   timeout=300)
    took = time.monotonic() - start
    stop.set()
    poller.join()
    assert r.status_code == 200 and r.json()["count"] > 100_000
    assert took > 0.5 and len(latencies) >= 3, (took, latencies)
    assert max(latencies) < 0.5 * took, (took, latencies)


def test_a_prompt_too_long_for_any_tokenization_is_refused_without_tokenizing(srv):
    r = complete(srv, ADMIN, prompt="深度求索注意力模型" * 100_000)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "characters" in r.json()["error"]["message"]  # refused from its length, before tokenizing


def test_a_disconnect_storm_leaves_nothing_behind(srv):
    # 240 clients that go away at every stage: mid-headers, mid-body, and right after asking for a stream.
    # Then: the server answers at once, serves a request, holds no request in flight, and logged no
    # traceback (each mid-body one is a single INFO line).
    stream = json.dumps({"prompt": "go", "max_tokens": 50, "stream": True}).encode()
    kinds = [b"GET /ready HTTP/1.1\r\nHost: x\r\nX-Pad: ",
             POST.encode() + b"Content-Length: 100\r\n\r\n{\"prompt\":",
             POST.encode() + b"Content-Length: %d\r\n\r\n" % len(stream) + stream]
    socks = []
    for i in range(240):
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(kinds[i % 3])
        socks.append(s)
    time.sleep(0.5)
    for s in socks:
        s.close()
    start = time.monotonic()
    assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200 and time.monotonic() - start < 5
    assert wait_until(lambda: in_flight(srv) == 0, 15)
    assert complete(srv, ADMIN).status_code == 200
    assert "Traceback" not in srv.tail(10**7)
