"""Structured output through the offline API on the demo model (random weights: only the grammar can make
the text valid). Outputs are checked with json.loads, the jsonschema package and re.fullmatch, never with
our own matcher; the engine runs with async scheduling on, preemption, n > 1, stops and max_tokens."""

from __future__ import annotations

import json
import re
import threading
import time
import types

import jsonschema
import pytest

from deepserve import LLM, SamplingParams
from deepserve.engine.grammar import GrammarError
from deepserve.sampling_params import StructuredOutputsParams

# Strings bounded by maxLength are where xgrammar 0.2.8 let raw control characters through.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "note": {"type": "string", "minLength": 1, "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "note", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", num_gpu_blocks_override=256, max_model_len=512, async_scheduling=True)


def _json(**kwargs) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=SCHEMA, **kwargs)


def _texts(llm, prompts, params):
    return [c.text for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]


def test_json_schema_outputs_parse_and_validate_with_raw_sampling(llm):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=300, structured_outputs=_json())
              for s in range(6)]
    outs = llm.generate(["Write a person:"] * 6, params, use_tqdm=False)
    for o in outs:
        (c,) = o.outputs
        assert c.finish_reason == "stop", c.text
        value = json.loads(c.text)  # strict: a raw control character inside a string would fail here
        jsonschema.validate(value, SCHEMA)
    assert len({o.outputs[0].text for o in outs}) > 1  # really sampled, not one forced string


def test_n_greater_than_one_gives_valid_independent_completions(llm):
    (out,) = llm.generate(["n"], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=300,
                                                  structured_outputs=_json(disable_any_whitespace=True)),
                          use_tqdm=False)
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), SCHEMA)
        assert not re.search(r"\s", c.text.replace("\\s", "")) or '"' in c.text  # compact between tokens
    assert len({c.text for c in out.outputs}) > 1


def test_regex_choice_json_object_and_lark(llm):
    regex = r"[a-z]{2,5}-\d{3}"
    (r,) = _texts(llm, ["id"], SamplingParams(temperature=1.0, seed=3, max_tokens=40,
                                              structured_outputs=StructuredOutputsParams(regex=regex)))
    assert re.fullmatch(regex, r), r
    choices = ["alpha", "beta gamma", "delta"]
    picks = _texts(llm, ["pick"] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=40,
                                                      structured_outputs=StructuredOutputsParams(choice=choices))
                                       for s in range(4)])
    assert all(p in choices for p in picks), picks
    lark = 'start: "x=" NUM ";"\nNUM: /[0-9]{1,3}/'
    (g,) = _texts(llm, ["lark"], SamplingParams(temperature=1.0, seed=2, max_tokens=20,
                                                structured_outputs=StructuredOutputsParams(grammar=lark)))
    assert re.fullmatch(r"x=[0-9]{1,3};", g), g


def test_json_object_means_an_object(llm):
    # Random weights rarely close an unbounded key, so the grammar itself is asked: "[1]" and "7" are
    # refused from the first token on, "{}" and a nested object complete it.
    compiler = llm.llm_engine.input_processor.grammars or _compiler(llm)
    tok = llm.get_tokenizer()
    for text, whole in (("[1]", False), ("7", False), ("{}", True), ('{"a": [1, {"b": null}]}', True)):
        state = compiler.compile(StructuredOutputsParams(json_object=True))
        ok = all(state.accept(t) for t in tok.encode(text, add_special_tokens=False))
        assert ok == whole and (not ok or state.matcher.is_accepting()), text
    (obj,) = _texts(llm, ["obj"], SamplingParams(temperature=1.0, seed=1, max_tokens=30,
                                                 structured_outputs=StructuredOutputsParams(json_object=True)))
    assert obj.lstrip().startswith("{")


