"""Does the thread that builds llguidance's view of the tokenizer change how fast the masks fill afterwards?

On one H200 host (ab9, 2026-12-03), W1 with a JSON schema filled its masks in 1.46-1.58 ms a step when a
(since removed) warm-up built that view on a daemon thread at start-up, against 1.01-1.15 ms when the first
request built it on the main thread; in the next A/B (ab10) fills with the view built at start-up read
0.92-1.68 ms a step, without the warm-up 0.97-1.26 (bench/RESULTS.md, 2026-12-03). This
takes the engine out of it: the gate's schema and R1-Distill-Qwen's vocabulary (the preset's generated
tokenizer), `--rows` matchers advanced a random number of allowed tokens each (seeded), then `--fills` fills
of all their masks through llguidance's executor, as the engine fills them (engine/grammar.py _fill); the
view built on the main thread or on another one (`--build`).

    python bench/grammar_fill_probe.py --build main
    python bench/grammar_fill_probe.py --build thread
    MALLOC_ARENA_MAX=1 python bench/grammar_fill_probe.py --build thread   # one malloc arena for all threads
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import threading
import time

PRESET = "r1-distill-qwen-7b"


def tokenizer():
    from transformers import AutoTokenizer

    from deepserve.loader.presets import resolve_hf_config
    from deepserve.loader.vocab_tokenizer import vocab_tokenizer_dir

    config = resolve_hf_config(PRESET, None, "dummy")
    return AutoTokenizer.from_pretrained(vocab_tokenizer_dir(PRESET, config)), config.vocab_size


def build_view(tok, vocab: int, where: str):
    import llguidance.hf

    built = {}

    def build() -> None:
        built["view"] = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)

    if where == "thread":
        worker = threading.Thread(target=build)
        worker.start()
        worker.join()
    else:
        build()
    return built["view"]


def advanced_matchers(view, rows: int) -> list:
    import llguidance

    from deepserve.bench.workloads import BENCH_SCHEMA
    from deepserve.engine.grammar import grammar_spec
    from deepserve.sampling_params import StructuredOutputsParams

    template = llguidance.LLMatcher(view, grammar_spec(StructuredOutputsParams(json=BENCH_SCHEMA)), log_level=0)
    rng, matchers = random.Random(0), []
    for _ in range(rows):
        matcher = template.deep_copy()
        for _ in range(rng.randint(0, 40)):
            mask = matcher.compute_bitmask()
            allowed = [t for t in range(len(mask) * 8) if mask[t // 8] >> (t % 8) & 1][:64]
            if not allowed or matcher.is_stopped():
                break
            matcher.consume_token(rng.choice(allowed))
        matchers.append(matcher)
    return matchers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", choices=("main", "thread"), required=True)
    ap.add_argument("--rows", type=int, default=140)
    ap.add_argument("--fills", type=int, default=400)
    ns = ap.parse_args()
    import llguidance

    tok, vocab = tokenizer()
    view = build_view(tok, vocab, ns.build)
    matchers = advanced_matchers(view, ns.rows)
    row_bytes = (vocab + 31) // 32 * 4
    buffer = bytearray(row_bytes * len(matchers))
    address = ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))
    jobs = [(m, row) for row, m in enumerate(matchers) if not m.is_stopped()]
    executor = llguidance.LLExecutor()
    times = []
    for _ in range(ns.fills):
        start = time.perf_counter()
        executor.unsafe_compute_mask_ptr(jobs, address, row_bytes, len(matchers))
        times.append(time.perf_counter() - start)
    times = times[10:]
    print(f"build on {ns.build}: {len(jobs)} rows, fill median {1e3 * statistics.median(times):.3f} ms, "
          f"mean {1e3 * statistics.mean(times):.3f} ms over {len(times)} fills")


if __name__ == "__main__":
    main()
