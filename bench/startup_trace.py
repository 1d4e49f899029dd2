"""Where a preset engine's start-up goes, before and inside EngineCore's own phases (the gate issue's
time-to-ready target). Prints a timeline and the functions that took longest under cProfile.

    python bench/startup_trace.py [--model deepseek-llm-7b] [--top 40] [--profile-out F]

The engine's own phases (load, KV sizing, cache + graphs) are in EngineCore.startup_s; this adds what
comes before them (interpreter, imports, CUDA context, the config) and which calls fill each phase.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

T0 = time.perf_counter()


def _age() -> float:
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="deepseek-llm-7b")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--profile-out", default=None)
    args = parser.parse_args()
    marks = [("interpreter until this script ran", _age() - (time.perf_counter() - T0))]
    last = time.perf_counter()

    def mark(name: str) -> None:
        nonlocal last
        now = time.perf_counter()
        marks.append((name, now - last))
        last = now

    profiler = cProfile.Profile()
    profiler.enable()
    import torch
    mark("import torch")
    if torch.cuda.is_available():
        torch.cuda.init()
        torch.empty(1, device="cuda")
    mark("CUDA context")
    from deepserve import LLM, SamplingParams
    from deepserve.config import EngineArgs
    mark("import deepserve")
    engine = dict(model=args.model, load_format="dummy", max_model_len=4096, skip_tokenizer_init=True)
    if args.model == "demo":  # the built-in demo model (CPU smoke run)
        engine = dict(skip_tokenizer_init=True)
    EngineArgs(**engine).create_engine_config()
    mark("create_engine_config (first: imports transformers)")
    llm = LLM(**engine)
    mark("LLM(...) (config again, load, KV sizing, cache + graphs)")
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    mark("first generate")
    profiler.disable()
    if args.profile_out:
        profiler.dump_stats(args.profile_out)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats("deepserve/", args.top)  # our calls, with what they include
    stats.sort_stats("tottime").print_stats(25)  # where the time itself is spent
    print(text.getvalue()[-16000:])
    print("engine phases:", {k: round(v, 2) for k, v in llm.llm_engine.core.startup_s.items()})
    # Start-up trace 1 (gVisor H200 machine) spent 8.6 s in builtins.compile over 3,939 calls, by their
    # number mostly modules compiled from source (no bytecode cache read or written). What decides that:
    site = os.path.dirname(os.path.dirname(torch.__file__))
    print(f"bytecode: dont_write_bytecode={sys.dont_write_bytecode} pycache_prefix={sys.pycache_prefix} "
          f"PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE')} site-packages {site} "
          f"writable={os.access(site, os.W_OK)} torch/__pycache__ exists="
          f"{os.path.isdir(os.path.join(os.path.dirname(torch.__file__), '__pycache__'))}")
    total = 0.0
    for name, seconds in marks:
        total += seconds
        print(f"{name:60s} {seconds:7.2f} s  (total {total:6.2f})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
