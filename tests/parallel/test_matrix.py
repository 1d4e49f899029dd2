"""The parallelism matrix of issue 6: tiny Llama (GQA), Qwen2, DeepSeek-V2 and DeepSeek-V3 checkpoints
under TP=2, TP=4, PP=2 and TP=2 x PP=2 give the same greedy tokens as one process, on CPU with gloo.

Through `LLM(...)`: the full 4 x 4 grid. Through a real `deepserve serve`: a diagonal that covers
every model and every layout once (llama x TP=4, qwen2 x PP=2, deepseek_v2 x TP=2xPP=2,
deepseek_v3 x TP=2), to keep the file within its CI time budget.

Each checkpoint and its single-process reference is built once per module. Every engine is shut
down before its test returns, and each test checks that the processes it started are gone.
"""

from __future__ import annotations

import gc
import os

import httpx
import pytest

from deepserve import SamplingParams
from tests.conftest import save_checkpoint
from tests.models.test_deepseek import VARIANTS, make_hf_model
from tests.parallel.conftest import PROMPTS, make_llm, shutdown
from tests.parallel.test_tp_serve import _alive, _descendants
from tests.server.serverkit import ADMIN, Server, auth, wait_until

# Every config lets TP=4 divide what it must: llama/qwen2 (conftest.DENSE) have 4 heads, 2 kv heads
# (replicated under TP=4), intermediate 96 and 2 layers; DeepSeek (tests/models COMMON) 4 heads,
# intermediate 96, moe_intermediate 32, 8 routed experts and 3 layers (an uneven 1 + 2 PP split).
DEEPSEEK = {"deepseek_v2": "v2-group-limited-qlora-yarn", "deepseek_v3": "v3-noaux-qlora-yarn"}
MODELS = ["llama", "qwen2", "deepseek_v2", "deepseek_v3"]
LAYOUTS = {"tp2": (2, 1), "tp4": (4, 1), "pp2": (1, 2), "tp2xpp2": (2, 2)}
SERVE_DIAGONAL = [("llama", "tp4"), ("qwen2", "pp2"), ("deepseek_v2", "tp2xpp2"), ("deepseek_v3", "tp2")]
MAX_TOKENS = 8
GREEDY8 = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SERVE_PROMPT = [11, 250, 3, 499, 42, 7, 7, 120, 64]  # token ids, all < every model's vocab

# Cells known to fail: {(model, layout): reason}. Marked xfail(strict=True), so a fix shows up too.
KNOWN_FAILURES: dict[tuple[str, str], str] = {}


def _cell(model: str, layout: str):
    reason = KNOWN_FAILURES.get((model, layout))
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(model, layout, id=f"{model}-{layout}", marks=marks)


class Matrix:
    """Checkpoints and single-process references, built on first use and kept for the module."""

    def __init__(self, tmp_path_factory, tokenizer, llama_path: str, qwen2_path: str) -> None:
        self.tmp, self.tokenizer = tmp_path_factory, tokenizer
        self.paths = {"llama": llama_path, "qwen2": qwen2_path}
        self.refs: dict[str, tuple[list[list[int]], list[int], str]] = {}

    def path(self, model: str) -> str:
        if model not in self.paths:
            hf = make_hf_model(*VARIANTS[DEEPSEEK[model]])
            self.paths[model] = save_checkpoint(hf, self.tokenizer, str(self.tmp.mktemp(model)))
        return self.paths[model]

    def reference(self, model: str) -> tuple[list[list[int]], list[int], str]:
        """One process: greedy tokens of PROMPTS, and the tokens and text of SERVE_PROMPT."""
        if model not in self.refs:
            self.refs[model] = _generate(self.path(model), 1, 1)
        return self.refs[model]


def _generate(path: str, tp: int, pp: int) -> tuple[list[list[int]], list[int], str]:
    llm = make_llm(path, tp, pipeline_parallel_size=pp)
    try:
        prompts = [{"prompt_token_ids": p} for p in [*PROMPTS, SERVE_PROMPT]]
        outs = [o.outputs[0] for o in llm.generate(prompts, GREEDY8, use_tqdm=False)]
        return [list(o.token_ids) for o in outs[:-1]], list(outs[-1].token_ids), outs[-1].text
    finally:
        shutdown(llm)
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, tokenizer, llama_path, qwen2_path) -> Matrix:
    return Matrix(tmp_path_factory, tokenizer, llama_path, qwen2_path)


@pytest.fixture(autouse=True)
def _no_leftover_processes(monkeypatch):
    """A hung cell fails within a bounded time, and no process a test started outlives it."""
    monkeypatch.setenv("DEEPSERVE_TP_TIMEOUT_S", "60")
    before = _descendants(os.getpid())
    yield
    # multiprocessing's resource tracker and the ranks' fork server (runner/rank_start.py) are started once
    # per pytest process and live on by design; the ranks forked from that server are checked.
    started = {p for p in _descendants(os.getpid()) - before if not _lives_on_by_design(p)}
    assert wait_until(lambda: not any(_alive(p) for p in started), timeout=20), {p: _cmdline(p) for p in started}


def _lives_on_by_design(pid: int) -> bool:
    if "resource_tracker" in _cmdline(pid):
        return True
    return "multiprocessing.forkserver" in _cmdline(pid) and _parent(pid) == os.getpid()  # not its forks


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.parametrize(("model", "layout"), [_cell(m, lay) for m in MODELS for lay in LAYOUTS])
def test_llm_matches_single_process(matrix, model, layout):
    tp, pp = LAYOUTS[layout]
    want, _, _ = matrix.reference(model)
    got, _, _ = _generate(matrix.path(model), tp, pp)
    assert all(len(t) == MAX_TOKENS for t in want)
    assert got == want


@pytest.mark.parametrize(("model", "layout"), [_cell(m, lay) for m, lay in SERVE_DIAGONAL])
def test_serve_matches_single_process(matrix, model, layout, tmp_path):
    tp, pp = LAYOUTS[layout]
    path = matrix.path(model)
    _, want_ids, want_text = matrix.reference(model)
    server = Server([path, "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
                     "--dtype", "float32", "--device", "cpu", "--max-model-len", "256"], str(tmp_path))
    try:
        server.wait_ready()
        body = {"model": path, "prompt": SERVE_PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=auth(ADMIN), timeout=60)
        procs = _descendants(server.proc.pid)
    finally:
        code = server.stop()
    assert code == 0, server.tail()
    assert r.status_code == 200, r.text
    assert len(procs) >= tp * pp, procs  # the engine child and its tp * pp - 1 workers
    assert wait_until(lambda: not any(_alive(p) for p in procs), timeout=20), server.tail()
    out = r.json()
    assert out["usage"]["completion_tokens"] == len(want_ids) == MAX_TOKENS
    assert want_text  # the text comparison below has something to compare
    assert out["choices"][0]["text"] == want_text
