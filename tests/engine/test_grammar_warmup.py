"""Structured output's start-up warm-up (DEEPSERVE_GRAMMAR_WARMUP): llguidance's view of the tokenizer is
built once, at start-up, before the model loads; the first request with a grammar uses that build instead
of making its own on the engine's thread."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import pytest

from deepserve import LLM, SamplingParams
from deepserve.config import EngineArgs
from deepserve.engine.core import EngineCore, EngineCoreRequest
from deepserve.engine.grammar import GrammarCompiler
from deepserve.engine.processors import InputProcessor
from deepserve.sampling_params import StructuredOutputsParams

CHOICE = StructuredOutputsParams(choice=["alpha", "beta"])


class _Seen(list):
    """Who built an llguidance tokenizer, in order: the test sets `phase` to "request" once start-up is over."""

    phase = "start-up"


@pytest.fixture
def builds(monkeypatch):
    """llguidance's builder, wrapped to record each build's phase."""
    import llguidance.hf

    real, seen = llguidance.hf.from_tokenizer, _Seen()

    def spy(*args, **kwargs):
        seen.append(seen.phase)
        return real(*args, **kwargs)

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", spy)
    return seen


def _engine_args() -> EngineArgs:
    return EngineArgs(device="cpu", num_gpu_blocks_override=64, max_model_len=256)


def _tokenizer_and_vocab():
    from deepserve.loader.tokenizer import load_tokenizer

    config = _engine_args().create_engine_config()  # the demo model's
    return load_tokenizer(config.model.tokenizer), config.model.hf_config.vocab_size


def _pick(llm: LLM) -> str:
    out = llm.generate(["pick one"], SamplingParams(max_tokens=8, structured_outputs=CHOICE), use_tqdm=False)
    return out[0].outputs[0].text


def test_the_offline_engine_builds_it_at_start_up_once_for_front_end_and_core(builds):
    llm = LLM(device="cpu", num_gpu_blocks_override=64, max_model_len=256)
    engine = llm.llm_engine
    assert engine.core.grammars is engine.input_processor.grammars  # one process: one compiler
    assert builds == ["start-up"]
    builds.phase = "request"
    assert _pick(llm) in ("alpha", "beta")
    assert builds == ["start-up"]  # the request used the start-up build


def test_switched_off_it_is_built_by_the_first_request(builds, monkeypatch):
    monkeypatch.setenv("DEEPSERVE_GRAMMAR_WARMUP", "0")
    llm = LLM(device="cpu", num_gpu_blocks_override=64, max_model_len=256)
    assert builds == []
    builds.phase = "request"
    assert _pick(llm) in ("alpha", "beta")
    assert builds == ["request"]


def test_the_engine_core_process_builds_its_own_at_start_up(builds):
    # The server's core runs in a process of its own: it loads its tokenizer and builds before the model.
    core = EngineCore.from_engine_args(_engine_args(), warm_grammars=True)
    compiler = core.grammars
    assert isinstance(compiler, GrammarCompiler) and builds == ["start-up"]
    builds.phase = "request"
    params = SamplingParams(max_tokens=8, structured_outputs=CHOICE)
    core.add_request(EngineCoreRequest("r", [5, 6, 7], params, [], time.time()))
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for out in core.step() for t in out.new_token_ids]
    assert core.grammars is compiler
    assert compiler.tokenizer.decode(tokens, skip_special_tokens=True).strip() in ("alpha", "beta")
    assert builds == ["start-up"]
    # Without warm_grammars (the one-process engine, which hands the core its front end's compiler) none.
    assert EngineCore.from_engine_args(_engine_args()).grammars is None and builds == ["start-up"]


def _fail_first_build(monkeypatch) -> list:
    """llguidance's builder raising on its first call only; returns the list of its calls."""
    import llguidance.hf

    spy, calls = llguidance.hf.from_tokenizer, []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("tokenizer not readable")
        return spy(*args, **kwargs)

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", fail_once)
    return calls


def test_a_failed_warm_up_is_logged_and_the_first_request_builds_it(builds, monkeypatch, caplog):
    calls = _fail_first_build(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="deepserve.engine.grammar"):
        core = EngineCore.from_engine_args(_engine_args(), warm_grammars=True)
    compiler = core.grammars  # kept, its tokenizer loaded: the view is left to the first request
    assert compiler is not None and compiler._ll_tokenizer is None
    assert any("tokenizer not readable" in r.getMessage() for r in caplog.records)
    params = SamplingParams(max_tokens=8, structured_outputs=CHOICE)
    core.add_request(EngineCoreRequest("r", [5, 6, 7], params, [], time.time()))
    while core.has_unfinished_requests():
        core.step()
    assert len(calls) == 2 and core.grammars is compiler and compiler._ll_tokenizer is not None


