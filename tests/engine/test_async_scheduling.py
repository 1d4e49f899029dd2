"""Async scheduling: step n+1 is scheduled and launched before step n's tokens reach the host.

Two levels. With a scripted runner (no model) we check the order of calls — step n+1 launched before
step n is waited for — and that requests ending on EOS, stop tokens and length, preemption with a
token in flight, and aborts give exactly the tokens of the one-step-at-a-time engine. On the demo
model (CPU) the offline API gives the same outputs both ways for sampling, stops, logprobs, n > 1
and penalties (which fall back to one step at a time).
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from deepserve import LLM, SamplingParams
from deepserve.config import EngineArgs
from deepserve.engine.core import EngineCore, EngineCoreRequest
from deepserve.runner.model_runner import RunnerOutput

EOS = 3


@dataclasses.dataclass
class _Pending:
    out: object
    sampled: list[int]  # one per sampling row, as the device tensor would hold them


class ScriptedRunner:
    """A model-free runner: token = f(request, position, input token), so a placeholder filled from
    the wrong row changes what follows. Resolves placeholders the way the device does (from the
    previous launched step's sampled rows), keeps a simulated KV cache (slot -> token, written in
    launch order, as the device stream would) and checks at every launch that each request's context
    holds its real tokens — which a block hashed or reused too early would break. Records the order of
    launches and waits."""

    def __init__(self, num_blocks: int, block_size: int = 4) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []
        self.launched = 0
        self.launched_ahead = 0  # launches made while the previous step was not yet read

    def determine_num_blocks(self) -> int:
        return self.num_blocks

    def initialize_cache(self, num_blocks: int) -> None:
        pass

    def _slot(self, request, position: int) -> int:
        return request.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def launch(self, out, previous=None) -> _Pending:
        self.launched += 1
        step = self.launched
        self.launched_ahead += previous is not None and ("wait", step - 1) not in self.calls
        self.calls.append(("launch", step))
        sampled = []
        for sched in out.scheduled:
            request = sched.request
            for p in range(sched.start):  # the context this step attends to
                assert self.kv.get(self._slot(request, p)) == request.token_ids[p], (request, p)
            token = None
            for p in range(sched.start, sched.start + sched.num_new_tokens):
                token = request.token_ids[p]
                if token < 0:  # a placeholder: the previous step's row -(token + 1)
                    assert previous is not None and -(token + 1) < len(previous.sampled)
                    token = previous.sampled[-(token + 1)]
                self.kv[self._slot(request, p)] = token
            for _ in range(sched.num_sampled):
                sampled.append(_token(request.request_id, sched.start + sched.num_new_tokens, token))
        pending = _Pending(out, sampled)
        pending.step = step
        return pending

    def wait(self, pending: _Pending) -> RunnerOutput:
        self.calls.append(("wait", pending.step))
        rows = iter(pending.sampled)
        return RunnerOutput([[next(rows) for _ in range(s.num_sampled)] for s in pending.out.scheduled])

    def execute(self, out) -> RunnerOutput:
        return self.wait(self.launch(out))


def _token(request_id: str, position: int, last_input: int) -> int:
    """Deterministic per (request, position, input token); EOS now and then so some requests stop early."""
    h = hash((request_id, position, last_input)) % 97
    return EOS if h < 6 else 10 + h


def _engine(async_scheduling: bool, num_blocks: int = 400, **kw) -> tuple[EngineCore, ScriptedRunner]:
    args = EngineArgs(device="cpu", block_size=4, max_model_len=96, async_scheduling=async_scheduling, **kw)
    runner = ScriptedRunner(num_blocks)
    return EngineCore(args.create_engine_config(), runner), runner


def _run(core: EngineCore, requests: list[EngineCoreRequest], abort_at: dict[int, str] | None = None):
    """Every request's (tokens, finish reason) after running the engine to the end."""
    for r in requests:
        core.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    reasons: dict[str, str | None] = {}
    step = 0
    while core.has_unfinished_requests():
        step += 1
        if abort_at and step in abort_at:
            core.abort_requests([abort_at[step]])
            reasons[abort_at[step]] = "abort"
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
        assert step < 2000
    return tokens, reasons


def _requests(n: int = 24, seed: int = 0) -> list[EngineCoreRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ignore_eos = i % 3 == 0
        params = SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=ignore_eos,
                                stop_token_ids=[50 + i % 7] if i % 4 == 1 else [], min_tokens=2 if i % 5 == 2 else 0)
        prompt = [rng.randint(10, 99) for _ in range(rng.randint(1, 40))]
        out.append(EngineCoreRequest(f"r{i}", prompt, params, [EOS], 0.0))
    return out


@pytest.mark.parametrize("budget", [None, 7])
def test_async_gives_the_tokens_of_step_by_step(budget):
    want = _run(_engine(False, max_num_batched_tokens=budget)[0], _requests())
    core, runner = _engine(True, max_num_batched_tokens=budget)
    got = _run(core, _requests())
    assert got == want
    assert any(reason == "stop" for reason in want[1].values())  # EOS / stop tokens were exercised
    assert core.scheduler.block_manager.usage == 0.0 and core.inflight is None
    assert runner.launched_ahead > runner.launched // 2  # async really ran ahead


