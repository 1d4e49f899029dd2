"""Router pieces without processes: the balancer's affinity and bounded loads, URL and flag checks, the
key check's audit record."""

from __future__ import annotations

import asyncio

import pytest

from deepserve.router.balance import Balancer, affinity_key
from deepserve.router.pool import Backend, normalize_url, parse_dns_target
from deepserve.router.state import RouterSettings


def backends(n: int) -> list[Backend]:
    return [Backend(f"http://10.0.0.{i}:8000") for i in range(n)]


def test_same_key_same_backend_and_keys_spread():
    bal, pool = Balancer(), backends(4)
    picks = {f"k{i}": bal.pick(pool, f"k{i}").url for i in range(400)}
    assert all(bal.pick(pool, k).url == u for k, u in picks.items())
    counts = sorted(list(picks.values()).count(b.url) for b in pool)
    assert counts[0] > 50, counts  # 100 virtual nodes each: no backend starves


def test_removing_a_backend_moves_only_its_keys():
    bal, pool = Balancer(), backends(4)
    before = {f"k{i}": bal.pick(pool, f"k{i}").url for i in range(400)}
    gone = pool[2]
    after = {k: bal.pick(pool[:2] + pool[3:], k).url for k in before}
    moved = [k for k in before if before[k] != after[k]]
    assert moved and all(before[k] == gone.url for k in moved)


def test_bounded_load_spills_a_hot_key_to_the_next_backend():
    bal, pool = Balancer(load_factor=1.25), backends(3)
    home = bal.pick(pool, "hot")
    home.outstanding = 2  # cap = ceil(1.25 x 3 / 3) = 2: full
    spill = bal.pick(pool, "hot")
    assert spill is not home
    assert bal.pick(pool, "hot") is spill  # deterministic: the ring's next backend
    home.outstanding, spill.outstanding = 1, 1  # cap = ceil(1.25 x 3 / 3) = 2: room again at home
    assert bal.pick(pool, "hot") is home


def test_least_outstanding_without_a_key():
    bal, pool = Balancer(), backends(3)
    pool[0].outstanding, pool[1].outstanding, pool[2].outstanding = 3, 1, 2
    assert bal.pick(pool, None) is pool[1]


def test_affinity_key_rules():
    long = "x" * 300
    assert affinity_key({"prompt": "short"}, None, 1024, 256) is None
    assert affinity_key({"prompt": "short"}, "s-1", 1024, 256) == "session:s-1"
    a = affinity_key({"prompt": long + "a"}, None, 300, 256)
    assert a == affinity_key({"prompt": long + "b"}, None, 300, 256)
    chat = {"messages": [{"role": "system", "content": long}, {"role": "user", "content": "q1"}]}
    other = {"messages": [{"role": "system", "content": long}, {"role": "user", "content": "q2"}]}
    assert affinity_key(chat, None, 300, 256) == affinity_key(other, None, 300, 256)
    assert affinity_key(chat, None, 1024, 256) != affinity_key(other, None, 1024, 256)


def test_flags_are_checked():
    assert normalize_url("http://a:8000/v1/") == "http://a:8000"
    with pytest.raises(ValueError, match="--backend"):
        normalize_url("a:8000")
    with pytest.raises(ValueError, match="--backend-dns"):
        parse_dns_target("svc")
    with pytest.raises(ValueError, match="--backend"):
        RouterSettings()
    with pytest.raises(ValueError, match="--health-interval"):
        RouterSettings(backends=["http://a"], health_interval=10)
    with pytest.raises(ValueError, match="--quota-redis-down"):
        RouterSettings(backends=["http://a"], quota_redis_down="maybe")


def test_a_replica_loading_at_start_is_not_ready_then_ready_and_a_later_fault_is_said_as_one(caplog):
    b = Backend("http://10.0.0.1:8000")
    with caplog.at_level("WARNING", logger="deepserve.router.pool"):
        for healthy, why in [(False, "health check answered 503"), (True, None), (True, None),
                             (False, "health check failed: ClientConnectorError"), (True, None)]:
            b.mark(healthy, why)
    assert [r.getMessage() for r in caplog.records] == [
        "backend http://10.0.0.1:8000 is not ready yet (health check answered 503)",
        "backend http://10.0.0.1:8000 is ready",
        "backend http://10.0.0.1:8000 is out of rotation (health check failed: ClientConnectorError)",
        "backend http://10.0.0.1:8000 is healthy again"]
    assert b.healthy and b.in_rotation
    caplog.clear()
    joined = Backend("http://10.0.0.2:8000", healthy=False)  # as --backend-dns adds one: out until it passes
    with caplog.at_level("WARNING", logger="deepserve.router.pool"):
        joined.mark(False, "health check answered 503")  # still loading: no change, nothing said
        joined.mark(True)
    assert [r.getMessage() for r in caplog.records] == ["backend http://10.0.0.2:8000 is ready"]


