"""W2's TTFT in one engine process, and where it goes (fifth session of 2026-12-02 in RESULTS.md: with async
scheduling the TTFT of DeepSeek-LLM-7B -q fp8 read ~29 ms in some processes and ~47-56 ms in others).

    python3 bench/ttft_probe.py 1 [--model deepseek-llm-7b] [--quantization fp8] [--processes 4]
    # 1: async scheduling on, 0: off

Each process: W2's 1,024-token prompts with 64 outputs (2 warm-ups, 6 timed, fresh prompts), then 8 other
prompts timed step by step, twice (fresh, then prefix-cache hits; the first 2 of each untimed): per request
the host time of each of the first three engine.step() calls (with async scheduling the first launches the
prefill, the second launches the first decode and collects the prefill: the first token) and the TTFT,
medians printed per process. On the H200 the second W2 of 2 outputs, whose prompts repeated the first's,
read a TTFT above the fresh one (36 against 29 ms): the "prefix hits" columns time that case. With
--processes N the script runs itself N times, one engine each (the slow mode was a per-process one)."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time


def _steps_of_one_request(engine, prompt, params, request_id):
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    steps, first = [], None
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - t)
        if first is None and any(o.outputs[0].token_ids for o in outputs):
            first = time.perf_counter() - start
    return steps[:3], first


def one_process(ns) -> None:
    from deepserve import LLM, SamplingParams
    from deepserve.bench.latency import measure_latency

    kwargs = dict(quantization=ns.quantization) if ns.quantization != "none" else {}
    if ns.model != "demo":  # a preset's real shapes on dummy weights; "demo": the built-in model (CPU smoke)
        kwargs.update(model=ns.model, load_format="dummy")
    llm = LLM(skip_tokenizer_init=True, max_model_len=4096 if ns.model != "demo" else 1200,
              async_scheduling=ns.async_scheduling == "1", **kwargs)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    vocab = min(llm.llm_engine.config.model.hf_config.vocab_size, 10001)
    w2 = measure_latency(llm, output_len=64, warmups=2, iters=6, vocab_size=vocab)
    engine, rng = llm.llm_engine, random.Random(1)  # other prompts than W2's: no prefix-cache hits
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompts = [[rng.randrange(vocab) for _ in range(1024)] for _ in range(8)]
    line = f"RESULT async {ns.async_scheduling} W2 ttft {w2['ttft_ms_median']:.1f} tpot {w2['tpot_ms_median']:.2f}"
    for label in ("fresh", "prefix hits"):  # the same prompts again: all but their last partial block cached
        rows = [_steps_of_one_request(engine, p, params, f"{label}-{i}") for i, p in enumerate(prompts)][2:]
        med = [statistics.median(1e3 * s[k] for s, _ in rows) for k in range(3)]
        line += (f" | {label}: ttft {statistics.median(1e3 * f for _, f in rows):.1f}, host ms of steps 1-3 "
                 + " / ".join(f"{m:.1f}" for m in med))
    print(line, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("async_scheduling", choices=["0", "1"])
    parser.add_argument("--model", default="deepseek-llm-7b", help="a preset, or demo (the built-in model)")
    parser.add_argument("--quantization", default="fp8", help="fp8, awq, ... or none")
    parser.add_argument("--processes", type=int, default=1)
    ns = parser.parse_args()
    if ns.processes == 1:
        one_process(ns)
        return 0
    args = [ns.async_scheduling, "--model", ns.model, "--quantization", ns.quantization, "--processes", "1"]
    rc = 0
    for _ in range(ns.processes):
        rc |= subprocess.call([sys.executable, os.path.abspath(__file__), *args])
    return rc


if __name__ == "__main__":
    sys.exit(main())
