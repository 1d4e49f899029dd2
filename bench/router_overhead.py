"""The latency `deepserve router` adds, on CPU: one demo replica, one router in front of it, the same
one-token request sent straight to the replica and through the router, alternately, in pairs.

    python bench/router_overhead.py [--pairs 200] [--stream]

Prints the median of the per-pair difference (router minus direct; pairing cancels most of the
replica's own jitter) and both sides' p50/p99, then a one-line table. Exit code 1 if a request fails.
The replica and router are started here (demo model, loopback) and stopped by pid at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

KEY = "sk-router-overhead-0000"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], log: str) -> tuple[subprocess.Popen, str]:
    port = _port()
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "deepserve.entrypoints.cli", *args[:1], "--port", str(port), "--api-key", KEY,
           *args[1:]]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{args[0]} exited; see {log}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"{args[0]} not ready; see {log}")


def _timed(client: httpx.Client, url: str, stream: bool) -> float:
    body = {"prompt": "hi", "max_tokens": 1, "stream": stream}
    t0 = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.read()
        if r.status_code != 200:
            raise SystemExit(f"{url}: HTTP {r.status_code} {r.text[:200]}")
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--stream", action="store_true")
    ns = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="router-overhead-")
    procs = []
    try:
        replica, replica_url = _start(["serve", "--max-model-len", "256", "--cpu-kv-cache-gib", "0.05"],
                                      os.path.join(tmp, "replica.log"))
        procs.append(replica)
        router, router_url = _start(["router", "--backend", replica_url, "--backend-api-key", KEY],
                                    os.path.join(tmp, "router.log"))
        procs.append(router)
        direct, routed = [], []
        with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
            for _ in range(10):  # warm connections and caches on both paths
                _timed(c, replica_url, ns.stream), _timed(c, router_url, ns.stream)
            for i in range(ns.pairs):
                a, b = (replica_url, router_url) if i % 2 else (router_url, replica_url)
                ta, tb = _timed(c, a, ns.stream), _timed(c, b, ns.stream)
                d, r = (ta, tb) if a == replica_url else (tb, ta)
                direct.append(d)
                routed.append(r)
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=30)
    diff = sorted((r - d) * 1e3 for r, d in zip(routed, direct, strict=True))

    def pct(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3

    added = statistics.median(diff)
    print(f"pairs {ns.pairs}, stream {ns.stream}: direct p50 {pct(direct, .5):.2f} ms p99 {pct(direct, .99):.2f} ms; "
          f"routed p50 {pct(routed, .5):.2f} ms p99 {pct(routed, .99):.2f} ms")
    print("| machine | requests | added latency p50 (median of pair differences) |")
    print("|---|---|---|")
    print(f"| {os.uname().nodename} ({os.cpu_count()} CPUs) | {'stream' if ns.stream else 'non-stream'} x "
          f"{ns.pairs} pairs | {added:.2f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
