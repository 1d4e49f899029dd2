"""`deepserve bench`: W1 is BENCHMARKS.md's workload token for token, the commands run end to end on a
shrunken preset on the CPU and report vLLM's field names, and the energy meter reads the GPUs CUDA sees."""

from __future__ import annotations

import json
import sys
import types

import pytest

from deepserve.bench import gpu_stats, workloads
from deepserve.entrypoints.cli import main

# DeepSeek-LLM-7B's preset cut down to one narrow layer (its 102,400-token vocabulary kept, so W1's ids fit).
TINY_7B = ["--model", "deepseek-llm-7b", "--load-format", "dummy", "--device", "cpu", "--dtype", "float32",
           "--max-model-len", "512", "--hf-overrides",
           '{"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, '
           '"num_key_value_heads": 4}']


def test_w1_has_the_token_totals_of_benchmarks_md():
    w = workloads.w1()
    assert (len(w.prompts), w.num_prompt_tokens, w.num_output_tokens) == (256, 142_827, 133_966)
    assert all(p.temperature == 0.6 and p.ignore_eos for p in w.params)


def test_w1_shrinks_below_its_100_token_floor():
    w = workloads.w1(5, 64, 16)  # a CPU-sized W1: every length is the maximum asked for
    assert [len(p) for p in w.prompts] == [64] * 5 and [p.max_tokens for p in w.params] == [16] * 5


SERVE = ["serve", "--base-url", "http://127.0.0.1:9", "--model", "m"]


