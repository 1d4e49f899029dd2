"""`deepserve bench throughput | latency`: the BENCHMARKS.md workloads from the command line."""

from __future__ import annotations

import argparse
import json
import time

PROCESS_START = time.perf_counter()


def positive_int(text: str) -> int:
    """An argparse type: a count of at least 1 (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def fixed_shape(text: str) -> tuple[int, int, int]:
    """--fixed's ISL,OSL,N: three counts of at least 1."""
    parts = text.split(",")
    try:
        if len(parts) != 3:
            raise argparse.ArgumentTypeError("")
        return tuple(positive_int(p.strip()) for p in parts)  # type: ignore[return-value]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"takes ISL,OSL,N: three integers >= 1 (input length, output "
                                         f"length, requests), e.g. 128,128,3000; got {text!r}") from None


def percentiles(text: str) -> list[float]:
    """--metric-percentiles: comma-separated numbers in (0, 100]."""
    try:
        values = [float(p) for p in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0 < v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"takes comma-separated percentiles in (0, 100], e.g. 50,90,99; got {text!r}")
    return values


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from deepserve.bench import workloads
    from deepserve.entrypoints.cli import DefaultsHelp, add_engine_args

    bench = sub.add_parser("bench", help="benchmarks: throughput (W1/W4), latency (W2), serve (W3, online)")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    tp = kinds.add_parser("throughput", help="W1 (default) or one W4 grid point, offline",
                          formatter_class=DefaultsHelp)
    tp.add_argument("--model", default=None, help="checkpoint folder or preset name (with --load-format dummy)")
    tp.add_argument("--num-seqs", type=positive_int, default=256, help="W1's number of requests")
    tp.add_argument("--max-input-len", type=positive_int, default=1024,
                    help="W1's prompt lengths are drawn from 100 to this (below 100: every prompt this long)")
    tp.add_argument("--max-output-len", type=positive_int, default=1024,
                    help="W1's output lengths are drawn from 100 to this (below 100: every output this long)")
    grid = ", ".join(",".join(map(str, point)) for point in workloads.W4_GRID)
    tp.add_argument("--fixed", type=fixed_shape, default=None, metavar="ISL,OSL,N",
                    help=f"a fixed-shape workload instead of W1; BENCHMARKS.md's W4 grid: {grid}")
    tp.add_argument("--baseline", choices=["hf"], default=None, help="run HF transformers on the same workload")
    tp.add_argument("--baseline-batch-size", type=int, default=64, help="requests per HF generate() batch")
    tp.add_argument("--structured-output", choices=["json"], default=None,
                    help="constrain every request with a JSON schema (structured output's cost on W1); needs "
                         "a tokenizer: a model folder, or --tokenizer PATH with a shape preset")
    tp.add_argument("--output-json", default=None)
    add_engine_args(tp)
    tp.set_defaults(func=cmd_throughput)
    lat = kinds.add_parser("latency", help="W2: one request, TTFT and TPOT",
                           formatter_class=DefaultsHelp)
    lat.add_argument("--model", default=None)
    lat.add_argument("--input-len", type=positive_int, default=1024, help="prompt tokens")
    lat.add_argument("--output-len", type=positive_int, default=512, help="output tokens")
    lat.add_argument("--iters", type=positive_int, default=10, help="timed runs (after three warm-ups)")
    lat.add_argument("--output-json", default=None)
    add_engine_args(lat)
    lat.set_defaults(func=cmd_latency)
    _add_serve_parser(kinds)


# `--max-concurrency` by default: `deepserve serve`'s default --max-waiting-requests (ServerSettings). A server
# answers 503 to requests beyond that many waiting for their first token, so vLLM's default of no limit sent
# 1,000 prompts at once and 743 of them failed against a default server. At most this many in flight never
# overflows its queue, and with --request-rate inf it still measures the server at saturation.
DEFAULT_MAX_CONCURRENCY = 256