def test_a_token_fed_ahead_with_a_snapshot_answers_for_itself(llm):
    # feed_ahead(snapshot=True) (the masks then fill on another thread): the scheduler's accept, is_finished
    # and error for that token come from what was read at feed time, as the matcher said them then, not
    # from the matcher (fed further ahead meanwhile, or lent to the fill).
    compiler = llm.llm_engine.input_processor.grammars or _compiler(llm)
    tok = llm.get_tokenizer()
    done = tok.encode("done", add_special_tokens=False)
    choice = StructuredOutputsParams(choice=["done"])
    plain, ahead = compiler.compile(choice), compiler.compile(choice)
    for t in done:
        ahead.feed_ahead(t, snapshot=True)
    for t in done:  # the scheduler takes them later, in order
        assert plain.accept(t) and ahead.accept(t)
        assert ahead.is_finished == plain.is_finished and ahead.error == plain.error == ""
    assert ahead.is_finished  # "done" completes the choice
    refused, wrong = compiler.compile(choice), tok.encode("{", add_special_tokens=False)[0]
    refused.feed_ahead(wrong, snapshot=True)
    refused.feed_ahead(done[0], snapshot=True)  # a later token: the matcher's state moves on (or stays stuck)
    assert not refused.accept(wrong)
    assert refused.is_finished and refused.error  # as read right after the refused token


def _compiler(llm):
    llm.llm_engine.input_processor.check_grammar(SamplingParams(structured_outputs=StructuredOutputsParams(
        json_object=True)))
    return llm.llm_engine.input_processor.grammars


def test_request_ends_when_the_grammar_completes(llm):
    # ignore_eos: nothing but the grammar's completion can end it before max_tokens.
    (o,) = llm.generate(["c"], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                                              structured_outputs=StructuredOutputsParams(choice=["done"])),
                        use_tqdm=False)
    assert o.outputs[0].text == "done" and o.outputs[0].finish_reason == "stop"
    assert len(o.outputs[0].token_ids) < 50


def test_max_tokens_and_stop_strings_still_apply(llm):
    (short,) = llm.generate(["m"], SamplingParams(temperature=0, max_tokens=3, structured_outputs=_json()),
                            use_tqdm=False)
    assert short.outputs[0].finish_reason == "length" and len(short.outputs[0].token_ids) == 3
    (stopped,) = llm.generate(["s"], SamplingParams(temperature=0, max_tokens=300, stop=['"note"'],
                                                    structured_outputs=_json(disable_any_whitespace=True)),
                              use_tqdm=False)
    c = stopped.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == '"note"' and '"note"' not in c.text
    assert c.text.startswith('{"name":"')


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(llm):
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The cache is cut into blocks", "Scheduling is simple arithmetic"]
    alone = _texts(llm, prompts, plain)
    constrained = SamplingParams(temperature=1.0, seed=9, max_tokens=200, structured_outputs=_json())
    mixed = llm.generate([prompts[0], "json please", prompts[1], "more json"],
                         [plain, constrained, plain, constrained], use_tqdm=False)
    assert [mixed[0].outputs[0].text, mixed[2].outputs[0].text] == alone
    for o in (mixed[1], mixed[3]):
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


def test_matcher_survives_preemption():
    # 12 blocks of 16 tokens for four requests that each want ~100: the scheduler must preempt.
    small = LLM(device="cpu", num_gpu_blocks_override=12, max_model_len=192, async_scheduling=True)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=150, min_tokens=0,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA)) for s in range(4)]
    outs = small.generate(["Write a person, please:"] * 4, params, use_tqdm=False)
    assert small.llm_engine.stats().num_preemptions_total > 0
    for o in outs:
        c = o.outputs[0]
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)
        else:  # cut by max_tokens: still a valid prefix the grammar accepted (no stray token)
            assert c.finish_reason == "length"
    assert any(o.outputs[0].finish_reason == "stop" for o in outs)