@pytest.mark.parametrize(("argv", "flag"), [
    (["throughput", "--fixed", "32,4"], "--fixed"),
    (["throughput", "--fixed", "a,b,c"], "--fixed"),
    (["throughput", "--num-seqs", "0"], "--num-seqs"),
    (["throughput", "--max-input-len", "-1"], "--max-input-len"),
    (["latency", "--input-len", "0"], "--input-len"),
    (["latency", "--output-len", "0"], "--output-len"),
    (["latency", "--iters", "0"], "--iters"),
    ([*SERVE, "--num-prompts", "0"], "--num-prompts"),
    ([*SERVE, "--random-vocab-size", "0"], "--random-vocab-size"),
    ([*SERVE, "--metric-percentiles", "50,x"], "--metric-percentiles"),
])
def test_bench_refuses_bad_shapes_naming_the_flag(argv, flag, capsys):
    # Refused while parsing, before any engine starts (they used to fail inside the run as
    # "not enough values to unpack", "empty range for randrange()", "no median for empty data" or
    # "could not convert string to float", or ran an empty benchmark).
    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv])
    assert exc.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_bench_throughput_runs_and_reports_vllm_fields(tmp_path, capsys):
    out = tmp_path / "w1.json"
    rc = main(["bench", "throughput", *TINY_7B, "--fixed", "40,12,3", "--output-json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    expected = workloads.fixed(40, 12, 3)
    assert result["num_requests"] == 3 and result["workload"] == "fixed-40-12"
    assert result["num_output_tokens"] == expected.num_output_tokens  # every request ran to its max_tokens
    assert result["num_prompt_tokens"] == expected.num_prompt_tokens
    for key in ("elapsed_time", "requests_per_second", "tokens_per_second", "output_tokens_per_second",
                "time_to_ready_s"):
        assert result[key] > 0, key
    assert result["tensor_parallel_size"] == 1
    assert "Throughput:" in capsys.readouterr().out


def test_bench_latency_reports_ttft_and_tpot(tmp_path, capsys):
    out = tmp_path / "w2.json"
    rc = main(["bench", "latency", *TINY_7B, "--input-len", "32", "--output-len", "6", "--iters", "2",
               "--output-json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert 0 < result["ttft_ms_median"] and 0 < result["tpot_ms_median"] <= result["tpot_ms_p99"]
    assert result["input_len"] == 32 and result["output_len"] == 6
    # The share is of the H200's HBM bandwidth: on the CPU it is not given, as with speculation (it read 0 %).
    assert result["device"] == "cpu" and result["bandwidth_utilization"] is None
    assert "bandwidth n/a (cpu)" in capsys.readouterr().out


def test_energy_meter_sums_the_visible_gpus_by_their_nvml_numbers(monkeypatch):
    counters = {0: 1_000, 1: 5_000, 2: 9_000, 3: 20_000}  # millijoules, by NVML (host) index
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetHandleByUUID=lambda uuid: {"GPU-b": 3}[uuid],
        nvmlDeviceGetTotalEnergyConsumption=lambda h: counters[h],
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-b,0")
    meter = gpu_stats.EnergyMeter(num_gpus=2)
    meter.start()
    counters[2] += 3_000
    counters[3] += 500
    counters[0] += 70_000  # visible, but not one of the engine's two GPUs
    assert meter.stop() == 3.5


def test_bench_throughput_with_a_json_schema_on_every_request(tmp_path):
    import pytest

    from deepserve.demo import ensure_demo_model

    with pytest.raises(SystemExit, match="--tokenizer"):
        main(["bench", "throughput", *TINY_7B, "--fixed", "40,12,3", "--structured-output", "json"])
    out = tmp_path / "w1json.json"
    rc = main(["bench", "throughput", *TINY_7B, "--fixed", "40,12,3", "--structured-output", "json",
               "--tokenizer", ensure_demo_model(), "--output-json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["workload"] == "fixed-40-12+json" and 0 < result["num_output_tokens"] <= 36
    # Where a constrained run's host time goes: every step that sampled a constrained row built masks.
    grammar = result["grammar_host_ms"]
    assert 0 < grammar["steps"] <= result["engine_steps"] and grammar["fill"] > 0 and grammar["feed"] >= 0
    assert len(result["output_lengths"]) == 3 and sum(result["output_lengths"]) == result["num_output_tokens"]


def test_bench_latency_reports_speculative_acceptance(tmp_path, capsys):
    out = tmp_path / "w2-spec.json"
    rc = main(["bench", "latency", *TINY_7B, "--input-len", "32", "--output-len", "6", "--iters", "2",
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}', "--output-json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    spec = result["speculative"]
    assert result["bandwidth_utilization"] is None  # a step's bytes serve several tokens: no share given
    assert (spec["method"], spec["num_speculative_tokens"]) == ("ngram", 2)
    assert 0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"] <= 2 * spec["num_drafts"]
    assert "acceptance rate" in capsys.readouterr().out


def test_same_lengths_workload_is_the_constrained_runs_work_unconstrained():
    from deepserve.bench import workloads
    from deepserve.sampling_params import StructuredOutputsParams

    base = workloads.fixed(10, 20, 3)  # 3 requests of 10 prompt tokens
    constrained = workloads.with_json_schema(base)
    same = workloads.with_output_lengths(constrained, [4, 1, 20])
    assert [(p.max_tokens, p.ignore_eos, p.structured_outputs) for p in same.params] == [
        (4, True, None), (1, True, None), (20, True, None)]
    assert same.prompts == base.prompts and same.exact_output and same.num_output_tokens == 25
    assert isinstance(constrained.params[0].structured_outputs, StructuredOutputsParams)  # left as it was
    for bad in ([4, 1], [4, 0, 2]):
        with pytest.raises(ValueError, match="at least one token"):
            workloads.with_output_lengths(base, bad)


def test_bandwidth_share_survives_a_zero_median_gap():
    # An H200 run with n-gram k=4 on a repeated prompt accepted most drafts: most gaps between tokens were 0
    # (a step hands out several), the median gap was 0 and W2 failed dividing by it. No figure then (and
    # none under speculation at all: test_bench_latency_reports_speculative_acceptance).
    from deepserve.bench.latency import HBM_BYTES_PER_S, bandwidth_utilization

    assert bandwidth_utilization(HBM_BYTES_PER_S * 2e-3, 4e-3) == pytest.approx(0.5)
    assert bandwidth_utilization(HBM_BYTES_PER_S, 0.0) is None


def test_bench_runs_on_the_demo_models_small_vocabulary(tmp_path):
    # The README's default model has 1,011 tokens; the workloads draw ids up to 10,000 (BENCHMARKS.md), so
    # the commands take them modulo the vocabulary (a new-user trial found both commands refused here).
    small = ["--device", "cpu", "--dtype", "float32"]
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", *small, "--fixed", "32,4,3", "--output-json", str(out)]) == 0
    assert json.loads(out.read_text())["num_output_tokens"] == 12
    assert main(["bench", "latency", *small, "--input-len", "32", "--output-len", "4", "--iters", "1",
                 "--output-json", str(out)]) == 0
    assert json.loads(out.read_text())["input_len"] == 32


def test_within_vocab_keeps_lengths_and_leaves_large_vocabularies_alone():
    w = workloads.w1(8)
    small = workloads.within_vocab(w, 1011)
    assert [len(p) for p in small.prompts] == [len(p) for p in w.prompts] and small.params is w.params
    assert max(max(p) for p in small.prompts) < 1011 and max(max(p) for p in w.prompts) >= 1011
    assert workloads.within_vocab(w, 102_400) is w
    # W1 draws ids up to 10,000 inclusive: a vocabulary of 10,001 holds them all, one of 10,000 does not.
    full = workloads.w1()
    assert max(max(p) for p in full.prompts) == 10_000
    assert workloads.within_vocab(full, 10_001) is full
    assert workloads.within_vocab(full, 10_000).prompts != full.prompts


def test_bench_serve_names_the_flag_when_prompt_ids_exceed_the_servers_vocabulary(capsys):
    from deepserve.bench import serve

    outcome = serve.Outcome(input_len=4, error="HTTP 400: prompt token id 6311 is outside the vocabulary [0, 1011)")
    serve.print_result(serve.summarize([outcome], 1.0, {}, [99.0]), [99.0])
    assert "--random-vocab-size" in capsys.readouterr().out
    prompts = serve.build_dataset("w1", 4, 0, 0, 0.0, 1000, 0)
    assert max(max(p.token_ids) for p in prompts) < 1000  # w1's ids taken modulo the given vocabulary
    # Without --random-vocab-size, bench serve's W1 is BENCHMARKS.md's, id for id.
    exact = serve.build_dataset("w1", 256, 0, 0, 0.0, None, 0)
    assert [p.token_ids for p in exact] == workloads.w1().prompts


def test_bench_serve_names_the_api_key_flag_on_401_and_takes_a_base_url_ending_in_v1(capsys):
    from deepserve.bench import serve

    outcome = serve.Outcome(input_len=4, error='HTTP 401: {"error": {"message": "missing or malformed key"}}')
    serve.print_result(serve.summarize([outcome], 1.0, {}, [99.0]), [99.0])
    out = capsys.readouterr().out
    assert "--api-key" in out and out.startswith("no request completed (1 failed)") and "Mean TTFT" not in out
    wrong = serve.Outcome(input_len=4, error='HTTP 401: {"error": {"message": "invalid API key"}}')
    serve.print_result(serve.summarize([wrong], 1.0, {}, [99.0]), [99.0])
    assert "the server refused the key" in capsys.readouterr().out
    assert serve.join_url("http://h:8000/v1", "/completions") == "http://h:8000/v1/completions"
    # The openai client's form of the address (…/v1) and the server's root give the same URL.
    assert serve.join_url("http://h:8000/v1/", "/v1/completions") == "http://h:8000/v1/completions"
    assert serve.join_url("http://h:8000", "/v1/completions") == "http://h:8000/v1/completions"
    assert serve.join_url("http://h:8000/proxy/", "/v1/chat/completions") == "http://h:8000/proxy/v1/chat/completions"


def test_w4_grid_reports_peak_batch_and_kv_usage_and_the_scaling_ratio():
    # bench/w4_grid.py (BENCHMARKS.md's W4): one engine runs the grid's shapes; each row carries the run's
    # own peak batch and KV usage (the scheduler's highs, reset at the start of each run).
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "w4_grid.py"
    spec = importlib.util.spec_from_file_location("w4_grid", path)
    w4 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(w4)
    rows = w4.run_engine("demo", 3, smoke=True)
    assert [(r["input_len"], r["output_len"], r["num_requests"]) for r in rows] == w4.SMOKE_GRID
    assert all(r["peak_batch"] == 3 and 0 < r["peak_kv_cache_usage"] < 1 for r in rows)  # 6 and 4 queued at once
    doubled = [{**r, "max_num_seqs": 6, "output_tokens_per_second": 2 * r["output_tokens_per_second"]} for r in rows]
    lines = w4.table("demo", rows + doubled)
    assert lines[-2:] == ["scaling 16/8: max_num_seqs 6 / 3 = 2.00x", "scaling 32/16: max_num_seqs 6 / 3 = 2.00x"]
    assert w4.pick_shapes("32/16", smoke=True) == [(32, 16, 4)]  # --shapes: a subset, in the grid's order
    assert w4.pick_shapes("2048/128,128/128", smoke=False) == [(128, 128, 3000), (2048, 128, 1000)]
    with pytest.raises(ValueError, match="1/1 not in the grid"):
        w4.pick_shapes("1/1", smoke=True)


def test_check_spec_decode_tells_a_near_tie_from_a_fault():
    # An H200 run flagged verify k=2's first token 26825 against the decode step's 3434, where the decode
    # step's top-2 were [[26825, -9.8676], [3434, -9.8676]]: an exact tie, not a fault.
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "check_spec_decode.py"
    spec = importlib.util.spec_from_file_location("check_spec_decode", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    assert check.near_tie([[26825, -9.8676], [3434, -9.8676]], 26825)
    assert check.near_tie([[5, -1.0], [7, -1.01]], 7)
    assert not check.near_tie([[5, -1.0], [7, -1.5]], 7)  # a real margin: a fault
    assert not check.near_tie([[5, -1.0], [7, -1.0]], 9)  # not among the reference's top-2
    assert not check.near_tie([], 5)
    # ...and only when the runs agree elsewhere: the verify step's own logprob for its token is 0.016 from
    # the decode step's (a tie flipped by rounding); a wrong row would move it more.
    drift = check.step_drift([[26825, -9.8676], [3434, -9.8676]], [[26825, -9.8517], [86657, -9.8829]])
    assert abs(drift - 0.0159) < 1e-6 and check.is_near_tie([[26825, -9.8676], [3434, -9.8676]], 26825, drift)
    assert not check.is_near_tie([[26825, -9.8676], [3434, -9.8676]], 26825, 0.3)
    assert not check.is_near_tie([[26825, -9.8676], [3434, -9.8676]], 26825, None)  # nothing to compare
    assert check.logprob_drift([-1.0, -2.0, -3.0], [-1.01, -2.2, -9.0], 2) == pytest.approx(0.2)  # before the split
    assert check.logprob_drift([], [], None) is None


def test_api_host_cost_times_every_phase_of_the_serving_path():
    # bench/api_host_cost.py: the per-step host time of the engine core's packing and the API server's
    # unpacking, detokenizing and SSE encoding, for a batch of streams (the demo tokenizer, CPU).
    import importlib.util
    from pathlib import Path

    from deepserve.config import EngineArgs
    from deepserve.loader.tokenizer import load_tokenizer

    path = Path(__file__).resolve().parents[1] / "bench" / "api_host_cost.py"
    spec = importlib.util.spec_from_file_location("api_host_cost", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.measure(load_tokenizer(EngineArgs().model_path()), batch=8, steps=4, prompt_len=20)
    assert set(result) == {"core", "core (asdict)", "api decode", "output processor", "deltas + SSE"}
    assert all(ms > 0 for ms in result.values())


def test_stream_silences_finds_the_stretch_every_stream_shares():
    # bench/stream_silences.py: two streams sent at t = 0; neither gets a chunk between 1.05 and 1.4 s (a
    # server-wide stall), and one stream's own 0.3 s gap is covered by the other stream's chunks. A
    # third request failed (no chunks, ttft 0): it must not put an arrival at 0 s.
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "stream_silences.py"
    spec = importlib.util.spec_from_file_location("stream_silences", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    result = {"ttfts": [0.5, 0.55, 0.0], "itls": [[0.1] * 5 + [0.4, 0.1], [0.3, 0.1, 0.1, 0.5], []],
              "errors": ["", "", "HTTP 500"]}
    times, decode_from = mod.arrival_times(result)
    assert len(times) == 2 + 7 + 4 and times == sorted(times) and times[0] == pytest.approx(0.5)
    assert decode_from == pytest.approx(0.55)
    found = mod.silences(times, 0.15)
    assert len(found) == 1
    start, length = found[0]
    assert start == pytest.approx(1.05) and length == pytest.approx(0.35)


def test_core_send_stall_runs_both_modes():
    # bench/core_send_stall.py: the stand-in core serves over a real socket in each send mode and the
    # figures come back (their values are timings: bench/RESULTS.md has the run; tests/server/
    # test_core_process.py proves the sender thread's behaviour without timing).
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "core_send_stall.py"
    spec = importlib.util.spec_from_file_location("core_send_stall", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    import os

    before = os.environ.get("DEEPSERVE_CORE_SEND_THREAD")
    for mode in ("0", "1"):
        gap, during = mod.run(mode, step_s=0.001, outputs=8, pause_s=0.02, steps=40)
        assert 0 < gap < 5 and 0 <= during <= 40
    assert os.environ.get("DEEPSERVE_CORE_SEND_THREAD") == before  # the switch is not left set for later tests


def _bench_module(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_core_host_cost_times_decode_steps_of_the_whole_batch():
    # bench/core_host_cost.py: once every request decodes, each step hands every request one token.
    ms, tokens = _bench_module("core_host_cost").measure(batch=8, prompt=40, steps=10)
    assert ms > 0 and tokens == 8


def test_check_grammar_overlap_passes_and_restores_the_switch(monkeypatch, capsys):
    # bench/check_grammar_overlap.py (the gate's switches suite): the demo model off and on, on this CPU.
    import os

    monkeypatch.setenv("DEEPSERVE_GRAMMAR_OVERLAP", "0")
    assert _bench_module("check_grammar_overlap").main() == 0
    out = capsys.readouterr().out
    assert "48/48 outputs equal" in out and "0 invalid constrained outputs" in out and "PASS" in out
    assert os.environ["DEEPSERVE_GRAMMAR_OVERLAP"] == "0"


def test_check_grammar_overlap_help_prints_usage_without_running_the_check():
    # `--help` used to run the whole check (two engines) and print its result instead of the usage.
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "check_grammar_overlap.py"
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stdout + done.stderr[-2000:]
    assert "DEEPSERVE_GRAMMAR_OVERLAP" in done.stdout and "outputs equal" not in done.stdout
    done = subprocess.run([sys.executable, str(script), "--no-such-flag"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "--no-such-flag" in done.stderr


def test_bench_serve_defaults_stay_within_a_default_servers_queue(capsys):
    """`deepserve bench serve` with its defaults against a stand-in server that admits as `deepserve serve`
    does by default (server/ratelimit.py's WaitQueue at ServerSettings' max_waiting_requests, 503 "server
    overloaded" beyond it): every request completes. With vLLM's default of no concurrency limit, 300
    prompts at once overflowed the 256 places and 44 failed."""
    import asyncio
    import threading

    from aiohttp import web

    from deepserve.bench import serve
    from deepserve.entrypoints.cli import build_parser
    from deepserve.server.errors import APIError
    from deepserve.server.ratelimit import WaitQueue
    from deepserve.server.settings import ServerSettings

    queue = WaitQueue(ServerSettings().max_waiting_requests, ServerSettings().max_waiting_tokens)
    most = [0]

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        try:
            queue.enter(len(body["prompt"]))
        except APIError as e:
            return web.json_response(e.body(), status=e.status)
        most[0] = max(most[0], queue.requests)
        await asyncio.sleep(0.3)  # the first token comes later: requests overlap in the queue
        queue.leave(len(body["prompt"]))
        r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        for chunk in ({"choices": [{"text": "x"}]}, {"choices": [], "usage": {"completion_tokens": 1}}):
            await r.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await r.write(b"data: [DONE]\n\n")
        return r

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        ns = build_parser().parse_args(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "m",
                                        "--num-prompts", "300", "--random-input-len", "4", "--random-output-len", "1"])
        result = serve.main(ns)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
    assert (result["completed"], result["failed"]) == (300, 0), result["errors"][:3]
    assert most[0] == ServerSettings().max_waiting_requests == ns.max_concurrency  # saturated, never over
    assert "Failed requests:" in capsys.readouterr().out


def test_bench_serve_names_the_flags_when_the_server_is_overloaded(capsys):
    from deepserve.bench import serve

    body = '{"error": {"message": "server overloaded: 256 requests (262144 prompt tokens) are already waiting; ' \
           'retry shortly", "type": "server_error", "code": "overloaded"}}'
    outcomes = [serve.Outcome(input_len=4, ok=True, output_len=2, ttft=0.1, latency=0.2),
                serve.Outcome(input_len=4, error=f"HTTP 503: {body}")]
    serve.print_result(serve.summarize(outcomes, 1.0, {}, [99.0]), [99.0])
    out = capsys.readouterr().out
    hints = [line for line in out.splitlines() if line.startswith("hint:")]
    assert len(hints) == 1 and "--max-concurrency" in hints[0] and "--max-waiting-requests" in hints[0]