def test_backend_dns_adds_each_address_once_and_forgets_those_gone():
    import asyncio

    from deepserve.router.pool import BackendPool

    pool = BackendPool(["http://127.0.0.1:9"], ["localhost:8123"])
    asyncio.run(pool.refresh_dns())
    found = [u for u, b in pool.backends.items() if b.dns == "localhost"]
    assert "http://127.0.0.1:8123" in found and not pool.backends[found[0]].healthy  # until its first probe
    pool.dns_targets = [("localhost", 8124)]  # the Service now answers elsewhere: the old pods left
    asyncio.run(pool.refresh_dns())
    assert "http://127.0.0.1:8123" not in pool.backends and "http://127.0.0.1:8124" in pool.backends
    assert "http://127.0.0.1:9" in pool.backends  # a static --backend never leaves


def test_audit_names_a_known_key_its_role_refuses(tmp_path):
    # As the server's: a 403 for a key the router knows (a metrics key on an admin route) is recorded under
    # that key's name; an unknown key (401) has none. The app runs in-process without its lifespan: the
    # key check answers before any backend is asked.
    import json

    from fastapi.testclient import TestClient
    from serverkit import METRICS, auth, write_keys

    from deepserve.router.app import build_app
    from deepserve.router.state import RouterState

    audit = tmp_path / "audit.jsonl"
    st = RouterState(RouterSettings(backends=["http://127.0.0.1:9"], api_keys_file=write_keys(str(tmp_path / "k.yaml")),
                                    audit_log=str(audit)))
    client = TestClient(build_app(st))
    assert client.get("/admin/usage", headers=auth(METRICS)).status_code == 403
    assert client.get("/admin/usage", headers=auth("sk-nobody-0000")).status_code == 401
    st.audit.close()
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [(r["outcome"], r["key"], r["endpoint"]) for r in records] == [
        ("denied_403", "scraper", "/admin/usage"), ("denied_401", None, "/admin/usage")]


