"""A rank that dies or freezes ends the engine with an error naming it, within a bounded time; a
tensor_parallel_size that does not fit the model is refused before any process starts; workers
never outlive their engine."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import threading
import time

import pytest

from deepserve import SamplingParams
from deepserve.config import EngineArgs
from deepserve.runner.executor import TensorParallelError
from tests.parallel.conftest import GREEDY, PROMPTS, make_llm, shutdown

LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


def _worker(llm, rank: int):
    return llm.llm_engine.core.runner.workers.procs[rank]


def test_shards_are_split_across_ranks(llama_path):
    llm = make_llm(llama_path, 2)
    try:
        model = llm.llm_engine.core.runner.runner.model
        # q: 4 heads of 16 -> 2 per rank; k and v: 2 kv heads -> 1 per rank
        assert model.model.layers[0].self_attn.qkv_proj.weight.shape == (2 * 16 + 16 + 16, 64)
        assert model.model.layers[0].mlp.down_proj.weight.shape == (64, 48)
    finally:
        shutdown(llm)


def test_killed_worker_between_steps_is_named(llama_path):
    llm = make_llm(llama_path, 2)
    try:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        proc = _worker(llm, 1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        with pytest.raises(TensorParallelError, match=r"rank 1 exited \(exit code -9\)"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        with pytest.raises(TensorParallelError, match="rank 1"):  # the engine stays failed
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        shutdown(llm)


def test_worker_killed_mid_generation_is_named_quickly(llama_path):
    llm = make_llm(llama_path, 2)
    try:
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)  # warm: the kill lands inside the long run
        proc = _worker(llm, 1)
        threading.Timer(0.3, os.kill, (proc.pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1 exited"):
            llm.generate(PROMPTS, LONG, use_tqdm=False)
        assert time.monotonic() - start < 20
    finally:
        shutdown(llm)


def test_frozen_worker_is_named_after_the_timeout(llama_path, monkeypatch):
    monkeypatch.setenv("DEEPSERVE_TP_TIMEOUT_S", "4")
    llm = make_llm(llama_path, 2)
    try:
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        os.kill(_worker(llm, 1).pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank\(s\) \[1\] stopped responding"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 20
    finally:
        shutdown(llm)  # SIGKILL ends a stopped process too


def test_workers_exit_when_the_llm_is_collected(llama_path):
    llm = make_llm(llama_path, 2)
    proc = _worker(llm, 1)
    del llm
    gc.collect()
    proc.join(60)  # returns at the exit; the bound only stops a hang (10 s failed once on a loaded machine)
    assert proc.exitcode == 0  # a clean exit on the stop signal, not a kill


@pytest.mark.parametrize(("field", "overrides", "fits"), [
    ("num_attention_heads", dict(num_attention_heads=6, num_key_value_heads=6), "1, 2, 3, 6"),
    ("num_key_value_heads", dict(num_attention_heads=6, num_key_value_heads=3, intermediate_size=96), "1, 3, 6"),
    ("intermediate_size", dict(intermediate_size=98), "1, 2"),
])
def test_non_dividing_tp_is_refused_naming_the_field(llama_path, field, overrides, fits):
    tp = 4 if field != "num_key_value_heads" else 2
    args = EngineArgs(model=llama_path, device="cpu", tensor_parallel_size=tp, hf_overrides=overrides)
    pattern = rf"{field} \(\d+\) is .*tensor_parallel_size \({tp}\).*Sizes that fit: {fits}$"
    with pytest.raises(ValueError, match=pattern):
        args.create_engine_config()


def test_moe_intermediate_size_is_checked():
    from types import SimpleNamespace

    from deepserve.distributed.layout import tp_problems

    cfg = SimpleNamespace(num_attention_heads=8, intermediate_size=64, moe_intermediate_size=12, n_routed_experts=4)
    assert tp_problems(cfg, 8) == ["moe_intermediate_size (12) is not divisible by tensor_parallel_size (8)"]
    assert tp_problems(cfg, 4) == []


def test_unsupported_pipeline_parallel_is_refused_clearly(llama_path):
    from deepserve import LLM
    from deepserve.config import ParallelConfig

    with pytest.raises(ValueError, match="pipeline_parallel_size must be >= 1"):
        ParallelConfig(pipeline_parallel_size=0)
    # 2 layers cannot make 3 stages: refused before any process starts, naming the field.
    with pytest.raises(ValueError, match=r"num_hidden_layers \(2\) is less than pipeline_parallel_size \(3\)"):
        LLM(llama_path, device="cpu", pipeline_parallel_size=3)


@pytest.mark.parametrize("error", [FileNotFoundError("no *.safetensors weights in /m"), RuntimeError("a bug")])
def test_a_rank_that_fails_prints_one_line_for_a_refusal_and_a_traceback_otherwise(monkeypatch, capsys, error):
    # Rank 0 reads the same input and reports a refusal in one line; a traceback from every other rank would
    # bury it. Anything else may be a bug: its traceback stays.
    from deepserve.errors import ConfigRefused, FilesMissing
    from deepserve.runner import worker

    if isinstance(error, FileNotFoundError):
        error = FilesMissing(str(error))

    def fail(*args):
        raise error

    def leave(code):
        raise SystemExit(code)

    monkeypatch.setattr(worker, "worker_main", fail)
    monkeypatch.setattr(worker, "leave_now", leave)
    slot = worker.error_slot(multiprocessing.get_context("spawn"))
    with pytest.raises(SystemExit) as left:
        worker.worker_process(1, 2, 0, "gloo", 30.0, None, None, None, None, error=slot)
    assert left.value.code == 1
    err = capsys.readouterr().err
    if isinstance(error, ConfigRefused):  # one line: which rank, and the refusal's own words
        assert err.count("\n") == 1 and err.endswith(f"{error}\n") and "rank 1" in err, err
        assert worker.read_error(slot) == str(error)
    else:
        assert "Traceback" in err and err.endswith("RuntimeError: a bug\n")
        assert worker.read_error(slot) == "RuntimeError: a bug"  # the line rank 0's error ends with


def _rank_failing_to_load(*args, error=None):
    """A rank (started in place of worker.worker_process) whose model fails to build after it joined."""
    from deepserve.runner import model_runner, worker

    def fail(config):
        raise OSError("could not read model.layers.1.mlp.down_proj.weight: Input/output error")

    model_runner.ModelRunner = fail
    worker.worker_process(*args, error=error)


def test_a_rank_that_fails_loading_is_named_with_its_own_error(llama_path, monkeypatch):
    # Rank 0's error used to end "...while loading the model; its error, if any, is in this process's stderr",
    # below two tracebacks: the line that said what failed was rank 1's, far above.
    from deepserve.runner import executor

    real = executor.start_rank
    monkeypatch.setattr(executor, "start_rank",
                        lambda ctx, target, *rest: real(ctx, f"{__name__}._rank_failing_to_load", *rest))
    with pytest.raises(TensorParallelError) as failed:
        make_llm(llama_path, 2)
    assert str(failed.value) == (
        "tensor-parallel rank 1 exited (exit code 1) while loading the model: OSError: could not read "
        "model.layers.1.mlp.down_proj.weight: Input/output error. The engine cannot continue: restart it")


UNGUARDED = """\
from deepserve import LLM

