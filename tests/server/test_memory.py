"""Memory goes back to the OS after large requests (glibc's malloc_trim), and only after large ones."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from deepserve.server import memory

RSS_PROBE = """
from deepserve.server.memory import release_memory

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

base = rss_mb()
# 300 MB in 1 KB blocks (malloc, not mmap, and not Python's small-object arenas), then one block after
# them that stays: the freed space is below the heap's top, where glibc does not return it by itself.
junk = [bytes(1000) + str(i).encode() for i in range(300_000)]
keep = bytes(1000) + b"keep"
peak = rss_mb()
del junk
freed = rss_mb()
trimmed = release_memory()
print(base, peak, freed, rss_mb(), trimmed)
"""


@pytest.mark.skipif(memory._TRIM is None, reason="malloc_trim is glibc's")
def test_release_memory_returns_freed_heap_pages():
    done = subprocess.run([sys.executable, "-c", RSS_PROBE], capture_output=True, text=True, timeout=120)
    base, peak, freed, after, trimmed = done.stdout.split()
    base, peak, freed, after = map(float, (base, peak, freed, after))
    assert peak - base > 100  # the objects took memory ...
    assert freed - base > 0.5 * (peak - base)  # ... which freeing them alone did not give back
    assert trimmed == "True" and after - base < 0.25 * (peak - base), (base, peak, freed, after)


def test_the_middleware_trims_after_large_bodies_only(monkeypatch):
    trims = []
    monkeypatch.setattr(memory, "release_memory", lambda: trims.append(1))

    async def app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass

    async def off_loop(fn):
        return fn()

    async def run(chunks: list[bytes]):
        messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

        async def receive():
            return messages.pop(0)

        await memory.TrimAfterLargeBodies(app, off_loop)({"type": "http"}, receive, None)

    asyncio.run(run([b"x" * 1000]))
    assert trims == []
    asyncio.run(run([b"x" * (600 << 10), b"y" * (600 << 10)]))  # 1.2 MiB in two chunks
    assert trims == [1]
