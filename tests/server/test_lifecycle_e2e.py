"""Start-up, shutdown and failure on real servers: a SIGHUP while starting is not fatal; SIGTERM drains
(over mTLS) and exits 0; killing the engine process ends open streams with an error, turns /health 503 and
exits non-zero."""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import threading

import httpx
import openai
import pytest
from serverkit import ADMIN, auth, wait_until

LONG = {"prompt": "go", "max_tokens": 1000, "ignore_eos": True, "stream": True}


def _openssl(*args: str, cwd: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(d: str) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=test-ca", "-days", "1",
             cwd=d)
    with open(os.path.join(d, "san.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "1", "-extfile", "san.ext", cwd=d)


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = str(tmp_path_factory.mktemp("tls"))
    make_certs(d)
    return d


def ctx(d: str, with_cert: bool) -> ssl.SSLContext:
    c = ssl.create_default_context(cafile=os.path.join(d, "ca.crt"))
    if with_cert:
        c.load_cert_chain(os.path.join(d, "client.crt"), os.path.join(d, "client.key"))
    return c


def test_mtls_then_sigterm_drains_and_exits_0(server_factory, tls_dir):
    j = lambda name: os.path.join(tls_dir, name)  # noqa: E731
    good = ctx(tls_dir, with_cert=True)
    srv = server_factory(["--ssl-keyfile", j("server.key"), "--ssl-certfile", j("server.crt"),
                          "--ssl-ca-certs", j("ca.crt"), "--ssl-cert-reqs", "2", "--shutdown-timeout", "60"],
                         scheme="https", verify=good)
    # Without a client certificate the handshake (or, with TLS 1.3, the first read) fails.
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{srv.url}/health", verify=ctx(tls_dir, with_cert=False), timeout=5)
    with pytest.raises(httpx.TransportError):
        httpx.get(srv.url.replace("https", "http") + "/health", timeout=5)  # plain HTTP is not served

    with httpx.Client(verify=good, timeout=60) as c:
        with c.stream("POST", f"{srv.url}/v1/completions", json=LONG, headers=auth(ADMIN)) as r:
            lines = r.iter_lines()
            next(lines)
            srv.proc.send_signal(signal.SIGTERM)
            with httpx.Client(verify=good, timeout=10) as probe:
                assert wait_until(lambda: probe.get(f"{srv.url}/ready").status_code == 503, timeout=10)
                late = probe.post(f"{srv.url}/v1/completions", json={"prompt": "x"}, headers=auth(ADMIN))
                assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
                assert late.json()["error"]["code"] == "server_stopping" and late.headers["Retry-After"] == "5"
            rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and len(rest) > 10, rest[-3:]  # it kept streaming after SIGTERM
    assert srv.proc.wait(timeout=60) == 0, srv.tail()


def test_engine_death_ends_streams_with_error(server_factory, tmp_path):
    audit = tmp_path / "audit.jsonl"
    srv = server_factory(["--audit-log", str(audit)])
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=ADMIN, max_retries=0, timeout=60)
    # Two prompts in one stream: the engine's death is every prompt's error, not one prompt's failure.
    stream = client.completions.create(model="deepserve-demo", prompt=["go", "go on"], max_tokens=1000,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    os.kill(srv.engine_pid(), signal.SIGKILL)
    with pytest.raises(openai.APIError, match="engine"):
        for _ in stream:
            pass
    health = httpx.get(f"{srv.url}/health", timeout=5)
    assert health.status_code == 503 and health.json()["status"] == "dead"
    assert srv.proc.wait(timeout=30) == 1, srv.tail()
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    parts = sorted((r["request_id"], r["outcome"], r["status"]) for r in records
                   if r.get("endpoint") == "completions")
    assert [(o, s) for _, o, s in parts] == [("error", 503)] * 2 and parts[0][0].endswith("-0"), parts


def _open_requests(srv, client: httpx.Client):
    """A stream that has sent its first chunk, and a whole (non-streamed) request running beside it."""
    stream = client.stream("POST", f"{srv.url}/v1/completions", json=LONG, headers=auth(ADMIN))
    r = stream.__enter__()
    lines = r.iter_lines()
    next(lines)
    whole: dict = {}
    body = {**LONG, "stream": False}
    t = threading.Thread(target=lambda: whole.setdefault(
        "r", httpx.post(f"{srv.url}/v1/completions", json=body, headers=auth(ADMIN), timeout=60)))
    t.start()
    in_flight = lambda: httpx.get(f"{srv.url}/admin/usage", headers=auth(ADMIN), timeout=5).json()["in_flight"]  # noqa: E731
    assert wait_until(lambda: in_flight() == 2, timeout=20)
    return stream, lines, whole, t


def _assert_ended_cleanly(srv, lines, whole, t, why: str) -> None:
    rest = [line for line in lines if line]
    assert rest and '"server_stopping"' in rest[-1] and why in rest[-1], rest[-2:]
    assert "data: [DONE]" not in rest
    t.join(30)
    r = whole["r"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_stopping", r.text
    assert srv.proc.wait(timeout=30) == 0, srv.tail()
    log = srv.tail(100_000)
    assert "Traceback" not in log and "Application shutdown complete" in log, log[-3000:]


def test_second_sigterm_ends_requests_with_503_and_shuts_down_cleanly(server_factory):
    # First SIGTERM drains (up to 60 s here); the second ends what still runs at once: an error
    # event on the stream, a 503 for the whole request, then the engine's clean shutdown and exit 0.
    srv = server_factory(["--shutdown-timeout", "60"])
    with httpx.Client(timeout=60) as c:
        stream, lines, whole, t = _open_requests(srv, c)
        srv.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: "draining" in srv.tail(), timeout=10)
        srv.proc.send_signal(signal.SIGTERM)
        _assert_ended_cleanly(srv, lines, whole, t, "a second signal")
        stream.__exit__(None, None, None)


def test_shutdown_timeout_ends_requests_with_503_and_exits_0(server_factory):
    srv = server_factory(["--shutdown-timeout", "1"])
    with httpx.Client(timeout=60) as c:
        stream, lines, whole, t = _open_requests(srv, c)
        srv.proc.send_signal(signal.SIGTERM)
        _assert_ended_cleanly(srv, lines, whole, t, "the shutdown timeout")
        stream.__exit__(None, None, None)


def _catches_sighup(pid: int) -> bool:
    """Whether the process has a SIGHUP handler yet (SigCgt's bit 0): a signal sent from then on is not fatal."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGHUP - 1)))


def _has_started_its_engine(pid: int) -> bool:
    """Whether the engine core process runs: the child named so (imports start short-lived others earlier)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = f.read().split()
    return any("deepserve.engine.core_process" in _cmdline(child) for child in children)


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:  # it has ended
        return ""


def test_sighup_while_loading_does_not_kill_the_server(server_factory):
    # docs/deploy.md has operators SIGHUP every pod after a key change, pods still starting among them.
    # The first SIGHUP goes as soon as the server catches the signal or has spawned its engine, whichever is
    # first: with the early handler that is a moment after start, and without it, at the engine spawn (long
    # before the port opens), it was fatal. Not at once after Popen: the interpreter's own start-up, before
    # any code of ours runs, still dies of it. More follow until /ready is 200, so some land while it loads.
    srv = server_factory(["--device", "cpu"], wait=False)
    pid = srv.proc.pid
    assert wait_until(lambda: srv.proc.poll() is not None or _catches_sighup(pid) or _has_started_its_engine(pid),
                      timeout=60, interval=0.005)

    def ready() -> bool:
        srv.proc.send_signal(signal.SIGHUP)
        assert srv.proc.poll() is None, f"exit {srv.proc.returncode}:\n{srv.tail()}"
        try:
            return httpx.get(f"{srv.url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    assert wait_until(ready, timeout=150, interval=0.1), srv.tail()
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth(ADMIN), timeout=60)
    assert r.status_code == 200 and srv.proc.poll() is None, r.text
