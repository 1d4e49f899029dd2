"""`deepserve bench`: W1 is BENCHMARKS.md's workload token for token, the commands run end to end on a
shrunken preset on the CPU and report vLLM's field names, and the energy meter reads the GPUs CUDA sees."""

from __future__ import annotations

import json
import sys
import types

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


def test_bench_latency_reports_ttft_and_tpot(tmp_path):
    out = tmp_path / "w2.json"
    rc = main(["bench", "latency", *TINY_7B, "--input-len", "32", "--output-len", "6", "--iters", "2",
               "--output-json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert 0 < result["ttft_ms_median"] and 0 < result["tpot_ms_median"] <= result["tpot_ms_p99"]
    assert result["input_len"] == 32 and result["output_len"] == 6


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


def test_bench_latency_reports_speculative_acceptance(tmp_path, capsys):
    out = tmp_path / "w2-spec.json"
    rc = main(["bench", "latency", *TINY_7B, "--input-len", "32", "--output-len", "6", "--iters", "2",
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}', "--output-json", str(out)])
    assert rc == 0
    spec = json.loads(out.read_text())["speculative"]
    assert (spec["method"], spec["num_speculative_tokens"]) == ("ngram", 2)
    assert 0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"] <= 2 * spec["num_drafts"]
    assert "acceptance rate" in capsys.readouterr().out
