"""Structured output's start-up warm-up (DEEPSERVE_GRAMMAR_WARMUP): llguidance's view of the tokenizer is
built once, on a thread of its own, from start-up on; the first request with a grammar uses that build
instead of making its own on the engine's thread."""

from __future__ import annotations

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
WARMUP_THREAD = "deepserve-grammar-warmup"


@pytest.fixture
def builds(monkeypatch):
    """The threads that built an llguidance tokenizer, in order (llguidance's own builder, wrapped)."""
    import llguidance.hf

    real, names = llguidance.hf.from_tokenizer, []

    def spy(*args, **kwargs):
        names.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", spy)
    return names


def _engine_args() -> EngineArgs:
    return EngineArgs(device="cpu", num_gpu_blocks_override=64, max_model_len=256)


def _tokenizer_and_vocab():
    from deepserve.loader.tokenizer import load_tokenizer

    config = _engine_args().create_engine_config()  # the demo model's
    return load_tokenizer(config.model.tokenizer), config.model.hf_config.vocab_size


def test_the_offline_engine_builds_it_at_start_up_once_for_front_end_and_core(builds):
    llm = LLM(device="cpu", num_gpu_blocks_override=64, max_model_len=256)
    engine = llm.llm_engine
    grammars = engine.core.grammars
    assert grammars is engine.input_processor.grammars  # one process: one compiler
    assert grammars.warming is not None
    grammars.warming.result(timeout=60)
    assert builds == [WARMUP_THREAD]
    out = llm.generate(["pick one"], SamplingParams(max_tokens=8, structured_outputs=CHOICE), use_tqdm=False)
    assert out[0].outputs[0].text in ("alpha", "beta")
    assert builds == [WARMUP_THREAD]  # the request used the start-up build


def test_switched_off_it_is_built_by_the_first_request(builds, monkeypatch):
    monkeypatch.setenv("DEEPSERVE_GRAMMAR_WARMUP", "0")
    llm = LLM(device="cpu", num_gpu_blocks_override=64, max_model_len=256)
    assert llm.llm_engine.core.grammars.warming is None
    assert builds == []
    out = llm.generate(["pick one"], SamplingParams(max_tokens=8, structured_outputs=CHOICE), use_tqdm=False)
    assert out[0].outputs[0].text in ("alpha", "beta")
    assert builds == [threading.main_thread().name]


def test_a_compile_during_the_warm_up_waits_for_it_instead_of_building_again(builds, monkeypatch):
    import llguidance.hf

    spy = llguidance.hf.from_tokenizer
    monkeypatch.setattr(llguidance.hf, "from_tokenizer", lambda *a, **k: (time.sleep(0.5), spy(*a, **k))[1])
    compiler = GrammarCompiler(*_tokenizer_and_vocab())
    warming = compiler.warm_up()
    assert compiler.warm_up() is warming  # started once
    state = compiler.compile(CHOICE)  # while the warm-up is still inside its 0.5 s build
    assert warming.done() and state.bitmask()
    assert builds == [WARMUP_THREAD]


def test_the_engine_core_process_builds_its_own_from_start_up(builds):
    # The server's core runs in a process of its own: it loads its tokenizer and builds on its own thread.
    core = EngineCore.from_engine_args(_engine_args(), warm_grammars=True)
    compiler = core.grammar_warmup.result(timeout=60)
    assert isinstance(compiler, GrammarCompiler) and builds == [WARMUP_THREAD]
    params = SamplingParams(max_tokens=8, structured_outputs=CHOICE)
    core.add_request(EngineCoreRequest("r", [5, 6, 7], params, [], time.time()))
    assert core.grammars is compiler
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for out in core.step() for t in out.new_token_ids]
    assert compiler.tokenizer.decode(tokens, skip_special_tokens=True).strip() in ("alpha", "beta")
    assert builds == [WARMUP_THREAD]


def test_a_failed_warm_up_is_logged_and_the_first_request_builds_it(builds, monkeypatch, caplog):
    import llguidance.hf

    spy, calls = llguidance.hf.from_tokenizer, []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("tokenizer not readable")
        return spy(*args, **kwargs)

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", fail_once)
    with caplog.at_level(logging.WARNING, logger="deepserve.engine.grammar"):
        core = EngineCore.from_engine_args(_engine_args(), warm_grammars=True)
        assert isinstance(core.grammar_warmup.exception(timeout=60), RuntimeError)
    assert any("tokenizer not readable" in r.getMessage() for r in caplog.records)
    params = SamplingParams(max_tokens=8, structured_outputs=CHOICE)
    core.add_request(EngineCoreRequest("r", [5, 6, 7], params, [], time.time()))
    while core.has_unfinished_requests():
        core.step()
    assert len(calls) == 2 and core.grammars is not None and core.grammar_warmup is None


def test_the_api_front_end_warms_its_own_compiler(builds):
    config = _engine_args().create_engine_config()
    tokenizer, _ = _tokenizer_and_vocab()
    front = InputProcessor(config, tokenizer, frozenset())
    front.warm_grammars()
    assert front.grammars.warming.result(timeout=60) is front.grammars.ll_tokenizer
    assert builds == [WARMUP_THREAD]
    bare = InputProcessor(config, None, frozenset())
    bare.warm_grammars()  # no tokenizer (skip_tokenizer_init): no grammars to serve, nothing built
    assert bare.grammars is None


def test_without_its_thread_start_up_builds_it_before_returning(builds, monkeypatch):
    monkeypatch.setenv("DEEPSERVE_GRAMMAR_WARMUP_THREAD", "0")
    compiler = GrammarCompiler(*_tokenizer_and_vocab())
    assert compiler.warm_up().done() and builds == [threading.main_thread().name]
    core = EngineCore.from_engine_args(_engine_args(), warm_grammars=True)
    assert core.grammar_warmup.done() and builds == [threading.main_thread().name] * 2
