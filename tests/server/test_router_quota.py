"""The router's Redis quota against a real redis-server: exact admission under concurrency, give-back,
token charging, and both Redis-down policies."""

from __future__ import annotations

import asyncio

import pytest
from routerkit import Redis
from serverkit import free_port

from deepserve.router.quota import RedisQuota
from deepserve.server.auth import ApiKey
from deepserve.server.errors import APIError


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    r = Redis(str(tmp_path_factory.mktemp("redis")))
    yield r.url
    r.stop()


def key(name: str, rpm: int | None = None, tpm: int | None = None) -> ApiKey:
    return ApiKey(name, "user", b"", requests_per_minute=rpm, tokens_per_minute=tpm)


async def admit_all(quotas: list[RedisQuota], k: ApiKey, n: int) -> list[int]:
    async def one(i: int) -> int:
        try:
            await quotas[i % len(quotas)].admit(k)
            return 200
        except APIError as e:
            return e.status

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def test_exact_under_concurrency_from_several_clients_and_give_back(redis_url):
    async def main():
        quotas = [RedisQuota(redis_url) for _ in range(3)]  # three "routers"
        k = key("exact", rpm=10)
        codes = await admit_all(quotas, k, 40)
        assert codes.count(200) == 10 and codes.count(429) == 30
        # A request given back (the router could not serve it) frees its place at once.
        with pytest.raises(APIError):
            await quotas[0].admit(k)
        k2 = key("giveback", rpm=2)
        t1 = await quotas[0].admit(k2)
        await quotas[1].admit(k2)
        await quotas[2].give_back(t1)
        t3 = await quotas[0].admit(k2)
        assert t3.headers["x-ratelimit-remaining-requests"] == "0"
        for q in quotas:
            await q.close()

    asyncio.run(main())


def test_tokens_are_charged_after_and_refuse_once_the_window_is_full(redis_url):
    async def main():
        q = RedisQuota(redis_url)
        k = key("tokens", tpm=100)
        t = await q.admit(k)
        await q.charge(t, 60)
        t = await q.admit(k)  # 60 < 100: admitted
        assert t.headers["x-ratelimit-remaining-tokens"] == "40"
        await q.charge(t, 60)  # 120: the running request overshot, as documented
        with pytest.raises(APIError) as e:
            await q.admit(k)
        assert e.value.status == 429 and "tokens per minute" in e.value.message
        assert int(e.value.headers["Retry-After"]) >= 59
        await q.close()

    asyncio.run(main())


@pytest.mark.parametrize("fail_open", [False, True])
def test_redis_down(fail_open):
    async def main():
        q = RedisQuota(f"redis://127.0.0.1:{free_port()}/0", fail_open=fail_open)
        if fail_open:
            ticket = await q.admit(key("k", rpm=1))
            assert ticket.key is None  # admitted, and nothing to give back
        else:
            with pytest.raises(APIError) as e:
                await q.admit(key("k", rpm=1))
            assert e.value.status == 503 and e.value.code == "quota_store_unavailable"
        assert (await q.admit(key("unlimited"))).key is None  # never touches Redis
        assert q.errors == 1
        await q.close()

    asyncio.run(main())
