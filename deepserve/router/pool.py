"""The backends behind the router and their health.

A backend is in rotation when it is healthy and not drained. Health is decided two ways:
- active: every `interval` seconds the pool GETs each backend's health path (timeout 2 s); a failed
  probe takes it out of rotation, a passing one puts it back;
- passive: a connection error or a 5xx on a proxied request takes it out at once (the next passing
  probe puts it back).
So a dead backend leaves rotation within one probe interval plus the probe timeout (3 s at the
default 1 s interval), inside the 5 s the router promises; a refused connection takes it out at once.
When no backend is in rotation the router still tries the undrained ones ("panic mode", as Envoy
does): health checks that all fail at once (a slow network, an overloaded host) must not turn into
an outage of their own. Draining is an operator's decision (admin API) and
only stops new requests; the ones in flight run to the end.

`--backend-dns HOST:PORT` adds every address HOST resolves to (a Kubernetes headless Service),
re-resolved at each probe round, so replicas that scale up or down join and leave on their own.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, field

import aiohttp

logger = logging.getLogger(__name__)
PROBE_TIMEOUT = 2.0


@dataclass
class Backend:
    url: str
    healthy: bool = True
    drained: bool = False
    outstanding: int = 0  # proxied requests in flight on this backend
    last_error: str | None = None
    dns: str | None = None  # the --backend-dns name it came from; None: a static --backend
    changed_at: float = field(default_factory=time.monotonic)
    ever_ready: bool = False  # has passed a probe: until then a failing one is a replica starting, not a fault

    @property
    def in_rotation(self) -> bool:
        return self.healthy and not self.drained

    def mark(self, healthy: bool, why: str | None = None) -> bool:
        """Set health; True when it changed."""
        if why is not None:
            self.last_error = why
        first_ready, self.ever_ready = healthy and not self.ever_ready, self.ever_ready or healthy
        if healthy == self.healthy:
            return False
        self.healthy, self.changed_at = healthy, time.monotonic()
        # Said at the level of every rotation change; a replica still loading when the router started
        # is "not ready yet", then "ready": news, not a fault and a recovery.
        if first_ready:
            logger.warning("backend %s is ready", self.url)
        elif not self.ever_ready:
            logger.warning("backend %s is not ready yet (%s)", self.url, why)
        else:
            logger.warning("backend %s is %s%s", self.url, "healthy again" if healthy else "out of rotation",
                           f" ({why})" if why and not healthy else "")
        return True

    def describe(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "drained": self.drained,
                "in_rotation": self.in_rotation, "outstanding": self.outstanding, "last_error": self.last_error}


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--backend must be an http:// or https:// URL, got {url!r}")
    return url


def parse_dns_target(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--backend-dns must be HOST:PORT (a headless Service name and its port), got {target!r}")
    return host, int(port)


class BackendPool:
    def __init__(self, urls: list[str], dns_targets: list[str] = (), health_path: str = "/health",
                 interval: float = 1.0, on_change=None) -> None:
        self.backends: dict[str, Backend] = {}
        for u in urls:
            self.add(normalize_url(u))
        self.dns_targets = [parse_dns_target(t) for t in dns_targets]
        self.health_path = health_path
        self.interval = interval
        self.on_change = on_change or (lambda b: None)

    def add(self, url: str) -> Backend:
        if url not in self.backends:
            self.backends[url] = Backend(url)
        return self.backends[url]

    def get(self, url: str) -> Backend | None:
        return self.backends.get(normalize_url(url)) if url.startswith(("http://", "https://")) else None

    def in_rotation(self) -> list[Backend]:
        return [b for b in self.backends.values() if b.in_rotation]

    def candidates(self) -> list[Backend]:
        """Where new requests may go: the backends in rotation, else (panic mode) every undrained one."""
        return self.in_rotation() or [b for b in self.backends.values() if not b.drained]

    def mark(self, b: Backend, healthy: bool, why: str | None = None) -> None:
        if b.mark(healthy, why):
            self.on_change(b)

    async def run_checks(self, client: aiohttp.ClientSession) -> None:
        """The active checker: forever, one probe round per interval."""
        while True:
            started = time.monotonic()
            await self.refresh_dns()
            await asyncio.gather(*(self.probe(client, b) for b in list(self.backends.values())))
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    async def probe(self, client: aiohttp.ClientSession, b: Backend) -> None:
        try:
            async with client.get(b.url + self.health_path, timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT)) as r:
                await r.read()
                ok, why = r.status == 200, f"health check answered {r.status}"
        except (aiohttp.ClientError, TimeoutError) as e:
            ok, why = False, f"health check failed: {type(e).__name__}"
        self.mark(b, ok, None if ok else why)

    async def refresh_dns(self) -> None:
        if not self.dns_targets:
            return
        loop = asyncio.get_running_loop()
        for host, port in self.dns_targets:
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as e:
                logger.warning("cannot resolve --backend-dns %s: %s; keeping the backends known so far", host, e)
                continue
            found = {f"http://{_host(i[4][0])}:{port}" for i in infos}
            for url in found - self.backends.keys():
                logger.warning("backend %s joined (DNS %s)", url, host)
                b = self.add(url)
                b.dns, b.healthy = host, False  # in rotation after its first passing probe
            # A replica that left is forgotten once its requests finished; static backends stay.
            for url in [u for u, b in self.backends.items() if b.dns == host and u not in found and not b.outstanding]:
                logger.warning("backend %s left (DNS %s)", url, host)
                del self.backends[url]

def _host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr
