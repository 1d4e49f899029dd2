"""The router's Prometheus metrics: per-backend requests, retries and health, per-key usage (the
server's `deepserve:key_*` names, so one dashboard reads both), and the latency through the router."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deepserve.router.pool import BackendPool
from deepserve.server.metrics import _LATENCY


class _PoolGauges(Collector):
    """Backend state read at scrape time, so it is never stale."""

    def __init__(self, pool: BackendPool, quota) -> None:
        self.pool, self.quota = pool, quota

    def collect(self) -> Iterator[Metric]:
        gauges = {
            "healthy": "1 when the backend passes its health checks.",
            "drained": "1 when an operator drained the backend (no new requests).",
            "outstanding": "Requests in flight on the backend through this router.",
        }
        for name, doc in gauges.items():
            family = GaugeMetricFamily(f"deepserve:router_backend_{name}", doc, labels=["backend"])
            for b in list(self.pool.backends.values()):
                family.add_metric([b.url], float(getattr(b, name)))
            yield family
        # A running count: a counter (exported as ..._total), so rate() and increase() apply.
        errors = CounterMetricFamily("deepserve:router_quota_errors", "Quota store (Redis) calls that failed.")
        errors.add_metric([], float(self.quota.errors))
        yield errors


class RouterMetrics:
    def __init__(self, pool: BackendPool, quota) -> None:
        r = self.registry = CollectorRegistry()
        self.backend_requests = Counter("deepserve:router_backend_requests",
                                        "Requests sent to each backend, by outcome (ok, http_<status>, "
                                        "connect_error, stream_cut).", ["backend", "outcome"], registry=r)
        self.retries = Counter("deepserve:router_retries", "Requests retried on another backend after this "
                               "backend failed before the response started.", ["backend"], registry=r)
        self.latency = Histogram("deepserve:router_request_latency_seconds",
                                 "Arrival at the router to the end of the response.", ["endpoint"],
                                 buckets=_LATENCY, registry=r)
        self.key_requests = Counter("deepserve:key_requests", "Requests per API key and outcome.",
                                    ["key", "outcome"], registry=r)
        self.key_prompt_tokens = Counter("deepserve:key_prompt_tokens", "Prompt tokens per API key.",
                                         ["key"], registry=r)
        self.key_generation_tokens = Counter("deepserve:key_generation_tokens",
                                             "Generated tokens per API key.", ["key"], registry=r)
        r.register(_PoolGauges(pool, quota))

    def render(self) -> bytes:
        return generate_latest(self.registry)