def _add_serve_parser(kinds: argparse._SubParsersAction) -> None:
    from deepserve.entrypoints.cli import DefaultsHelp

    sv = kinds.add_parser("serve", help="W3: the online serving benchmark against a running server or router "
                          "(vLLM bench serve's fields)", formatter_class=DefaultsHelp)
    sv.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (a server or a router)")
    sv.add_argument("--endpoint", default="/v1/completions", help="the path requests are streamed from")
    sv.add_argument("--model", required=True, help="the served model name")
    sv.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY, then $DEEPSERVE_API_KEY")
    sv.add_argument("--num-prompts", type=positive_int, default=1000, help="requests to send")
    sv.add_argument("--request-rate", type=float, default=float("inf"),
                    help="requests per second, Poisson arrivals (inf: all at once, up to --max-concurrency)")
    sv.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    sv.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY,
                    help="requests in flight at most, 0 for no limit (vLLM's default); the default is a default "
                         "server's --max-waiting-requests, beyond which it answers 503 (raise both together to "
                         "load a server harder)")
    sv.add_argument("--dataset", choices=["random", "w1"], default="random",
                    help="w1: BENCHMARKS.md's W1 prompts and lengths (token ids < 10,000); random: "
                         "--random-input-len/--random-output-len")
    sv.add_argument("--random-input-len", type=positive_int, default=1024, help="prompt tokens (random dataset)")
    sv.add_argument("--random-output-len", type=positive_int, default=128, help="output tokens (random dataset)")
    sv.add_argument("--random-range-ratio", type=float, default=0.0,
                    help="lengths drawn from [len * (1 - r), len * (1 + r)] (random dataset)")
    sv.add_argument("--random-vocab-size", type=positive_int, default=None,
                    help="prompt token ids below this, at most the served model's vocabulary (the demo model: "
                         "1000, which leaves out its 11 special and marker ids); random draws below it (default: "
                         "10000); w1 keeps BENCHMARKS.md's ids (0..10000) unless it is given, then takes them "
                         "modulo it")
    sv.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (default: exact lengths)")
    sv.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                    help="SLOs for goodput, e.g. ttft:500 tpot:50 (KEY: ttft, tpot, e2el)")
    sv.add_argument("--metric-percentiles", type=percentiles, default="99", help="comma-separated, e.g. 50,90,99")
    sv.add_argument("--seed", type=int, default=0, help="seeds the dataset and the arrival times")
    sv.add_argument("--output-json", default=None)
    sv.set_defaults(func=cmd_serve)


def cmd_serve(ns: argparse.Namespace) -> int:
    from deepserve.bench import serve

    result = serve.main(ns)
    _write(ns.output_json, result)
    return 0 if result["completed"] else 1


def _engine_args(ns: argparse.Namespace):
    from deepserve.entrypoints.cli import engine_args_from

    args = engine_args_from(ns, ns.model)
    # Token-id workloads; a grammar needs the tokenizer's vocabulary, though.
    args.skip_tokenizer_init = not getattr(ns, "structured_output", None)
    return args


def cmd_throughput(ns: argparse.Namespace) -> int:
    from deepserve.bench import throughput, workloads

    if ns.fixed:
        workload = workloads.fixed(*ns.fixed)
    else:
        workload = workloads.w1(ns.num_seqs, ns.max_input_len, ns.max_output_len)
    args = _engine_args(ns)
    if ns.structured_output:
        if args.create_engine_config().model.tokenizer is None:
            raise SystemExit("--structured-output needs a tokenizer: give --tokenizer PATH (the model's own, so "
                             "the masks cover its real vocabulary)")
        workload = workloads.with_json_schema(workload)
    result = throughput.run_throughput(args, workload, PROCESS_START)
    throughput.print_result(result)
    if ns.baseline == "hf":
        from deepserve.bench.hf_baseline import run_hf_baseline

        hf_config = args.create_engine_config().model.hf_config
        # The ids deepserve ran (run_throughput maps them the same way), not ids beyond the embedding.
        base = run_hf_baseline(hf_config, workloads.within_vocab(workload, hf_config.vocab_size),
                               ns.baseline_batch_size)
        result["baseline"] = base
        result["speedup_vs_hf"] = result["output_tokens_per_second"] / base["output_tokens_per_second"]
        print(f"HF transformers: {base['output_tokens_per_second']:.1f} output tokens/s; "
              f"deepserve is {result['speedup_vs_hf']:.2f}x")
    _write(ns.output_json, result)
    return 0


def cmd_latency(ns: argparse.Namespace) -> int:
    from deepserve.bench import latency

    result = latency.run_latency(_engine_args(ns), ns.input_len, ns.output_len, iters=ns.iters)
    latency.print_result(result)
    _write(ns.output_json, result)
    return 0


def _write(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
