"""Per-key buckets (requests, reserved-then-settled tokens, concurrency), per-IP, and the wait queue."""

from __future__ import annotations

import pytest

from deepserve.server.auth import ApiKey
from deepserve.server.errors import APIError
from deepserve.server.ratelimit import RateLimiter, WaitQueue


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def key(**limits) -> ApiKey:
    return ApiKey("k", "user", b"\0" * 32, **limits)


def limited(fn, *args) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args)
    assert e.value.status == 429
    return e.value


def test_requests_per_minute_refills_continuously():
    clock = Clock()
    rl, k = RateLimiter(clock), key(requests_per_minute=60)
    for _ in range(60):
        rl.settle(rl.admit(k, 0), 0)
    err = limited(rl.admit, k, 0)
    assert err.headers["Retry-After"] == "1" and err.headers["x-ratelimit-remaining-requests"] == "0"
    clock.t += 1.0  # one request's worth
    rl.admit(k, 0)
    limited(rl.admit, k, 0)


def test_tokens_reserved_then_settled():
    clock = Clock()
    rl, k = RateLimiter(clock), key(tokens_per_minute=1000)
    a = rl.admit(k, 600)  # prompt + max_tokens
    limited(rl.admit, k, 600)  # only 400 left while `a` runs
    rl.settle(a, 100)  # it used 100: 500 go back
    b = rl.admit(k, 600)
    assert b.headers["x-ratelimit-remaining-tokens"] == "300"
    rl.settle(b, 600)
    rl.settle(b, 0)  # settling twice changes nothing
    err = limited(rl.admit, k, 600)
    assert int(err.headers["Retry-After"]) == 18  # (600 - 300) tokens at 1000/60 per second
    assert "lower max_tokens" in limited(rl.admit, k, 5000).message


def test_refused_admission_takes_nothing():
    rl, k = RateLimiter(Clock()), key(requests_per_minute=10, tokens_per_minute=100)
    limited(rl.admit, k, 150)
    assert rl.admit(k, 100).headers["x-ratelimit-remaining-requests"] == "9"


def test_concurrency():
    rl, k = RateLimiter(Clock()), key(max_concurrent=2)
    a, _ = rl.admit(k, 1), rl.admit(k, 1)
    assert "max_concurrent" in limited(rl.admit, k, 1).message
    rl.settle(a, 1)
    rl.admit(k, 1)
    assert rl.concurrent("k") == 2


def test_limits_follow_key_reload():
    rl = RateLimiter(Clock())
    rl.admit(key(requests_per_minute=1), 0)
    limited(rl.admit, key(requests_per_minute=1), 0)
    rl.admit(key(requests_per_minute=5), 0)  # a new limit starts a new bucket


def test_per_ip():
    rl = RateLimiter(Clock())
    rl.check_ip("1.2.3.4", 2)
    rl.check_ip("1.2.3.4", 2)
    limited(rl.check_ip, "1.2.3.4", 2)
    rl.check_ip("5.6.7.8", 2)
    rl.check_ip("1.2.3.4", None)


def test_wait_queue_bounds_requests_and_tokens():
    q = WaitQueue(max_requests=2, max_tokens=100)
    q.enter(500)  # an empty queue admits anything: one big prompt is never refused for size alone
    with pytest.raises(APIError) as e:
        q.enter(1)
    assert e.value.status == 503 and e.value.headers["Retry-After"] == "1"
    q.leave(500)
    q.enter(60)
    q.enter(40)
    with pytest.raises(APIError):
        q.enter(1)  # two waiting
    q.leave(40)
    with pytest.raises(APIError):
        q.enter(41)  # 60 + 41 > 100 tokens
    q.enter(40)


def test_a_list_of_prompts_is_admitted_whole_or_not_at_all():
    clock = Clock()
    rl, k = RateLimiter(clock), key(requests_per_minute=3, tokens_per_minute=1000, max_concurrent=3)
    # Beyond what the key allows at all: a 429 naming prompt, with no Retry-After (waiting would not help).
    for tokens, says in (([1] * 4, "max_concurrent"), ([400] * 3, "send fewer prompts")):
        err = limited(rl.admit_many, k, tokens)
        assert says in err.message and "Retry-After" not in err.headers
    assert rl.concurrent("k") == 0
    both = rl.admit_many(k, [100, 200])  # took two requests, 300 tokens, two slots
    assert both[0].headers["x-ratelimit-remaining-requests"] == "1" and rl.concurrent("k") == 2
    err = limited(rl.admit_many, k, [10, 10])  # the slots and requests left hold one more, not two
    assert "already has 2 requests in flight" in err.message and err.headers["Retry-After"] == "1"
    rl.settle(both[0], 100)
    assert "requests per minute" in limited(rl.admit_many, k, [10, 10]).message
    assert rl.admit(k, 10).headers["x-ratelimit-remaining-requests"] == "0"  # the refused lists took nothing


def test_unreserve_gives_back_the_request_too():
    rl, k = RateLimiter(Clock()), key(requests_per_minute=1, tokens_per_minute=100)
    rl.unreserve(rl.admit(k, 80))  # e.g. the wait queue refused it after admission
    assert rl.concurrent("k") == 0
    a = rl.admit(k, 100)
    assert a.headers["x-ratelimit-remaining-requests"] == "0" and a.headers["x-ratelimit-remaining-tokens"] == "0"
