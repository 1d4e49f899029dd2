"""`deepserve bench serve`: the online serving benchmark against any OpenAI-compatible endpoint.

Requests arrive as a Poisson process (--request-rate, gamma-distributed gaps with --burstiness, as
vLLM's `bench serve`), at most --max-concurrency at a time (default 256, a default server's
--max-waiting-requests: vLLM's default is no limit, but a deepserve server answers 503 "server overloaded"
beyond its bounded queue, where vLLM's queues without bound), each streamed from /v1/completions with
token-id prompts (no tokenizer needed on the client). The result JSON uses the field names of
vLLM's `bench serve`, so the two tools' outputs compare directly:
    duration, completed, failed, total_input_tokens, total_output_tokens, request_throughput,
    request_goodput, output_throughput, total_token_throughput, {mean,median,std,pNN}_{ttft,tpot,itl,e2el}_ms
Definitions (vLLM's): TTFT is the send time to the first chunk carrying text; ITL the gaps between
later text chunks; TPOT per request (e2el - ttft) / (output tokens - 1); E2EL send to last byte.
Output tokens are the server's `usage.completion_tokens` (stream_options.include_usage); goodput is
the completed requests per second that meet every --goodput SLO.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class Prompt:
    token_ids: list[int]
    output_len: int
    temperature: float


@dataclass
class Outcome:
    ok: bool = False
    input_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    error: str = ""


RANDOM_VOCAB = 10_000  # the random dataset's ids are drawn below this unless --random-vocab-size says otherwise


def build_dataset(name: str, n: int, input_len: int, output_len: int, range_ratio: float, vocab: int | None,
                  seed: int) -> list[Prompt]:
    """`vocab` None: W1 exactly as BENCHMARKS.md defines it (ids 0..10,000), random ids below RANDOM_VOCAB."""
    if name == "w1":
        from deepserve.bench.workloads import w1, within_vocab

        wl = w1(n) if vocab is None else within_vocab(w1(n), vocab)
        return [Prompt(p, sp.max_tokens, sp.temperature) for p, sp in zip(wl.prompts, wl.params, strict=True)]
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)

    def length(center: int) -> int:
        return rng.randint(max(1, int(center * (1 - range_ratio))), max(1, int(center * (1 + range_ratio))))

    vocab = RANDOM_VOCAB if vocab is None else vocab
    return [Prompt([rng.randrange(vocab) for _ in range(length(input_len))], length(output_len), 0.0)
            for _ in range(n)]


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes KEY:MS with KEY one of ttft, tpot, e2el; got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {name} must be a number of milliseconds, got {value!r}") from None
    return slos


async def _one(session, url: str, headers: dict, model: str, prompt: Prompt, ignore_eos: bool) -> Outcome:
    import aiohttp

    body = {"model": model, "prompt": prompt.token_ids, "max_tokens": prompt.output_len,
            "temperature": prompt.temperature, "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    out = Outcome(input_len=len(prompt.token_ids))
    start = last = time.perf_counter()
    chunks: list[str] = []
    try:
        async with session.post(url, json=body, headers=headers) as r:
            if r.status != 200:
                out.error = f"HTTP {r.status}: {(await r.read())[:300].decode('utf-8', 'replace')}"
                return out
            async for raw in r.content:  # one line at a time
                line = raw.decode("utf-8").strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    out.error = str(obj["error"].get("message"))
                    return out
                now = time.perf_counter()
                text = "".join(c.get("text") or "" for c in obj.get("choices") or [])
                if text:
                    if not chunks:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    chunks.append(text)
                if obj.get("usage"):
                    out.output_len = int(obj["usage"].get("completion_tokens") or 0)
        out.latency = time.perf_counter() - start
        out.text = "".join(chunks)
        out.ok = bool(chunks) or out.output_len > 0
        if not out.ok:
            out.error = "the stream carried no text"
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


async def _arrivals(n: int, rate: float, burstiness: float, seed: int):
    rng = np.random.default_rng(seed)
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            await asyncio.sleep(rng.gamma(burstiness, 1.0 / (rate * burstiness)))


def join_url(base_url: str, endpoint: str) -> str:
    """The server's root and the endpoint's path; a base URL given as the openai client takes it (ending in
    /v1) loses that /v1 when the endpoint starts with one, instead of asking for /v1/v1/completions (404)."""
    base = base_url.rstrip("/")
    if base.endswith("/v1") and endpoint.startswith("/v1/"):
        base = base[:-3]
    return base + endpoint


async def run(base_url: str, endpoint: str, model: str, api_key: str | None, prompts: list[Prompt], rate: float,
              burstiness: float, max_concurrency: int | None, ignore_eos: bool, seed: int) -> tuple[list, float]:
    import aiohttp

    url = join_url(base_url, endpoint)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # aiohttp, as vLLM's benchmark: an httpx AsyncClient adds milliseconds per request on a busy host.
    timeout = aiohttp.ClientTimeout(total=6 * 3600, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, read_bufsize=1 << 20) as client:
        async def limited(p: Prompt) -> Outcome:
            if sem is None:
                return await _one(client, url, headers, model, p, ignore_eos)
            async with sem:
                return await _one(client, url, headers, model, p, ignore_eos)

        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(prompts), rate, burstiness, seed):
            tasks.append(asyncio.create_task(limited(prompts[i])))
        outcomes = await asyncio.gather(*tasks)
        return outcomes, time.perf_counter() - start


def _pct_name(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def summarize(outcomes: list[Outcome], duration: float, slos: dict[str, float], percentiles: list[float]) -> dict:
    done = [o for o in outcomes if o.ok]
    tpots = [(o.latency - o.ttft) / (o.output_len - 1) for o in done if o.output_len > 1]
    series = {"ttft": [o.ttft for o in done], "tpot": tpots, "itl": [x for o in done for x in o.itl],
              "e2el": [o.latency for o in done]}
    good = 0
    for o in done:
        tpot = (o.latency - o.ttft) / (o.output_len - 1) if o.output_len > 1 else 0.0
        values = {"ttft": o.ttft, "tpot": tpot, "e2el": o.latency}
        good += all(values[k] * 1e3 <= v for k, v in slos.items())
    total_in = sum(o.input_len for o in done)
    total_out = sum(o.output_len for o in done)
    result = {
        "duration": duration, "completed": len(done), "failed": len(outcomes) - len(done),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(done) / duration,
        "request_goodput": good / duration if slos else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    for m in METRICS:
        xs = np.asarray(series[m] or [0.0]) * 1e3
        result[f"mean_{m}_ms"] = float(xs.mean())
        result[f"median_{m}_ms"] = float(np.median(xs))
        result[f"std_{m}_ms"] = float(xs.std())
        for p in percentiles:
            result[f"{_pct_name(p)}_{m}_ms"] = float(np.percentile(xs, p))
    result.update({"input_lens": [o.input_len for o in outcomes], "output_lens": [o.output_len for o in outcomes],
                   "ttfts": [o.ttft for o in outcomes], "itls": [o.itl for o in outcomes],
                   "generated_texts": [o.text for o in outcomes], "errors": [o.error for o in outcomes]})
    return result


def print_result(r: dict, percentiles: list[float]) -> None:
    if not r["completed"]:  # a table of zeros would only bury the reason
        print(f"no request completed ({r['failed']} failed)")
        _print_errors(r)
        return
    print("{s:{c}^60}".format(s=" Serving Benchmark Result ", c="="))
    rows = [("Successful requests:", r["completed"]), ("Failed requests:", r["failed"]),
            ("Benchmark duration (s):", f"{r['duration']:.2f}"), ("Total input tokens:", r["total_input_tokens"]),
            ("Total generated tokens:", r["total_output_tokens"]),
            ("Request throughput (req/s):", f"{r['request_throughput']:.2f}")]
    if r["request_goodput"] is not None:
        rows.append(("Request goodput (req/s):", f"{r['request_goodput']:.2f}"))
    rows += [("Output token throughput (tok/s):", f"{r['output_throughput']:.2f}"),
             ("Total token throughput (tok/s):", f"{r['total_token_throughput']:.2f}")]
    for name, unit in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        rows += [(f"Mean {unit} (ms):", f"{r[f'mean_{name}_ms']:.2f}"),
                 (f"Median {unit} (ms):", f"{r[f'median_{name}_ms']:.2f}")]
        rows += [(f"P{_pct_name(p)[1:]} {unit} (ms):", f"{r[f'{_pct_name(p)}_{name}_ms']:.2f}") for p in percentiles]
    for label, value in rows:
        print(f"{label:<40}{value:<20}")
    _print_errors(r)
    print("=" * 60)


def _print_errors(r: dict) -> None:
    if errors := [e for e in r["errors"] if e]:
        print(f"first error ({len(errors)} failed): {errors[0]}")
        if any("outside the vocabulary" in e for e in errors):
            print("hint: the server's vocabulary is smaller than the prompt ids: pass --random-vocab-size N "
                  "(N at most its size; the demo model: 1000)")
        if any(e.startswith("HTTP 503") and "overloaded" in e for e in errors):
            print("hint: the server's queue was full (its --max-waiting-requests, default 256, or "
                  "--max-waiting-tokens): send fewer at once with --max-concurrency (default 256) or "
                  "--request-rate, or start the server with a larger --max-waiting-requests")
        if any(e.startswith("HTTP 401") and "invalid API key" in e for e in errors):
            print("hint: the server refused the key: check --api-key (or OPENAI_API_KEY) against the server's "
                  "--api-key or key file")
        elif any(e.startswith("HTTP 401") for e in errors):
            print("hint: the server wants an API key: pass --api-key KEY (or set OPENAI_API_KEY); a server started "
                  "without --api-key answers every request 401")


def main(ns) -> dict:
    import os

    slos = parse_goodput(ns.goodput)
    percentiles = ns.metric_percentiles  # parsed by bench.cli.percentiles
    if ns.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {ns.request_rate}")
    if ns.max_concurrency is not None and ns.max_concurrency < 0:
        raise ValueError(f"--max-concurrency must be >= 0 (0: no limit), got {ns.max_concurrency}")
    prompts = build_dataset(ns.dataset, ns.num_prompts, ns.random_input_len, ns.random_output_len,
                            ns.random_range_ratio, ns.random_vocab_size, ns.seed)
    api_key = ns.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("DEEPSERVE_API_KEY")
    outcomes, duration = asyncio.run(run(ns.base_url, ns.endpoint, ns.model, api_key, prompts, ns.request_rate,
                                         ns.burstiness, ns.max_concurrency, not ns.no_ignore_eos, ns.seed))
    result = summarize(outcomes, duration, slos, percentiles)
    result.update({"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai", "model_id": ns.model,
                   "base_url": ns.base_url, "dataset": ns.dataset, "num_prompts": ns.num_prompts,
                   "request_rate": ns.request_rate, "burstiness": ns.burstiness,
                   "max_concurrency": ns.max_concurrency, "goodput_slos_ms": slos})
    print_result(result, percentiles)
    return result
