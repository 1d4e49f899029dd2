"""Prometheus metrics with vLLM's names under the `deepserve:` prefix, plus per-key usage.

Each app owns its registry (several servers can live in one test process). Engine-side totals
(preemptions, prefix cache) are cumulative counts kept by the engine process; they are exported
as counters through a collector that reads the latest stats message, never re-counted here.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

disable_created_metrics()  # the *_created series double the output and no dashboard reads them
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_GAP = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_ENGINE_TOTALS = {
    "num_preemptions_total": "Cumulative number of preemptions by the scheduler.",
    "prefix_cache_queries_total": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits_total": "Prompt tokens found in the prefix cache (GPU or host tier).",
    "num_swapped_out_blocks_total": "KV blocks of preempted requests copied to the host tier (--swap-space).",
    "num_swapped_in_blocks_total": "KV blocks copied back from the host tier when their request resumed.",
    "prefix_cache_host_hits_total": "Prompt tokens found in the host tier's prefix blocks and loaded back.",
    "prefix_cache_host_stores_total": "Prefix blocks evicted from the GPU and kept in the host tier.",
    # Speculative decoding (vLLM's names). Acceptance rate = accepted / draft tokens; mean accepted length
    # (tokens per verify step, the target's own included) = 1 + accepted / drafts.
    "spec_decode_num_drafts_total": "Speculative decoding: verify steps of one request (drafts checked).",
    "spec_decode_num_draft_tokens_total": "Speculative decoding: draft tokens proposed and verified.",
    "spec_decode_num_accepted_tokens_total": "Speculative decoding: draft tokens the target accepted.",
}


class _EngineTotals(Collector):
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.values: dict[str, float] = dict.fromkeys(_ENGINE_TOTALS, 0.0)

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, doc in _ENGINE_TOTALS.items():
            family = CounterMetricFamily(f"deepserve:{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], self.values[name])
            yield family


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        m = ["model_name"]
        self.running = Gauge("deepserve:num_requests_running", "Requests in the engine's running batch.", m,
                             registry=r).labels(model_name)
        self.waiting = Gauge("deepserve:num_requests_waiting", "Requests waiting in the engine.", m,
                             registry=r).labels(model_name)
        self.kv_usage = Gauge("deepserve:kv_cache_usage_perc", "KV cache usage, 1 = full.", m,
                              registry=r).labels(model_name)
        self.prompt_tokens = Counter("deepserve:prompt_tokens", "Prompt tokens processed.", m,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("deepserve:generation_tokens", "Tokens generated.", m,
                                         registry=r).labels(model_name)
        self.ttft = Histogram("deepserve:time_to_first_token_seconds", "Arrival to first token.", m,
                              buckets=_LATENCY, registry=r).labels(model_name)
        self.itl = Histogram("deepserve:inter_token_latency_seconds", "Time between output tokens.", m,
                             buckets=_TOKEN_GAP, registry=r).labels(model_name)
        self.e2e = Histogram("deepserve:e2e_request_latency_seconds", "Arrival to last token.", m,
                             buckets=_LATENCY, registry=r).labels(model_name)
        self.queue_time = Histogram("deepserve:request_queue_time_seconds",
                                    "Arrival at the engine to the step that produced the first token.", m,
                                    buckets=_LATENCY, registry=r).labels(model_name)
        self.success = Counter("deepserve:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=r)
        self.key_requests = Counter("deepserve:key_requests", "Requests per API key and outcome.",
                                    ["key", "outcome"], registry=r)
        self.key_prompt_tokens = Counter("deepserve:key_prompt_tokens", "Prompt tokens per API key.",
                                         ["key"], registry=r)
        self.key_generation_tokens = Counter("deepserve:key_generation_tokens",
                                             "Generated tokens per API key.", ["key"], registry=r)
        self._totals = _EngineTotals(model_name)
        r.register(self._totals)

    def update_engine(self, stats: dict) -> None:
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0))
        self.kv_usage.set(stats.get("kv_cache_usage", 0.0))
        for name in _ENGINE_TOTALS:
            self._totals.values[name] = float(stats.get(name, 0))

    def record_finished(self, key: str, outcome: str, finish_reasons: list[str],
                        prompt_tokens: int, generation_tokens: int) -> None:
        self.key_requests.labels(key, outcome).inc()
        self.key_prompt_tokens.labels(key).inc(prompt_tokens)
        self.key_generation_tokens.labels(key).inc(generation_tokens)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        for reason in finish_reasons:
            self.success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