def test_preemption_with_the_masks_filling_beside_gives_the_same_tokens(monkeypatch):
    # DEEPSERVE_GRAMMAR_OVERLAP=1 under preemption (recompute with a token in flight): the same schedule and
    # tokens as with it off, the matchers kept across preemption, most steps' masks filled beside.
    outputs, cores = [], []
    for overlap in ("0", "1"):
        monkeypatch.setenv("DEEPSERVE_GRAMMAR_OVERLAP", overlap)
        small = LLM(device="cpu", num_gpu_blocks_override=12, max_model_len=192, async_scheduling=True)
        params = [SamplingParams(temperature=1.0, seed=40 + s, max_tokens=150,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA)) for s in range(4)]
        outputs.append([o.outputs[0].token_ids for o in small.generate(["Write a person, please:"] * 4, params,
                                                                       use_tqdm=False)])
        cores.append(small.llm_engine.core)
    assert outputs[0] == outputs[1]
    assert cores[1].scheduler.stats().num_preemptions_total > 0
    assert cores[1].grammar_overlap and cores[1].grammar_timing.beside > cores[1].grammar_timing.steps // 2


@pytest.mark.parametrize("so, needle", [
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "nonsense"),
    (StructuredOutputsParams(regex="(ab"), "regex"),
    (StructuredOutputsParams(grammar="start: missing_rule"), "missing_rule"),
    (StructuredOutputsParams(json="{not json"), "property name"),
])
def test_bad_grammar_is_refused_before_the_engine(llm, so, needle):
    with pytest.raises(GrammarError, match=needle):
        llm.generate(["x"], SamplingParams(structured_outputs=so), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])


