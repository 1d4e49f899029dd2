"""Admission control: per-key requests/min, tokens/min and concurrency; per-IP requests/min; and a
bounded global queue.

Tokens are reserved at admission (prompt + max_tokens per completion, the most the request can use)
and settled at the end, when the unused part goes back to the bucket. So a burst of long requests
cannot overshoot a key's budget while they run, and short answers do not waste it.

Buckets refill continuously (limit/60 per second) up to one minute's worth.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from deepserve.server.auth import ApiKey
from deepserve.server.errors import APIError, unavailable


class TokenBucket:
    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.updated = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (0 now); call refill() first."""
        return 0.0 if self.level >= amount else (amount - self.level) / self.rate

    def reset_after(self) -> float:
        return (self.capacity - self.level) / self.rate


@dataclass
class Admission:
    key_name: str
    reserved_tokens: int
    headers: dict[str, str] = field(default_factory=dict)
    settled: bool = False


def _retry_after(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))


class RateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}
        self._ips: dict[str, TokenBucket] = {}
        self._concurrent: dict[str, int] = {}

    def _bucket(self, table: dict[str, TokenBucket], name: str, limit: int, now: float) -> TokenBucket:
        b = table.get(name)
        if b is None or b.capacity != limit:  # new key, or its limit changed on reload
            b = table[name] = TokenBucket(limit, now)
        b.refill(now)
        return b

    def check_ip(self, ip: str, per_minute: int | None) -> None:
        if per_minute is None:
            return
        if len(self._ips) > 100_000:  # bound memory under a spray of source addresses
            self._ips.clear()
        b = self._bucket(self._ips, ip, per_minute, self.clock())
        if (wait := b.wait_for(1)) > 0:
            raise APIError(429, f"too many requests from {ip}: the limit is {per_minute} per minute",
                           code="rate_limit_exceeded", headers={"Retry-After": _retry_after(wait)})
        b.level -= 1

    def admit(self, key: ApiKey, tokens: int) -> Admission:
        """Reserve one request and `tokens` tokens for `key`, or raise 429 and take nothing."""
        return self.admit_many(key, [tokens])[0]

    def admit_many(self, key: ApiKey, tokens: list[int]) -> list[Admission]:
        """Reserve len(tokens) requests together (the prompts of one completion request), each with its tokens,
        or raise 429 and take nothing. A list larger than the key allows at all (more prompts than its
        max_concurrent or requests_per_minute, more tokens than its tokens_per_minute) is a 429 naming `prompt`
        without Retry-After: waiting would not help."""
        now, name, count, total = self.clock(), key.name, len(tokens), sum(tokens)
        headers: dict[str, str] = {}
        if key.max_concurrent is not None:
            if count > key.max_concurrent:
                raise _too_big(f"this request holds {count} prompts, each a request of its own; key '{name}' may "
                               f"have {key.max_concurrent} in flight (its max_concurrent): send fewer prompts a "
                               "request", {})
            if self._concurrent.get(name, 0) + count > key.max_concurrent:
                raise APIError(429, f"key '{name}' already has {self._concurrent.get(name, 0)} requests in flight "
                               f"(its max_concurrent is {key.max_concurrent}); retry when one finishes",
                               code="rate_limit_exceeded", headers={"Retry-After": "1"})
        req = tok = None
        if key.requests_per_minute is not None:
            req = self._bucket(self._requests, name, key.requests_per_minute, now)
            headers.update(self._headers("requests", req, count))
            if count > req.capacity:
                raise _too_big(f"this request holds {count} prompts, each a request of its own; key '{name}' allows "
                               f"{key.requests_per_minute} requests per minute: send fewer prompts a request",
                               headers)
            if (wait := req.wait_for(count)) > 0:
                raise self._limited(name, f"{key.requests_per_minute} requests per minute", wait, headers)
        if key.tokens_per_minute is not None:
            tok = self._bucket(self._tokens, name, key.tokens_per_minute, now)
            headers.update(self._headers("tokens", tok, total))
            if total > tok.capacity:
                fewer = " or send fewer prompts" if count > 1 else ""
                raise APIError(429, f"this request reserves {total} tokens (prompt + max_tokens x n), key "
                               f"'{name}' allows {key.tokens_per_minute} per minute; lower max_tokens{fewer}",
                               code="rate_limit_exceeded", headers=headers)
            if (wait := tok.wait_for(total)) > 0:
                raise self._limited(name, f"{key.tokens_per_minute} tokens per minute", wait, headers)
        if req is not None:
            req.level -= count
        if tok is not None:
            tok.level -= total
        self._concurrent[name] = self._concurrent.get(name, 0) + count
        return [Admission(name, t, headers) for t in tokens]

    def settle(self, adm: Admission, used_tokens: int) -> None:
        """Return the unused part of the reservation and release the concurrency slot (idempotent)."""
        if adm.settled:
            return
        adm.settled = True
        self._concurrent[adm.key_name] = max(0, self._concurrent.get(adm.key_name, 1) - 1)
        tok = self._tokens.get(adm.key_name)
        if tok is not None:
            tok.refill(self.clock())
            tok.level = min(tok.capacity, tok.level + max(0, adm.reserved_tokens - used_tokens))

    def unreserve(self, adm: Admission) -> None:
        """Undo an admission whose request never ran (refused after it, e.g. by the wait queue): its
        tokens, its concurrency slot and its request come back, so the refusal costs the key nothing."""
        if adm.settled:
            return
        self.settle(adm, 0)
        req = self._requests.get(adm.key_name)
        if req is not None:
            req.refill(self.clock())
            req.level = min(req.capacity, req.level + 1)

    def concurrent(self, key_name: str) -> int:
        return self._concurrent.get(key_name, 0)

    @staticmethod
    def _headers(kind: str, b: TokenBucket, cost: int) -> dict[str, str]:
        return {
            f"x-ratelimit-limit-{kind}": str(int(b.capacity)),
            f"x-ratelimit-remaining-{kind}": str(max(0, int(b.level - cost))),
            f"x-ratelimit-reset-{kind}": f"{b.reset_after():.1f}s",
        }

    @staticmethod
    def _limited(name: str, what: str, wait: float, headers: dict[str, str]) -> APIError:
        return APIError(429, f"rate limit of key '{name}' exceeded ({what}); retry in {wait:.1f}s",
                        code="rate_limit_exceeded", headers={**headers, "Retry-After": _retry_after(wait)})


def _too_big(message: str, headers: dict[str, str]) -> APIError:
    return APIError(429, message, param="prompt", code="rate_limit_exceeded", headers=headers)


class WaitQueue:
    """Requests admitted but not yet producing tokens, bounded in count and in prompt tokens.

    An empty queue always admits, so a single large prompt is never refused for its size alone.
    """

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.requests = 0
        self.tokens = 0

    def enter(self, prompt_tokens: int, requests: int = 1) -> None:
        """`requests` enter together or none does (the prompts of one completion request, each leaving on
        its own), so an empty queue admits any batch, as it does any prompt."""
        if self.requests and (
            self.requests + requests > self.max_requests or self.tokens + prompt_tokens > self.max_tokens
        ):
            raise unavailable(f"server overloaded: {self.requests} requests ({self.tokens} prompt tokens) "
                              "are already waiting; retry shortly", retry_after=1)
        self.requests += requests
        self.tokens += prompt_tokens

    def leave(self, prompt_tokens: int) -> None:
        self.requests -= 1
        self.tokens -= prompt_tokens
