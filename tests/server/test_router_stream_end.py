"""A stream the client read to its `data: [DONE]` is an "ok" request at the router, even when the client
closes the connection before the backend's response has ended (the openai client closes right after
[DONE]). The backend here is a stub that sends its events and then holds the response open, so the
router sees the client leave while it still waits for the backend's end: the order that, by timing
alone, made about one stream in twenty of `deepserve bench serve` count as client_gone."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest
from aiohttp import web
from routerkit import Router
from serverkit import ADMIN, auth, free_port, wait_until

EVENT = (b'data: {"id":"c1","object":"text_completion","created":0,"model":"stub",'
         b'"choices":[{"index":0,"text":"hi","finish_reason":"stop","logprobs":null}]}\n\n')


class StubBackend:
    """An OpenAI-style backend on its own thread and loop whose streams never end by themselves."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.release: asyncio.Event | None = None
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.release = asyncio.Event()
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._stream)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        started.set()
        self.loop.run_forever()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(EVENT + b"data: [DONE]\n\n")
        await self.release.wait()  # the response's end comes only when the test lets it
        return resp

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.release.set)
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def router_over_stub(tmp_path):
    stub = StubBackend()
    router = Router(["--backend", stub.url, "--health-interval", "0.2"], str(tmp_path))
    try:
        router.wait_ready()
        yield router, stub
    finally:
        router.stop()
        stub.stop()


def outcomes(router: Router, stub: StubBackend) -> dict[str, float]:
    text = httpx.get(f"{router.url}/metrics", headers=auth(ADMIN)).text
    prefix = f'deepserve:router_backend_requests_total{{backend="{stub.url}",outcome="'
    return {line[len(prefix):].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


def test_a_stream_read_to_done_is_ok_though_the_client_left_first(router_over_stub):
    router, stub = router_over_stub
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=ADMIN, max_retries=0, timeout=30)
    chunks = list(client.completions.create(model="stub", prompt="hi", max_tokens=1, stream=True))
    assert [c.choices[0].text for c in chunks] == ["hi"]
    # The client has closed its connection; the stub's response is still open, so what the router
    # records now is what it decided on the client's leaving.
    assert wait_until(lambda: outcomes(router, stub), timeout=20)
    assert outcomes(router, stub) == {"ok": 1.0}
    usage = httpx.get(f"{router.url}/admin/usage", headers=auth(ADMIN)).json()
    assert "outcome_client_gone" not in str(usage)