def test_async_scheduling_stays_on_and_matches_step_by_step(llm):
    # A constrained row's mask for step n+1 needs step n's token: the engine reads that token inside n+1's
    # launch, after n+1's forward is queued, and feeds it to the matcher ahead of the scheduler. Steps are
    # still launched ahead while grammars run, and seeded outputs equal a step-by-step engine's token for
    # token (the masks saw the same matcher states), constrained and unconstrained rows alike, including
    # grammars that complete (the rows launched after that are dropped) and n > 1.
    engine = llm.llm_engine
    engine.add_request("g", "x", SamplingParams(temperature=1.0, seed=1, max_tokens=40,
                                                structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    engine.step()
    engine.step()
    assert engine.core.inflight is not None  # launched ahead with the grammar live
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.core.inflight is None  # nothing left in flight once every request ended

    step_by_step = LLM(device="cpu", num_gpu_blocks_override=256, max_model_len=512, async_scheduling=False)
    # The regex with ignore_eos: EOS is allowed where the pattern may end, sampled, and not fed to the
    # matcher (Request.grammar_consumes), so the output goes on constrained (the feed-ahead once fed it).
    abc = StructuredOutputsParams(regex="[a-c]+")
    prompts = ["Write a person:", "p", "Pick:", "n", "Another person", "x", "y"]
    params = [SamplingParams(temperature=1.0, seed=11, max_tokens=300, structured_outputs=_json()),
              SamplingParams(temperature=0.8, seed=12, max_tokens=60, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=13,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
              SamplingParams(n=2, temperature=1.0, seed=14, max_tokens=300,
                             structured_outputs=_json(disable_any_whitespace=True)),
              SamplingParams(temperature=0.0, max_tokens=300, structured_outputs=_json()),
              SamplingParams(temperature=1.5, seed=4, max_tokens=30, ignore_eos=True, structured_outputs=abc),
              SamplingParams(temperature=1.5, seed=5, max_tokens=30, ignore_eos=True, structured_outputs=abc)]
    want = [[c.token_ids for c in o.outputs] for o in step_by_step.generate(prompts, params, use_tqdm=False)]
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == want
    completed = [c for i in (0, 3, 4) for c in got[i].outputs if c.finish_reason == "stop"]
    assert len(completed) >= 2  # the greedy row may run to max_tokens on random weights
    for c in completed:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert got[2].outputs[0].text in ("yes", "no")
    eos = llm.get_tokenizer().eos_token_id
    assert any(eos in o.outputs[0].token_ids for o in got[5:])  # EOS was sampled and the output went on
    assert all(re.fullmatch("[a-c]+", o.outputs[0].text) for o in got[5:])
    # DEEPSERVE_GRAMMAR_OVERLAP unset: no fill thread, every step's sampling queued in its launch
    assert llm.llm_engine.core._mask_pool is None and llm.llm_engine.core.grammar_timing.beside == 0


def test_a_slow_grammar_compile_does_not_hold_up_other_requests(llm, monkeypatch):
    # The core's own compiler (as in the server, where the core runs in another process) with a compile
    # that takes 3 s: the unconstrained request finishes meanwhile, then the constrained one runs.
    import time

    from deepserve.engine.grammar import GrammarCompiler

    engine = llm.llm_engine
    slow = GrammarCompiler(engine.tokenizer, engine.config.model.hf_config.vocab_size)
    build = slow._build
    monkeypatch.setattr(slow, "_build", lambda spec: (time.sleep(3.0), build(spec))[1])
    monkeypatch.setattr(engine.core, "grammars", slow)
    choice = StructuredOutputsParams(choice=["one", "two"])
    engine.add_request("slow", "x", SamplingParams(temperature=0, max_tokens=100, structured_outputs=choice))
    engine.add_request("fast", "y", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].text, bool(engine.core._compiling))
    assert done["fast"][1], "the fast request waited for the compile"
    assert done["slow"][0] in ("one", "two")


def test_a_constrained_request_admitted_beside_drafting_requests_is_constrained():
    # Drafting stops while any constrained request is unfinished, waiting ones included: one admitted in
    # the same step as another request's drafts would otherwise be sampled in a verify step, which has no
    # grammar mask (its first token went unconstrained and the grammar refused it).
    llm = LLM(device="cpu", num_gpu_blocks_override=256, max_model_len=512,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                  "prompt_lookup_min": 1})
    engine = llm.llm_engine
    engine.add_request("u", "a b c a b c a b c a b c a b c a b c", SamplingParams(temperature=0, max_tokens=200,
                                                                               ignore_eos=True))
    done, drafts = {}, []
    for i in range(400):
        for out in engine.step():
            done[out.request_id] = out
        if i in (35, 70, 105):  # while "u" drafts (the "g"s take ~20 steps each)
            drafts.append(engine.stats().spec_decode_num_drafts_total)
            engine.add_request(f"g{i}", "x", SamplingParams(temperature=1.0, seed=i, max_tokens=20,
                                                            structured_outputs=StructuredOutputsParams(regex="[0-9]{5}")))
        if not engine.has_unfinished_requests():
            break
    assert 0 < drafts[0] < drafts[1] < drafts[2]  # they arrived beside a drafting request
    for i in (35, 70, 105):
        assert re.fullmatch("[0-9]{5}", done[f"g{i}"].outputs[0].text), done[f"g{i}"].outputs[0].text


def test_structured_output_beside_speculative_decoding():
    # A step with a constrained request drafts nothing (the grammar mask covers one row per request), so
    # its output stays valid while unconstrained neighbours keep their greedy tokens.
    spec = LLM(device="cpu", num_gpu_blocks_override=256, max_model_len=512,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    plain = LLM(device="cpu", num_gpu_blocks_override=256, max_model_len=512)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["the the the the the the", "a b a b a b a b"]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    params = [greedy, greedy, SamplingParams(temperature=1.0, seed=3, max_tokens=300, structured_outputs=_json())]
    outs = spec.generate([*prompts, "Write a person:"], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:2]] == want
    jsonschema.validate(json.loads(outs[2].outputs[0].text), SCHEMA)
    alone = spec.generate(prompts, greedy, use_tqdm=False)  # and speculation still drafts on its own
    assert [o.outputs[0].token_ids for o in alone] == want
    assert spec.llm_engine.stats().spec_decode_num_drafts_total > 0


class _WatchedMatcher:
    """A matcher stand-in that reports a call from the engine's thread while a fill is running."""

    def __init__(self, matcher, watch) -> None:
        self._matcher, self._watch = matcher, watch

    def __getattr__(self, name):
        if self._watch.filling.is_set() and threading.current_thread() is threading.main_thread():
            self._watch.clashes.append(name)
        return getattr(self._matcher, name)


def test_masks_filling_beside_the_engine_match_step_by_step(monkeypatch):
    # DEEPSERVE_GRAMMAR_OVERLAP=1: a step's masks fill on their own thread while the engine collects the
    # step before, and its sampling is queued after. Each fill is held 20 ms here, so the engine's work of
    # that step surely runs during it: the engine never calls a matcher meanwhile (llguidance has lent
    # them to the fill), and seeded outputs equal a step-by-step engine's token for token.
    import deepserve.engine.core as core_module
    import deepserve.engine.grammar as grammar_module
    from deepserve.runner.model_runner import ModelRunner

    watch = types.SimpleNamespace(filling=threading.Event(), clashes=[], fills=0, beside=0, deferred=0)
    real_init, real_fill = grammar_module.GrammarState.__init__, grammar_module._fill
    real_update, real_finish = core_module.Scheduler.update_from_output, ModelRunner.finish_launch

    def init(self, matcher):
        real_init(self, matcher if isinstance(matcher, _WatchedMatcher) else _WatchedMatcher(matcher, watch))

    def fill(buffer, jobs, num_bytes, rows):  # llguidance's call, given the real matchers
        jobs = [(m._matcher, row) for m, row in jobs]
        if threading.current_thread() is threading.main_thread():  # the step-by-step engine's
            return real_fill(buffer, jobs, num_bytes, rows)
        watch.filling.set()
        try:
            time.sleep(0.02)
            return real_fill(buffer, jobs, num_bytes, rows)
        finally:
            watch.fills += 1
            watch.filling.clear()

    def update(self, *args, **kwargs):
        watch.beside += watch.filling.is_set()
        return real_update(self, *args, **kwargs)

    def finish(self, pending):
        watch.deferred += pending is not None and pending.sample_later is not None
        return real_finish(self, pending)

    monkeypatch.setattr(grammar_module.GrammarState, "__init__", init)
    monkeypatch.setattr(grammar_module, "_fill", fill)
    monkeypatch.setattr(core_module.Scheduler, "update_from_output", update)
    monkeypatch.setattr(ModelRunner, "finish_launch", finish)
    monkeypatch.setenv("DEEPSERVE_GRAMMAR_OVERLAP", "1")
    overlap = LLM(device="cpu", num_gpu_blocks_override=256, max_model_len=512, async_scheduling=True)
    assert overlap.llm_engine.core.grammar_overlap
    monkeypatch.delenv("DEEPSERVE_GRAMMAR_OVERLAP")
    step_by_step = LLM(device="cpu", num_gpu_blocks_override=256, max_model_len=512, async_scheduling=False)

    # "q" asks a penalty: while it runs, steps go one at a time (execute: launch, then wait, which queues
    # the sampling the launch deferred).
    prompts = ["Write a person:", "p", "Pick:", "n", "x", "q"]
    params = [SamplingParams(temperature=1.0, seed=21, max_tokens=200, structured_outputs=_json()),
              SamplingParams(temperature=0.8, seed=22, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=23,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
              SamplingParams(n=2, temperature=1.0, seed=24, max_tokens=200, structured_outputs=_json()),
              SamplingParams(temperature=1.5, seed=25, max_tokens=30, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(regex="[a-c]+")),
              SamplingParams(temperature=1.0, seed=26, max_tokens=6, presence_penalty=0.5,
                             structured_outputs=_json())]
    want = [[c.token_ids for c in o.outputs] for o in step_by_step.generate(prompts, params, use_tqdm=False)]
    got = overlap.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == want
    assert watch.clashes == []
    assert watch.fills > 10 and watch.deferred > 10  # the steps' sampling waited for their fills
    assert watch.beside > 5  # and the step before was collected while a fill ran
    timing = overlap.llm_engine.core.grammar_timing
    assert timing.beside == watch.fills and timing.fill_s > 0.02 * watch.fills
    for c in (c for i in (0, 3) for c in got[i].outputs if c.finish_reason == "stop"):
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert got[2].outputs[0].text in ("yes", "no") and re.fullmatch("[a-c]+", got[4].outputs[0].text)


def test_a_fill_that_fails_fails_the_step_and_leaves_no_fill_running(monkeypatch):
    # The error of a fill on its thread reaches the caller as it would without the switch (from the step
    # that needed the masks), and the engine is left with no fill in flight.
    import deepserve.engine.grammar as grammar_module

    calls = []
    real_fill = grammar_module._fill

    def fill(buffer, jobs, num_bytes, rows):
        calls.append(threading.current_thread().name)
        if len(calls) == 4:
            raise ValueError("bitmask: 4th fill refused")
        return real_fill(buffer, jobs, num_bytes, rows)

    monkeypatch.setattr(grammar_module, "_fill", fill)
    monkeypatch.setenv("DEEPSERVE_GRAMMAR_OVERLAP", "1")
    llm = LLM(device="cpu", num_gpu_blocks_override=256, max_model_len=512, async_scheduling=True)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=100, structured_outputs=_json())
    with pytest.raises(ValueError, match="4th fill refused"):
        llm.generate(["a", "b"], [params, params], use_tqdm=False)
    assert calls[3].startswith("deepserve-masks") and llm.llm_engine.core._filling is None


@pytest.mark.parametrize("overlap", ["0", "1"])
def test_masks_filled_into_buffer_slots_give_the_same_tokens(monkeypatch, overlap):
    # DEEPSERVE_PINNED_GRAMMAR_MASKS (on by default; on this CPU the slots are plain memory and each step
    # copies its slot instead of queuing a CUDA copy and an event; test_sampler.py has the CUDA test): seeded
    # outputs equal those of masks built in new bytearrays, token for token, constrained rows beside
    # unconstrained ones, with the fill on the engine's thread or beside it; every step took a slot.
    from deepserve.layers.sampling_metadata import MaskBuffers

    monkeypatch.setenv("DEEPSERVE_GRAMMAR_OVERLAP", overlap)
    monkeypatch.setenv("DEEPSERVE_PINNED_GRAMMAR_MASKS", "0")
    plain = LLM(device="cpu", num_gpu_blocks_override=256, max_model_len=512, async_scheduling=True)
    monkeypatch.delenv("DEEPSERVE_PINNED_GRAMMAR_MASKS")  # the default
    slotted = LLM(device="cpu", num_gpu_blocks_override=256, max_model_len=512, async_scheduling=True)
    buffers = slotted.llm_engine.core._mask_buffers
    assert plain.llm_engine.core._mask_buffers is None and isinstance(buffers, MaskBuffers)
    taken = []
    real_take = MaskBuffers.take
    monkeypatch.setattr(MaskBuffers, "take", lambda self, n: taken.append((self, n)) or real_take(self, n))
    prompts = ["Write a person:", "p", "Pick:", "x"]
    params = [SamplingParams(temperature=1.0, seed=31, max_tokens=200, structured_outputs=_json()),
              SamplingParams(temperature=0.8, seed=32, max_tokens=40, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, seed=33, max_tokens=200, structured_outputs=_json()),
              SamplingParams(temperature=1.5, seed=34, max_tokens=30, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(regex="[a-c]+"))]
    want = [[c.token_ids for c in o.outputs] for o in plain.generate(prompts, params, use_tqdm=False)]
    assert taken == []
    got = slotted.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == want
    assert len(taken) > 10 and all(owner is buffers and n % 4 == 0 for owner, n in taken)  # this engine's own
    for c in (c for i in (0, 2) for c in got[i].outputs if c.finish_reason == "stop"):
        jsonschema.validate(json.loads(c.text), SCHEMA)