def test_a_failed_warm_up_in_the_offline_engine_leaves_it_to_the_first_request(builds, monkeypatch, caplog):
    calls = _fail_first_build(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="deepserve.engine.grammar"):
        llm = LLM(device="cpu", num_gpu_blocks_override=64, max_model_len=256)
    assert any("tokenizer not readable" in r.getMessage() for r in caplog.records)
    assert _pick(llm) in ("alpha", "beta") and len(calls) == 2


def test_an_unreadable_tokenizer_does_not_stop_the_core(monkeypatch, caplog):
    import deepserve.loader.tokenizer as loader

    def unreadable(path):
        raise OSError(f"no tokenizer at {path}")

    monkeypatch.setattr(loader, "load_tokenizer", unreadable)
    with caplog.at_level(logging.WARNING, logger="deepserve.engine.core"):
        core = EngineCore.from_engine_args(_engine_args(), warm_grammars=True)
    assert core.grammars is None and any("no tokenizer at" in r.getMessage() for r in caplog.records)


def test_the_api_front_end_warms_its_own_compiler(builds):
    config = _engine_args().create_engine_config()
    tokenizer, _ = _tokenizer_and_vocab()
    front = InputProcessor(config, tokenizer, frozenset())
    front.warm_grammars()
    assert builds == ["start-up"] and front.grammars._ll_tokenizer is not None
    builds.phase = "request"
    front.check_grammar(SamplingParams(max_tokens=8, structured_outputs=CHOICE))
    assert builds == ["start-up"]
    bare = InputProcessor(config, None, frozenset())
    bare.warm_grammars()  # no tokenizer (skip_tokenizer_init): no grammars to serve, nothing built
    assert bare.grammars is None


def test_compiles_on_two_threads_build_it_once(builds, monkeypatch):
    # The engine core's compile thread and a front end may reach a compiler left to first use together.
    import llguidance.hf

    spy = llguidance.hf.from_tokenizer
    monkeypatch.setattr(llguidance.hf, "from_tokenizer", lambda *a, **k: (time.sleep(0.3), spy(*a, **k))[1])
    compiler = GrammarCompiler(*_tokenizer_and_vocab())
    states = []
    workers = [threading.Thread(target=lambda: states.append(compiler.compile(CHOICE))) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(states) == 2 and all(s.bitmask() for s in states) and len(builds) == 1


def test_it_runs_before_the_model_loads_and_start_up_times_it(builds, monkeypatch):
    from deepserve.runner import model_runner

    init = model_runner.ModelRunner.__init__

    def recording(self, *args, **kwargs):
        builds.append("model")
        init(self, *args, **kwargs)

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", recording)
    llm = LLM(device="cpu", num_gpu_blocks_override=64, max_model_len=256)
    assert builds == ["start-up", "model"]
    startup = llm.llm_engine.core.startup_s
    assert list(startup)[:2] == ["grammar_warmup", "load"] and startup["grammar_warmup"] > 0


def test_the_engine_core_process_builds_its_core_with_its_own_warm_compiler(builds):
    from deepserve.engine.core_process import build_engine_core

    core = build_engine_core(dataclasses.asdict(_engine_args()))  # as the API server hands them over
    assert isinstance(core.grammars, GrammarCompiler) and builds == ["start-up"]
    assert "grammar_warmup" in core.startup_s


def test_the_api_server_warms_its_front_end_at_construction(builds):
    from deepserve.server.async_llm import AsyncLLM

    config = _engine_args().create_engine_config()
    tokenizer, _ = _tokenizer_and_vocab()
    engine = AsyncLLM(config, tokenizer, frozenset(), core=None)  # the core process is not needed for this
    assert engine.input_processor.grammars._ll_tokenizer is not None and builds == ["start-up"]


@pytest.mark.parametrize("why", ["switched off", "no llguidance"])
def test_nothing_is_built_when_off_or_without_llguidance(builds, monkeypatch, why):
    import importlib.util

    from deepserve.engine import core as core_module

    if why == "switched off":
        monkeypatch.setenv("DEEPSERVE_GRAMMAR_WARMUP", "0")
    else:
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llguidance"
                            else find_spec(name, *a))
    config = _engine_args().create_engine_config()
    assert core_module._warm_grammar_compiler(config) is None
    front = InputProcessor(config, _tokenizer_and_vocab()[0], frozenset())
    front.warm_grammars()
    assert front.grammars._ll_tokenizer is None and builds == []


def test_an_engine_without_a_tokenizer_builds_nothing(builds):
    llm = LLM(device="cpu", num_gpu_blocks_override=64, max_model_len=256, skip_tokenizer_init=True)
    assert llm.llm_engine.core.grammars is None and builds == []
    assert "grammar_warmup" not in llm.llm_engine.core.startup_s
