"""Helpers for server tests: a real `deepserve serve` subprocess on loopback, keys, metrics parsing.

Servers run the real CLI and the real engine core process with the built-in demo model, and are
always stopped by their own pid. Every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from deepserve.server.auth import hash_key

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ADMIN = "sk-test-admin-0000"
USER = "sk-test-user-0000"
METRICS = "sk-test-metrics-0000"
OTHER_MODEL = "sk-test-other-model-0000"
START_TIMEOUT = 150.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_keys(path: str, extra: list[dict] | None = None) -> str:
    import yaml

    keys = [
        {"name": "user", "key_hash": hash_key(USER), "role": "user", "models": ["*"]},
        {"name": "scraper", "key_hash": hash_key(METRICS), "role": "metrics"},
        {"name": "other", "key_hash": hash_key(OTHER_MODEL), "role": "user", "models": ["another-model"]},
        *(extra or []),
    ]
    with open(path, "w") as f:
        yaml.safe_dump({"keys": keys}, f)
    return path


class Server:
    def __init__(self, args: list[str], tmp: str, scheme: str = "http") -> None:
        self.port = free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log_path = os.path.join(tmp, f"server-{self.port}.log")
        env = {**os.environ, "PYTHONPATH": ROOT, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        env.pop("DEEPSERVE_API_KEY", None)
        cmd = [sys.executable, "-m", "deepserve.entrypoints.cli", "--log-level", "INFO", "serve",
               "--host", "127.0.0.1", "--port", str(self.port), "--api-key", ADMIN,
               "--max-model-len", "1024", "--cpu-kv-cache-gib", "0.05", *args]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=tmp)

    def wait_ready(self, **client_kwargs) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2, **client_kwargs).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not ready after {START_TIMEOUT}s:\n{self.tail()}")

    def engine_pid(self) -> int:
        children = open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read().split()
        return int(children[0])

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-n:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
        return self.proc.returncode


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def metric(text: str, name: str) -> float:
    """The value of the first sample of `name` (labels ignored) in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


