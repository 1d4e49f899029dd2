"""`deepserve serve --tensor-parallel-size 2`: the engine child process spawns the workers; greedy
completions equal one process's, and stopping the server leaves no process behind."""

from __future__ import annotations

import httpx

from tests.parallel.conftest import make_llm, shutdown
from tests.server.serverkit import ADMIN, Server, auth, wait_until

PROMPT = "the quick brown fox"


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        found.update(kids)
        todo.extend(kids)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def _offline_text(path: str) -> str:
    from deepserve import SamplingParams

    llm = make_llm(path, 1)
    try:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        return out[0].outputs[0].text
    finally:
        shutdown(llm)


def complete(server: Server, model: str, prompt: str) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=auth(ADMIN), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_serve_tp2_matches_tp1_and_leaves_no_workers(llama_path, tmp_path):
    server = Server([llama_path, "--tensor-parallel-size", "2", "--dtype", "float32", "--device", "cpu",
                     "--max-model-len", "256"],
                    str(tmp_path))
    try:
        server.wait_ready()
        text = complete(server, llama_path, PROMPT)
        procs = _descendants(server.proc.pid)
        assert len(procs) >= 2, procs  # the engine child and its tensor-parallel worker
    finally:
        code = server.stop()
    assert code == 0, server.tail()
    assert wait_until(lambda: not any(_alive(p) for p in procs), timeout=20), server.tail()
    assert text == _offline_text(llama_path)


def test_serve_tp2_without_weights_is_refused_without_a_traceback(llama_path, tmp_path):
    # Every rank finds the weights missing: rank 0's one line reaches the log, and rank 1 says so in one line
    # too instead of printing its traceback.
    import shutil

    folder = tmp_path / "no-weights"
    shutil.copytree(llama_path, folder, ignore=shutil.ignore_patterns("*.safetensors*"))
    server = Server([str(folder), "--tensor-parallel-size", "2", "--dtype", "float32", "--device", "cpu",
                     "--max-model-len", "256"], str(tmp_path))
    try:
        server.proc.wait(timeout=120)
    finally:
        code = server.stop()
    with open(server.log_path) as f:
        log = f.read()
    assert code == 1, log
    assert "Traceback" not in log, log
    assert f"deepserve rank 1 refused to start: no *.safetensors weights in {folder}" in log, log
    assert f"engine core refused to start: no *.safetensors weights in {folder}" in log, log
