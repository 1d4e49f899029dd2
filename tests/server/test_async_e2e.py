"""The server with async scheduling on (`--async-scheduling`; the default on one CUDA GPU, off on CPU):
the engine core process launches step n+1 before it reads step n, and the OpenAI surface must not see
a difference — streamed and whole outputs agree with a step-by-step server, a dropped stream is
aborted, concurrent requests all finish, and the usage metrics add up."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest
from serverkit import ADMIN, USER, auth, metric, wait_until, write_keys

MODEL = "deepserve-demo"


@pytest.fixture(scope="module")
def servers(server_factory, tmp_path_factory):
    keys = write_keys(str(tmp_path_factory.mktemp("async") / "keys.yaml"))
    return {mode: server_factory(["--api-keys", keys, f"--{mode}"])
            for mode in ("async-scheduling", "no-async-scheduling")}


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=USER, max_retries=0, timeout=60)


def _generations(srv) -> list:
    """Eight concurrent requests (streamed and whole, seeded sampling and greedy, a stop string, n=2)."""
    client = _client(srv)

    def one(i: int):
        kw = dict(model=MODEL, prompt=f"Paged attention {i}:", max_tokens=12 + i, seed=i,
                  temperature=0.8 if i % 2 else 0.0, stop=["e"] if i == 3 else None, n=2 if i == 5 else 1)
        if i % 3 == 0:
            texts: dict[int, str] = {}
            for chunk in client.completions.create(**kw, stream=True):
                for c in chunk.choices:
                    texts[c.index] = texts.get(c.index, "") + c.text
            return sorted(texts.items())
        return sorted((c.index, c.text) for c in client.completions.create(**kw).choices)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(8)))


def test_outputs_equal_the_step_by_step_server(servers):
    for mode, state in (("async-scheduling", "on"), ("no-async-scheduling", "off")):
        with open(servers[mode].log_path) as log:
            assert f"async scheduling {state}" in log.read()
    got = _generations(servers["async-scheduling"])
    assert got == _generations(servers["no-async-scheduling"])
    assert all(text for request in got for _, text in request)


def test_dropped_stream_is_aborted_and_usage_adds_up(servers):
    srv = servers["async-scheduling"]

    def metrics() -> str:
        return httpx.get(f"{srv.url}/metrics", headers=auth(ADMIN)).text

    before = metric(metrics(), "deepserve:generation_tokens_total")
    body = {"model": MODEL, "prompt": "go", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, headers=auth(USER), timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        assert wait_until(lambda: metric(metrics(), "deepserve:num_requests_running") == 1, timeout=10)
    assert wait_until(lambda: metric(metrics(), "deepserve:num_requests_running") == 0, timeout=10)
    r = _client(srv).completions.create(model=MODEL, prompt="still here", max_tokens=7, temperature=0)
    assert r.usage.completion_tokens == 7
    generated = metric(metrics(), "deepserve:generation_tokens_total") - before
    assert 7 < generated < 1000  # the dropped stream stopped long before its 1,000 tokens