@pytest.mark.parametrize("strict", [True, False])
def test_a_body_json_cannot_read_is_a_400_with_or_without_strict_validation(strict):
    from types import SimpleNamespace

    from deepserve.router.proxy import parse_request
    from deepserve.server.errors import APIError

    st = SimpleNamespace(settings=SimpleNamespace(strict_validation=strict))
    for raw, says in ((b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}", "number too long to read"),
                      (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
                      (b"\xc3\x28", "UTF-8" if strict else "not valid JSON")):
        with pytest.raises(APIError) as e:
            parse_request(st, raw, chat=False)
        assert e.value.status == 400 and says in e.value.message, (raw[:20], e.value.message)


def test_key_reload_says_what_happened_and_sighup_is_the_servers(tmp_path, monkeypatch):
    # POST /admin/keys/reload: 200 with the count when the file loads, 422 naming the problem when it does
    # not (the old keys stay). The lifespan installs the server's SIGHUP handler (keys and audit log).
    from fastapi.testclient import TestClient
    from serverkit import ADMIN, USER, auth, hash_key, write_keys

    import deepserve.router.app as router_app
    from deepserve.router.state import RouterState

    keys = write_keys(str(tmp_path / "k.yaml"), [{"name": "ops", "key_hash": hash_key(ADMIN), "role": "admin"}])
    st = RouterState(RouterSettings(backends=["http://127.0.0.1:9"], api_keys_file=keys,
                                    audit_log=str(tmp_path / "audit.jsonl")))
    installed = []
    monkeypatch.setattr(router_app, "install_sighup", installed.append)
    monkeypatch.setattr(st.pool, "run_checks", lambda client: asyncio.sleep(0))
    with TestClient(router_app.build_app(st)) as client:
        assert installed == [st]
        ok = client.post("/admin/keys/reload", headers=auth(ADMIN))
        assert ok.status_code == 200 and ok.json() == {"status": "ok", "keys": 4}, ok.text
        (tmp_path / "k.yaml").write_text("keys: [not a mapping")
        bad = client.post("/admin/keys/reload", headers=auth(ADMIN))
        assert bad.status_code == 422 and "previous keys stay in force" in bad.json()["error"]["message"]
        assert client.post("/admin/keys/reload", headers=auth(USER)).status_code == 403  # the old keys, still
        assert client.post("/admin/backends/drain", json={"url": "http://nope"}, headers=auth(ADMIN)).status_code == 404
    st.audit.close()
    import json

    records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [(r["key"], r["endpoint"], r["outcome"]) for r in records] == [
        ("ops", "/admin/keys/reload", "admin_ok"), ("ops", "/admin/keys/reload", "admin_rejected_422"),
        ("user", "/admin/keys/reload", "denied_403"), ("ops", "/admin/backends/drain", "admin_rejected_404")]
    assert "error" not in records[0] and records[1]["error"]  # why the file was refused


def test_sighup_reloads_the_keys_and_reopens_the_audit_log(tmp_path):
    # What logrotate does: rename the file, send SIGHUP; the next record starts a new file at the path.
    import os
    import signal
    from types import SimpleNamespace

    from deepserve.server.api_server import install_sighup
    from deepserve.server.audit import AuditLog

    path = tmp_path / "audit.jsonl"
    reloads: list[int] = []
    st = SimpleNamespace(keys=SimpleNamespace(path="keys.yaml", reload=lambda: reloads.append(1)),
                         audit=AuditLog(str(path)))
    st.audit.write(outcome="ok")
    path.rename(tmp_path / "audit.jsonl.1")

    async def main() -> None:
        install_sighup(st)
        assert signal.getsignal(signal.SIGHUP) is not signal.SIG_DFL  # else the signal would end pytest
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(100):
            if reloads:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    st.audit.write(outcome="ok")
    st.audit.close()
    import json

    records = [json.loads(line) for line in path.read_text().splitlines()]  # the new file: the reload, then on
    assert reloads == [1] and [(r.get("endpoint"), r["outcome"]) for r in records] == [
        ("SIGHUP key reload", "admin_ok"), (None, "ok")]


def test_a_sighup_before_the_lifespan_is_one_reload_when_it_starts(tmp_path, monkeypatch):
    # `deepserve serve` and `router` call defer_sighup first: a SIGHUP while they load is recorded (its
    # default action would end the process) and the lifespan reloads once, since the keys may have changed.
    import os
    import signal

    import deepserve.router.app as router_app
    from deepserve.router.state import RouterState
    from deepserve.server.api_server import defer_sighup

    st = RouterState(RouterSettings(backends=["http://127.0.0.1:9"]))
    reloads: list[int] = []
    monkeypatch.setattr(st.keys, "reload", lambda: reloads.append(1))
    monkeypatch.setattr(st.pool, "run_checks", lambda client: asyncio.sleep(0))

    async def serve() -> None:
        app = router_app.build_app(st)
        async with app.router.lifespan_context(app):  # in this thread, as uvicorn runs it: the real handler
            assert reloads == [1]
            os.kill(os.getpid(), signal.SIGHUP)  # now the running router's handler
            for _ in range(100):
                if len(reloads) == 2:
                    break
                await asyncio.sleep(0.01)

    before = signal.getsignal(signal.SIGHUP)
    try:
        defer_sighup()
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGHUP)
        assert reloads == []  # recorded, not applied: nothing to reload into yet
        asyncio.run(serve())
    finally:
        signal.signal(signal.SIGHUP, before)
    assert reloads == [1, 1]


def test_quota_errors_are_a_counter_and_an_unreachable_redis_is_said_at_start():
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from deepserve.router.metrics import RouterMetrics
    from deepserve.router.quota import NoQuota, RedisQuota

    text = generate_latest(RouterMetrics(SimpleNamespace(backends={}), SimpleNamespace(errors=3)).registry).decode()
    assert "# TYPE deepserve:router_quota_errors_total counter" in text
    assert "deepserve:router_quota_errors_total 3.0" in text

    async def check() -> tuple[str | None, str | None]:
        down = RedisQuota("redis://127.0.0.1:9/0")  # port 9 (discard): nothing listens
        try:
            return await down.reachable(), await NoQuota().reachable()
        finally:
            await down.close()

    problem, none = asyncio.run(check())
    assert none is None and problem is not None and "Error" in problem


def test_the_router_tells_replicas_the_clients_address():
    # X-Forwarded-For: the client as the router saw it, and only that (a client's own header would let it
    # choose the address a replica trusting the router sees).
    from types import SimpleNamespace

    from starlette.requests import Request

    from deepserve.router.proxy import backend_headers

    st = SimpleNamespace(settings=SimpleNamespace(backend_api_key="sk-backend"))

    def request(*headers: tuple[bytes, bytes]) -> Request:
        return Request({"type": "http", "headers": list(headers), "client": ("10.1.2.3", 5555)})

    assert backend_headers(st, request(), "id-1")["x-forwarded-for"] == "10.1.2.3"
    forged = backend_headers(st, request((b"x-forwarded-for", b"203.0.113.9")), "id-2")
    assert forged["x-forwarded-for"] == "10.1.2.3" and forged["authorization"] == "Bearer sk-backend"  # replaced
