"""`deepserve router` says where it listens, as `deepserve serve` does, without any --log-level: a router
that printed nothing left a new user guessing whether it had started and on which address."""

from __future__ import annotations

import os
import subprocess
import sys

from serverkit import ADMIN, ROOT, free_port, wait_until


def test_router_reports_its_address_and_backends_by_default(tmp_path):
    port, dead = free_port(), free_port()  # nothing listens on `dead`: the backend is out of rotation
    log_path = tmp_path / "router.log"
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("DEEPSERVE_REDIS_URL", None)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "deepserve.entrypoints.cli", "router", "--port", str(port),
                                 "--api-key", ADMIN, "--backend", f"http://127.0.0.1:{dead}"],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        assert wait_until(lambda: "listening" in log_path.read_text() or proc.poll() is not None, timeout=60)
        text = log_path.read_text()
        assert f"router listening on http://127.0.0.1:{port}: 1 backend(s), 0 in rotation" in text, text
        assert "global quotas: none (no --redis-url)" in text
    finally:
        proc.terminate()
        proc.wait(timeout=20)
