"""Choosing a backend: prefix affinity by consistent hashing with bounded loads, else least outstanding.

Affinity key: the `X-Session-ID` header when the client sends one, else the first `prefix_chars`
characters of the prompt (a completion's prompt; a chat's messages, role and content, in order), if
the prompt is at least `min_chars` long. Requests sharing that prefix hash to the same point of a
ring of virtual nodes, so they land on the replica whose prefix cache already holds it, and adding or
removing a replica moves only about 1/N of the keys.

Bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018): a backend may take an affinity request only
while its outstanding requests stay under ceil(c x (total outstanding + 1) / backends in rotation);
otherwise the walk continues clockwise to the next backend with room. One hot prefix therefore
spills over to its ring neighbours instead of piling onto one replica. c = `--affinity-load-factor`
(default 1.25). Requests without an affinity key go to the backend with the fewest outstanding
requests (ties: the one after the last pick, round robin).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math

from deepserve.router.pool import Backend

SESSION_HEADER = "x-session-id"
VNODES = 100


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogateescape"), digest_size=8).digest(), "big")


def affinity_key(body: dict, session: str | None, prefix_chars: int, min_chars: int) -> str | None:
    if session:
        return "session:" + session
    if "messages" in body:
        parts = []
        for m in body.get("messages") or []:
            if isinstance(m, dict):
                content = m.get("content")
                text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
                parts.append(f"{m.get('role')}\x00{text}\x00")
        prompt = "".join(parts)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        prompt = prompt if isinstance(prompt, str) else json.dumps(prompt)
    if len(prompt) < min_chars:
        return None
    return f"{body.get('model')}\x00{prompt[:prefix_chars]}"


class Balancer:
    def __init__(self, load_factor: float = 1.25) -> None:
        if load_factor < 1.0:
            raise ValueError(f"--affinity-load-factor must be >= 1.0, got {load_factor}")
        self.load_factor = load_factor
        self._ring: list[tuple[int, str]] = []
        self._ring_of: tuple[str, ...] = ()
        self._next = 0

    def _ring_for(self, urls: tuple[str, ...]) -> list[tuple[int, str]]:
        if urls != self._ring_of:  # rebuilt only when the set of backends changes
            self._ring = sorted((_point(f"{u}#{i}"), u) for u in urls for i in range(VNODES))
            self._ring_of = urls
        return self._ring

    def pick(self, candidates: list[Backend], key: str | None, every: list[Backend] | None = None) -> Backend:
        """One of `candidates` (non-empty). The ring is built over `every` backend in rotation, so a
        retry that excludes a failed backend keeps the others' positions."""
        if key is None:
            return self._least_outstanding(candidates)
        ring = self._ring_for(tuple(sorted(b.url for b in (every or candidates))))
        by_url = {b.url: b for b in candidates}
        total = sum(b.outstanding for b in (every or candidates))
        cap = math.ceil(self.load_factor * (total + 1) / max(1, len(every or candidates)))
        start = bisect.bisect(ring, (_point(key), ""))
        seen: set[str] = set()
        for i in range(len(ring)):
            url = ring[(start + i) % len(ring)][1]
            if url in seen or url not in by_url:
                continue
            seen.add(url)
            if by_url[url].outstanding < cap:
                return by_url[url]
        return self._least_outstanding(candidates)

    def _least_outstanding(self, candidates: list[Backend]) -> Backend:
        self._next += 1
        n = len(candidates)
        order = [candidates[(self._next + i) % n] for i in range(n)]
        return min(order, key=lambda b: b.outstanding)
