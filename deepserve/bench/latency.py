"""`deepserve bench latency`: W2 — one request at a time, time to first token and per output token."""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from deepserve.bench.gpu_stats import device_name
from deepserve.bench.spec_stats import describe, spec_decode_summary
from deepserve.config import EngineArgs
from deepserve.sampling_params import SamplingParams

HBM_BYTES_PER_S = 4.8e12  # the H200's datasheet bandwidth, the denominator BENCHMARKS.md uses


def _timed_request(engine, prompt: list[int], params: SamplingParams, request_id: str) -> list[float]:
    """Wall-clock time of each output token, from the moment the request was added."""
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    stamps, seen = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            n = len(out.outputs[0].token_ids)
            now = time.perf_counter() - start
            stamps.extend([now] * (n - seen))
            seen = n
    return stamps


def run_latency(engine_args: EngineArgs, input_len: int = 1024, output_len: int = 512,
                warmups: int = 3, iters: int = 10) -> dict[str, Any]:
    from deepserve.entrypoints.llm import LLM

    llm = LLM(**vars(engine_args))
    vocab_size = llm.llm_engine.config.model.hf_config.vocab_size  # prompt ids stay inside it (the demo: 1,011)
    return {"model": engine_args.model, **measure_latency(llm, input_len, output_len, warmups, iters, vocab_size)}


def _random_prompt(rng: random.Random, input_len: int, vocab_size: int) -> list[int]:
    return [rng.randint(0, min(vocab_size, 10001) - 1) for _ in range(input_len)]


def measure_latency(llm, input_len: int = 1024, output_len: int = 512, warmups: int = 3,
                    iters: int = 10, vocab_size: int = 10001, prompt_fn=None) -> dict[str, Any]:
    """W2 on an engine with nothing else running: `warmups` requests, then `iters` timed ones; prompt
    tokens drawn from [0, min(vocab_size, 10001)), or prompt_fn(rng, input_len, vocab_size).

    tpot_ms_median is the median gap between consecutive output tokens; with speculative decoding a
    step hands out several tokens at once (gaps of 0), so tpot_ms_per_request_median, each request's
    (last token - first token) / (tokens - 1), is the figure to compare."""
    engine = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ttfts, tpots, per_request = [], [], []
    before = engine.stats()
    for i in range(warmups + iters):
        # A fresh prompt each time: a prefix-cache hit would flatter the TTFT.
        prompt = (prompt_fn or _random_prompt)(rng, input_len, vocab_size)
        stamps = _timed_request(engine, prompt, params, f"latency-{i}")
        if i == warmups - 1:
            before = engine.stats()
        if i >= warmups:
            ttfts.append(stamps[0])
            tpots.extend(b - a for a, b in zip(stamps, stamps[1:], strict=False))
            if len(stamps) > 1:
                per_request.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    tpot_median = statistics.median(tpots)
    speculative = spec_decode_summary(engine, before)
    per_request_median = statistics.median(per_request) if per_request else None
    bytes_per_step = _weight_bytes(engine) + _kv_bytes_per_token(engine) * (input_len + output_len / 2)
    on_cpu = engine.config.model.device == "cpu"
    return {
        "device": "cpu" if on_cpu else device_name(),
        "input_len": input_len,
        "output_len": output_len,
        "ttft_ms_median": 1e3 * statistics.median(ttfts),
        "tpot_ms_median": 1e3 * tpot_median,
        "tpot_ms_p99": 1e3 * sorted(tpots)[int(0.99 * (len(tpots) - 1))],
        "tpot_ms_per_request_median": 1e3 * per_request_median if per_request_median is not None else None,
        # The share is of the H200's HBM bandwidth: meaningless for an engine on the CPU (it read "0 %").
        "bandwidth_utilization": None if speculative or on_cpu else bandwidth_utilization(bytes_per_step,
                                                                                         tpot_median),
        "async_scheduling": engine.core.async_scheduling,
        "speculative": speculative,
    }


def bandwidth_utilization(bytes_per_step: float, tpot_median_s: float) -> float | None:
    """Share of HBM bandwidth a decode step uses reading its bytes, a step taking the median gap between
    tokens. Not given with speculative decoding (measure_latency): a step hands out several tokens, most
    gaps are 0 (the median was, on the H200, and this divided by it) and a per-token time would read
    above 100 %. Nor for an engine on the CPU, whose memory is not the HBM this divides by. None for a gap
    that is not positive."""
    return bytes_per_step / tpot_median_s / HBM_BYTES_PER_S if tpot_median_s > 0 else None


def _weight_bytes(engine) -> float:
    return weight_bytes_read_per_step(engine.core.runner.model)


def weight_bytes_read_per_step(model) -> float:
    """Weight bytes one single-sequence decode step reads: every parameter once, except the input
    embedding (one row; counted when tied, as the LM head reads it) and, for mixture-of-experts
    layers, only the top-k of the routed experts."""
    from deepserve.layers.moe import RoutedExperts

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = getattr(getattr(model, "model", None), "embed_tokens", None) or getattr(model, "embed", None)
    head = getattr(model, "lm_head", None) or getattr(model, "head", None)
    if embed is not None and (head is None or head.weight is not embed.weight):
        total -= embed.weight.numel() * embed.weight.element_size()
    top_k = getattr(model.config, "num_experts_per_tok", None)
    for experts in (m for m in model.modules() if isinstance(m, RoutedExperts)):
        size = sum(p.numel() * p.element_size() for p in experts.parameters())
        read = top_k + experts.num_shared_fused  # fused shared experts are read every step
        total -= size * (1 - read / experts.num_local)  # any storage: bf16, FP8 or int4
    return total


def _kv_bytes_per_token(engine) -> float:
    runner = engine.core.runner
    return runner.kv_cache_bytes_per_block() / runner.block_size


def print_result(result: dict[str, Any]) -> None:
    import json

    share = result["bandwidth_utilization"]
    per_request = result.get("tpot_ms_per_request_median")
    print(f"TTFT {result['ttft_ms_median']:.1f} ms, TPOT median {result['tpot_ms_median']:.2f} ms"
          + (f" (per request {per_request:.2f} ms)" if per_request is not None else "")
          + f", p99 {result['tpot_ms_p99']:.2f} ms, bandwidth "
          + (f"{100 * share:.0f} %" if share is not None else "n/a")
          + f" ({result['device']})" + describe(result.get("speculative")))
    print(json.dumps(result))