llm = LLM({path!r}, device="cpu", dtype="float32", tensor_parallel_size=2, num_gpu_blocks_override=64)
print("loaded")
"""


# The default start method only: spawn re-imports the main script through the same multiprocessing step
# (prepare()) that start_rank checks, and each run is a 10 s subprocess of the whole suite's time.
@pytest.mark.parametrize("method", ["forkserver"])
def test_a_script_without_a_main_guard_is_named_at_once(llama_path, tmp_path, method):
    # Ranks start by importing the main script again (spawn and forkserver alike): without the guard it starts
    # ranks of its own there, which Python refuses, and the rank dies before joining. Rank 0 used to wait for it
    # until the join timed out (2 minutes and more) with torch's "1/2 clients joined".
    import subprocess
    import sys

    from tests.server.serverkit import ROOT

    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED.format(path=llama_path))
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DEEPSERVE_TP_TIMEOUT_S": "300",
           "DEEPSERVE_RANK_START_METHOD": method}
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=90)
    assert time.monotonic() - start < 90
    assert done.returncode != 0 and "loaded" not in done.stdout
    # The error's own line (the resource tracker may warn after it about the ranks' semaphores).
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("deepserve.runner.executor.TensorParallelError")]
    assert "tensor-parallel rank 1 exited (exit code" in line and 'if __name__ == "__main__":' in line, done.stderr
    assert "bootstrapping phase" not in done.stderr  # Python's own 20 lines, which never said what to change