def test_prefix_cache_serves_a_request_admitted_right_behind_its_twin():
    # Twins of one prompt, the second added one step later: it is admitted while the first's prompt
    # step is still in flight, and must find that prompt's blocks in the prefix cache all the same.
    def run(async_scheduling: bool) -> int:
        core, _ = _engine(async_scheduling)
        prompt = list(range(10, 50))
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        core.add_request(EngineCoreRequest("a", prompt, params, [EOS], 0.0))
        core.step()
        core.add_request(EngineCoreRequest("b", prompt, params, [EOS], 0.0))
        while core.has_unfinished_requests():
            core.step()
        return core.scheduler.prefix_cache_hits

    assert run(True) == run(False) == 36  # 9 of the 10 blocks: the last prompt token is always computed


def test_step_n_plus_1_is_launched_before_step_n_is_read():
    core, runner = _engine(True)
    _run(core, _requests(6))
    calls = runner.calls
    for n in range(1, runner.launched):
        assert calls.index(("launch", n + 1)) < calls.index(("wait", n)), calls[:12]


def test_preemption_with_a_token_in_flight():
    # 40 blocks of 4 tokens for 24 requests of up to 70 tokens: requests are preempted while their
    # last token is still on its way, and recompute from it once it has arrived.
    want_core = _engine(False, num_blocks=40)[0]
    want = _run(want_core, _requests())
    core, _ = _engine(True, num_blocks=40)
    got = _run(core, _requests())
    assert core.scheduler.num_preemptions_total > 0
    assert got == want


def test_abort_while_a_step_for_the_request_runs():
    want = _run(_engine(False)[0], _requests(8), abort_at={4: "r2"})
    core, _ = _engine(True)
    got = _run(core, _requests(8), abort_at={4: "r2"})
    assert got[1]["r2"] == "abort"
    # The others are unaffected; r2 may have one token more or less depending on what was in flight.
    assert {k: v for k, v in got[0].items() if k != "r2"} == {k: v for k, v in want[0].items() if k != "r2"}
    assert core.scheduler.block_manager.usage == 0.0


def test_async_is_on_by_default_only_for_one_cuda_process_and_never_under_pp():
    cpu = EngineArgs(device="cpu").create_engine_config()
    assert cpu.scheduler.async_scheduling is False
    assert EngineArgs(device="cpu", async_scheduling=True).create_engine_config().scheduler.async_scheduling
    tp = EngineArgs(device="cpu", tensor_parallel_size=2).create_engine_config()
    assert tp.scheduler.async_scheduling is False  # opt-in under tensor parallelism
    tp = EngineArgs(device="cpu", async_scheduling=True, tensor_parallel_size=2).create_engine_config()
    assert tp.scheduler.async_scheduling is True
    pp = EngineArgs(device="cpu", async_scheduling=True, pipeline_parallel_size=2).create_engine_config()
    assert pp.scheduler.async_scheduling is False


@pytest.fixture(scope="module")
def demo_pair():
    kw = dict(device="cpu", num_gpu_blocks_override=256, max_model_len=256)
    return LLM(**kw), LLM(async_scheduling=True, **kw)


def _outputs(llm: LLM, prompts, params):
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs)
            for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, seed=7, max_tokens=24, n=2, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=40, stop=[" the", "e"], include_stop_str_in_output=True),
    SamplingParams(temperature=0.0, max_tokens=30, min_tokens=5),
    SamplingParams(temperature=0.9, seed=3, max_tokens=20, presence_penalty=0.5, repetition_penalty=1.2),
], ids=["seeded-n2-logprobs", "stop-strings", "min-tokens-eos", "penalties-fall-back"])
def test_demo_model_same_outputs_both_ways(demo_pair, params):
    sync, asynchronous = demo_pair
    assert asynchronous.llm_engine.core.async_scheduling
    prompts = ["Paged attention keeps the cache in blocks", "def add(a, b):", "The", "0 1 2 3"]
    assert _outputs(asynchronous, prompts, params) == _outputs(sync, prompts, params)
    assert asynchronous.llm_engine.stats().kv_cache_usage == 0.0


def test_demo_model_n4_children_share_the_parent_prompt_both_ways(demo_pair):
    prompt = "Paged attention keeps the cache in blocks of tokens, " * 4
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=8, n=4)
    hits, cached = [], []
    for llm in demo_pair:
        before = llm.llm_engine.stats().prefix_cache_hits_total
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        hits.append(llm.llm_engine.stats().prefix_cache_hits_total - before)
        cached.append(out.num_cached_tokens)
    assert hits[0] == hits[1] > 0 and cached[0] == cached[1]


@pytest.mark.parametrize("flags, want", [
    ([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)])
def test_cli_flag_reaches_the_engine(flags, want):
    import argparse

    from deepserve.entrypoints.cli import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(["--device", "cpu", *flags]), None)
    assert args.async_scheduling is want
    assert args.create_engine_config().scheduler.async_scheduling is bool(want)  # None: off on CPU
