"""Global per-key quotas in Redis, shared by every router: requests/min and tokens/min.

Both are sliding one-minute windows kept as sorted sets scored by Redis's own clock (TIME inside the
script, so routers with skewed clocks agree):
- requests: one member per admitted request. Admission is one Lua script (atomic in Redis): drop
  members older than 60 s, refuse if the count is at the limit, else add this request. So across any
  number of routers a key gets exactly `requests_per_minute` requests in any 60-second window.
- tokens: one member per finished request, worth prompt_tokens + completion_tokens as the backend's
  `usage` reported them (streams: the router asks the backend for the usage chunk and strips it again
  when the client did not ask). The same script refuses a new request while the key's tokens in the
  window are at or above `tokens_per_minute`. Tokens are known only at the end, so the limit is
  checked before and charged after: the requests in flight when the limit is reached can overshoot it
  by their own size; nothing is admitted after that until the window slides.
A request the router could not serve (no backend, a backend error, a 4xx from the backend) gives its
request back (the member is removed), as the replicas' own limiter does.

When Redis cannot be reached: `--quota-redis-down closed` (default) answers 503 to keys that have a
limit, so a Redis outage never lifts a quota; `open` admits them (the replicas' own per-key limits
remain the second line) and counts the failures in deepserve:router_quota_errors_total. Keys without
limits never touch Redis.
"""

from __future__ import annotations

import logging
import math
import uuid
from dataclasses import dataclass, field

from deepserve.server.auth import ApiKey
from deepserve.server.errors import APIError

logger = logging.getLogger(__name__)
WINDOW_MS = 60_000

# KEYS: requests zset, tokens zset. ARGV: request limit (0: none), token limit (0: none), member, window ms.
# Returns {admitted (0/1), what refused it, ms until retry, requests in window, tokens in window}.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[4])
local req_limit, tok_limit = tonumber(ARGV[1]), tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - window)
local n = redis.call('ZCARD', KEYS[1])
if req_limit > 0 and n >= req_limit then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {0, 'requests', tonumber(oldest[2]) + window - now, n, 0}
end
local used = 0
if tok_limit > 0 then
  local entries = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
  for i = 1, #entries, 2 do
    used = used + tonumber(string.match(entries[i], ':(%d+)$'))
  end
  if used >= tok_limit then
    local wait = window
    local freed = 0
    for i = 1, #entries, 2 do
      freed = freed + tonumber(string.match(entries[i], ':(%d+)$'))
      if used - freed < tok_limit then wait = tonumber(entries[i + 1]) + window - now break end
    end
    return {0, 'tokens', wait, n, used}
  end
end
redis.call('ZADD', KEYS[1], now, ARGV[3])
redis.call('PEXPIRE', KEYS[1], window)
return {1, '', 0, n + 1, used}
"""

# KEYS: tokens zset. ARGV: member ("<id>:<tokens>"), window ms.
_CHARGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
"""


@dataclass
class Ticket:
    """One admitted request's hold on its key's quota."""

    key: ApiKey | None  # None: the key has no limits, nothing to give back or charge
    member: str = field(default_factory=lambda: uuid.uuid4().hex)
    headers: dict[str, str] = field(default_factory=dict)


def _limited(key: ApiKey) -> bool:
    return key.requests_per_minute is not None or key.tokens_per_minute is not None


class RedisQuota:
    def __init__(self, url: str, fail_open: bool = False, prefix: str = "deepserve:quota") -> None:
        import redis.asyncio as aioredis

        self.client = aioredis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.fail_open = fail_open
        self.prefix = prefix
        self.errors = 0
        self._admit = self.client.register_script(_ADMIT)
        self._charge = self.client.register_script(_CHARGE)

    def _keys(self, name: str) -> list[str]:
        # One hash tag per key: both sets live on the same Redis Cluster slot.
        return [f"{self.prefix}:{{{name}}}:requests", f"{self.prefix}:{{{name}}}:tokens"]

    async def admit(self, key: ApiKey) -> Ticket:
        if not _limited(key):
            return Ticket(None)
        ticket = Ticket(key)
        try:
            ok, what, wait_ms, n, used = await self._admit(
                keys=self._keys(key.name),
                args=[key.requests_per_minute or 0, key.tokens_per_minute or 0, ticket.member, WINDOW_MS])
        except Exception as e:  # redis.RedisError, OSError, timeouts: the store is unreachable
            return self._store_down(key, e)
        ticket.headers = self._headers(key, int(n), int(used))
        if not ok:
            what = what.decode() if isinstance(what, bytes) else what
            limit = key.requests_per_minute if what == "requests" else key.tokens_per_minute
            retry = max(1, math.ceil(int(wait_ms) / 1000))
            raise APIError(429, f"rate limit of key '{key.name}' exceeded ({limit} {what} per minute, across "
                           f"all routers); retry in {retry}s", code="rate_limit_exceeded",
                           headers={**ticket.headers, "Retry-After": str(retry)})
        return ticket

    def _store_down(self, key: ApiKey, e: Exception) -> Ticket:
        self.errors += 1
        logger.error("quota store (Redis) unreachable: %s: %s", type(e).__name__, e)
        if self.fail_open:
            return Ticket(None)
        raise APIError(503, f"the quota store is unreachable, so key '{key.name}' (which has a rate limit) "
                       "cannot be admitted; retry shortly", code="quota_store_unavailable",
                       headers={"Retry-After": "2"})

    async def give_back(self, ticket: Ticket) -> None:
        if ticket.key is None:
            return
        try:
            await self.client.zrem(self._keys(ticket.key.name)[0], ticket.member)
        except Exception as e:
            self.errors += 1
            logger.error("quota store (Redis): could not give back a request: %s", e)

    async def charge(self, ticket: Ticket, tokens: int) -> None:
        if ticket.key is None or ticket.key.tokens_per_minute is None or tokens <= 0:
            return
        try:
            await self._charge(keys=self._keys(ticket.key.name)[1:], args=[f"{ticket.member}:{tokens}", WINDOW_MS])
        except Exception as e:
            self.errors += 1
            logger.error("quota store (Redis): could not charge %d tokens to '%s': %s", tokens, ticket.key.name, e)

    @staticmethod
    def _headers(key: ApiKey, n: int, used: int) -> dict[str, str]:
        h = {}
        if key.requests_per_minute is not None:
            h["x-ratelimit-limit-requests"] = str(key.requests_per_minute)
            h["x-ratelimit-remaining-requests"] = str(max(0, key.requests_per_minute - n))
        if key.tokens_per_minute is not None:
            h["x-ratelimit-limit-tokens"] = str(key.tokens_per_minute)
            h["x-ratelimit-remaining-tokens"] = str(max(0, key.tokens_per_minute - used))
        return h

    async def reachable(self) -> str | None:
        """None when Redis answers a PING, else why not (said at start-up; requests keep trying)."""
        try:
            await self.client.ping()
        except Exception as e:  # redis' connection and timeout errors, or anything else on the way
            return f"{type(e).__name__}: {e}"
        return None

    async def close(self) -> None:
        await self.client.aclose()


class NoQuota:
    """No --redis-url: the router enforces no global quota (the replicas' own limits still apply)."""

    errors = 0

    async def admit(self, key: ApiKey) -> Ticket:
        return Ticket(None)

    async def give_back(self, ticket: Ticket) -> None:
        pass

    async def charge(self, ticket: Ticket, tokens: int) -> None:
        pass

    async def reachable(self) -> str | None:
        return None

    async def close(self) -> None:
        pass
