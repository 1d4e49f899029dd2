"""A real server, DEEPSERVE_GC_FREEZE unset (on by default): both processes freeze their start-up heap, then serve."""

from __future__ import annotations

import re

import httpx
from serverkit import ADMIN


def test_both_processes_freeze_their_start_up_heap_and_serve(server_factory, monkeypatch):
    monkeypatch.delenv("DEEPSERVE_GC_FREEZE", raising=False)
    srv = server_factory([])
    r = httpx.post(f"{srv.url}/v1/completions", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60,
                   json={"model": "deepserve-demo", "prompt": "hello", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    log = srv.tail(100_000)
    counts = {where: int(n) for where, n in
              re.findall(r"(API server|engine core): (\d+) start-up objects kept out of garbage collection", log)}
    # Each has imported torch (and the server FastAPI): hundreds of thousands of objects on CPython 3.11
    assert counts.keys() == {"API server", "engine core"}, log[-3000:]
    assert min(counts.values()) > 50_000, counts
