"""Helpers for router tests: a real redis-server and real `deepserve router` processes on loopback,
each stopped by its own pid."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import httpx
from serverkit import ADMIN, ROOT, free_port


class Redis:
    def __init__(self, tmp: str) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        import redis

        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis(port=self.port).ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


class Router:
    def __init__(self, args: list[str], tmp: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(tmp, f"router-{self.port}.log")
        env = {**os.environ, "PYTHONPATH": ROOT}
        env.pop("DEEPSERVE_API_KEY", None)
        cmd = [sys.executable, "-m", "deepserve.entrypoints.cli", "--log-level", "INFO", "router",
               "--port", str(self.port), "--api-key", ADMIN, *args]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=tmp)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"router not ready after {timeout}s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
