"""The tool-call and thinking-budget grammars, compiled by the engine's GrammarCompiler for the demo
tokenizer and walked with random tokens among those each mask allows (no model: only the grammar decides).
Arguments are checked with jsonschema; the budget by counting the sampled tokens between the markers."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import jsonschema
import pytest

from deepserve import chat_markup, demo
from deepserve.engine.grammar import GrammarCompiler
from deepserve.server import protocol as p
from deepserve.server import tool_grammar as tg
from deepserve.server import tools as tools_plan
from deepserve.server.errors import APIError
from deepserve.server.tool_parsers import PARSERS, split_tool_calls

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
FUNCTIONS = [{"name": "get_weather", "parameters": SCHEMA}, {"name": "ping", "parameters": None}]


@pytest.fixture(scope="module", params=["with_marker_tokens", "markers_as_text"])
def tok(request):
    added = demo.MARKER_TOKENS if request.param == "with_marker_tokens" else None
    return demo.train_bpe_tokenizer(demo.CORPUS, demo.VOCAB_SIZE, demo.SPECIAL_TOKENS, added)


def _walk(tok, grammar: str, seed: int, limit: int = 600) -> list[int]:
    state = GrammarCompiler(tok, len(tok)).compile(tg.StructuredOutputsParams(grammar=grammar))
    rng, out = random.Random(seed), []
    for _ in range(limit):
        mask = state.bitmask()
        allowed = [i for i in range(len(tok)) if mask[i // 8] >> (i % 8) & 1]
        token = rng.choice(allowed)
        if token == tok.eos_token_id:
            return out
        assert state.accept(token)
        out.append(token)
    raise AssertionError(f"no end after {limit} tokens: {tok.decode(out)!r}")


@pytest.mark.parametrize("parser", sorted(PARSERS))
@pytest.mark.parametrize("parallel", [True, False])
def test_tool_call_grammar_gives_valid_calls(tok, parser, parallel):
    rules = tg.tool_calls_rules(tok, PARSERS[parser], FUNCTIONS, parallel)
    grammar = tg.build([rules], ["tool_calls"]).grammar
    for seed in range(4):
        content, calls = split_tool_calls(tok.decode(_walk(tok, grammar, seed)), parser)
        assert content == "" and calls and (parallel or len(calls) == 1)
        for call in calls:
            args = json.loads(call.arguments)
            if call.name == "get_weather":
                jsonschema.validate(args, SCHEMA)
            else:
                assert call.name == "ping" and args == {}  # no parameters: OpenAI's empty argument list


@pytest.mark.parametrize("budget", [0, 1, 5])
@pytest.mark.parametrize("opened", [True, False])
def test_thinking_budget_then_json(tok, budget, opened):
    thinking = tg.thinking_rules(tok, budget, opened)
    answer = tg.answer_rules(tg.StructuredOutputsParams(json=SCHEMA))
    grammar = tg.build([thinking, answer], ["thinking", "answer"]).grammar
    end_id = tok.convert_tokens_to_ids(demo.END_THINK) if demo.END_THINK in tok.get_vocab() else None
    for seed in range(3):
        out = _walk(tok, grammar, seed)
        text = tok.decode(out)
        reasoning, answer_text = text.split(demo.END_THINK, 1)
        jsonschema.validate(json.loads(answer_text), SCHEMA)
        assert reasoning.startswith(demo.THINK) != opened
        if end_id is not None:  # one token per marker: count the reasoning tokens exactly
            assert out.index(end_id) - (0 if opened else 1) <= budget


# Hand-written outputs in each format, fed to llguidance token by token (the demo tokenizer's own
# tokenization of the text): what DeepSeek's published templates render must be accepted and complete,
# anything else refused. V3's template writes "\n" between two calls; V3.1's writes nothing.
B, E, CB, CE, SEP = chat_markup.CALLS_BEGIN, chat_markup.CALLS_END, chat_markup.CALL_BEGIN, chat_markup.CALL_END, \
    chat_markup.SEP
PING = ("ping", "{}")
WEATHER = ("get_weather", '{"city":"Paris","days":3}')


def _call(parser: str, name: str, args: str) -> str:
    if parser == "deepseek_v3":
        return f"{CB}function{SEP}{name}\n```json\n{args}\n```{CE}"
    return f"{CB}{name}{SEP}{args}{CE}"


def _calls(parser: str, calls, gap: str = "", before: str = "", after: str = "") -> str:
    return B + before + gap.join(_call(parser, *c) for c in calls) + after + E


def _read(tok, grammar: str, text: str) -> str:
    """'complete' (every token taken, nothing but EOS may follow), 'prefix' (taken, not complete) or
    'refused'."""
    state = GrammarCompiler(tok, len(tok)).compile(tg.StructuredOutputsParams(grammar=grammar))
    for token in tok.encode(text, add_special_tokens=False):
        if not state.accept(token):
            return "refused"
    mask = state.bitmask()
    eos_allowed = mask[tok.eos_token_id // 8] >> (tok.eos_token_id % 8) & 1
    return "complete" if state.is_finished and eos_allowed else "prefix"


def _calls_grammar(tok, parser: str, parallel: bool = True, functions=FUNCTIONS) -> str:
    return tg.build([tg.tool_calls_rules(tok, PARSERS[parser], functions, parallel)], ["tool_calls"]).grammar


@pytest.mark.parametrize(("parser", "text", "expected"), [
    ("deepseek_v3", _calls("deepseek_v3", [PING]), "complete"),
    ("deepseek_v3", _calls("deepseek_v3", [PING, WEATHER], gap="\n"), "complete"),  # as V3's template writes
    ("deepseek_v3", _calls("deepseek_v3", [WEATHER, PING, WEATHER], gap="\n"), "complete"),
    ("deepseek_v3", _calls("deepseek_v3", [PING, WEATHER]), "refused"),  # V3 writes the newline
    ("deepseek_v3", _calls("deepseek_v3", [PING, WEATHER], gap="\n\n"), "refused"),  # one newline, not two
    ("deepseek_v3", _calls("deepseek_v3", [PING, WEATHER], gap=" "), "refused"),
    ("deepseek_v3", _calls("deepseek_v3", [PING, WEATHER], gap="\r\n"), "refused"),
    ("deepseek_v3", _calls("deepseek_v3", [PING, WEATHER], gap="\n "), "refused"),
    ("deepseek_v3", _calls("deepseek_v3", [PING], after="\n"), "refused"),  # only between two calls
    ("deepseek_v3", _calls("deepseek_v3", [PING], before="\n"), "refused"),
    ("deepseek_v31", _calls("deepseek_v31", [PING]), "complete"),
    ("deepseek_v31", _calls("deepseek_v31", [PING, WEATHER]), "complete"),  # as V3.1's template writes
    ("deepseek_v31", _calls("deepseek_v31", [PING, WEATHER], gap="\n"), "refused"),  # V3.1 writes no gap
])
def test_between_calls_exactly_what_the_template_writes(tok, parser, text, expected):
    assert _read(tok, _calls_grammar(tok, parser), text) == expected


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_the_markup_must_end(tok, parser):
    grammar = _calls_grammar(tok, parser)
    gap = PARSERS[parser].call_gap
    # After a call: the gap (then the next call) or the end.
    assert _read(tok, grammar, _calls(parser, [PING])[: -len(E)]) == "prefix"
    if gap:
        assert _read(tok, grammar, _calls(parser, [PING])[: -len(E)] + gap) == "prefix"
        assert _read(tok, grammar, _calls(parser, [PING])[: -len(E)] + gap + E) == "refused"
    assert _read(tok, grammar, _calls(parser, [PING]) + "\n") == "refused"  # nothing after the end
    assert _read(tok, grammar, "Sure." + _calls(parser, [PING])) == "refused"  # nothing before it


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_one_call_when_not_parallel(tok, parser):
    grammar = _calls_grammar(tok, parser, parallel=False)
    assert _read(tok, grammar, _calls(parser, [WEATHER])) == "complete"
    for gap in ("", "\n"):
        assert _read(tok, grammar, _calls(parser, [WEATHER, PING], gap=gap)) == "refused"


@pytest.mark.parametrize("parser", sorted(PARSERS))
@pytest.mark.parametrize("budget", [None, 32])
def test_reasoning_then_calls_when_the_prompt_opened_thinking(tok, parser, budget):
    """V3.1 with thinking on (the prompt ends in <think>): reasoning, </think>, then the enforced calls."""
    rules = [tg.thinking_rules(tok, budget, opened=True), tg.tool_calls_rules(tok, PARSERS[parser], FUNCTIONS, True)]
    grammar = tg.build(rules, ["thinking", "tool_calls"]).grammar
    calls = _calls(parser, [WEATHER, PING], gap=PARSERS[parser].call_gap)
    if budget is not None and demo.END_THINK not in tok.get_vocab():
        # Known limit (tool_grammar.thinking_rules): </think> spelled as text cannot end a budgeted
        # reasoning early; the budget's last token ends it.
        assert _read(tok, grammar, "Paris." + demo.END_THINK + calls) == "refused"
        return
    assert _read(tok, grammar, "The user wants Paris." + demo.END_THINK + calls) == "complete"
    assert _read(tok, grammar, demo.END_THINK + calls) == "complete"  # an empty reasoning
    assert _read(tok, grammar, "Paris." + demo.END_THINK + "Sure." + calls) == "refused"  # calls, nothing else
    assert _read(tok, grammar, "Paris." + demo.END_THINK) == "prefix"  # the calls are still owed
    # Calls written straight away do not end the output: the reasoning is still open (the marker tokens
    # cannot even be reasoning text; spelled as text, they are).
    assert _read(tok, grammar, calls) == ("refused" if CB in tok.get_vocab() else "prefix")


@pytest.mark.parametrize("parser", sorted(PARSERS))
@pytest.mark.parametrize(("prompt_end", "budget", "reasoning_first"), [
    ("<｜Assistant｜><think>", None, True),  # V3.1 with thinking on: the reasoning first, unbounded
    ("<｜Assistant｜><think>\n", 16, True),  # R1's template; a budget bounds the reasoning
    ("<｜Assistant｜></think>", None, False),  # V3.1 with thinking off: the calls at once
    ("<｜Assistant｜></think>", 16, False),  # a budget with nothing to bound
    ("<｜Assistant｜>", None, False),  # V3: no reasoning section
])
def test_the_server_puts_enforced_calls_after_an_open_reasoning(tok, parser, prompt_end, budget, reasoning_first):
    """tools.output_grammar and output_reading for tool_choice required, from the prompt's end."""
    tools = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in
             (("get_weather", SCHEMA), ("ping", None))]
    req = p.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools,
                                  tool_choice="required", thinking_token_budget=budget)
    plan = tools_plan.ChatPlan({}, parser, "required")
    so, origin = tools_plan.output_grammar(tok, req, plan, "<｜User｜>hi" + prompt_end)
    reading = tools_plan.output_reading(SimpleNamespace(reasoning_parser="deepseek_r1"), req, plan,
                                        "<｜User｜>hi" + prompt_end)
    assert origin == "tools" and reading.tool_parser == parser and reading.reasoning == reasoning_first
    calls = _calls(parser, [WEATHER, PING], gap=PARSERS[parser].call_gap)
    with_reasoning = "Paris, 3 days." + demo.END_THINK + calls
    right, wrong = (with_reasoning, calls) if reasoning_first else (calls, with_reasoning)
    assert _read(tok, so.grammar, wrong) != "complete"
    if budget is not None and reasoning_first and demo.END_THINK not in tok.get_vocab():
        return  # the text </think> cannot end a budgeted reasoning early (see above)
    assert _read(tok, so.grammar, right) == "complete"


def _read_params(tok, so, text: str) -> str:
    state = GrammarCompiler(tok, len(tok)).compile(so)
    for token in tok.encode(text, add_special_tokens=False):
        if not state.accept(token):
            return "refused"
    mask = state.bitmask()
    return "complete" if state.is_finished and mask[tok.eos_token_id // 8] >> (tok.eos_token_id % 8) & 1 else "prefix"


@pytest.mark.parametrize(("prompt_end", "response_format", "reasoning_first"), [
    # R1's template and V3.1 with thinking on open the reasoning: a JSON answer follows it, as calls do.
    ("<｜Assistant｜><think>\n", {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}, True),
    ("<｜Assistant｜><think>", {"type": "json_object"}, True),
    ("<｜Assistant｜></think>", {"type": "json_object"}, False),  # thinking off: the JSON at once
    ("<｜Assistant｜>", {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}, False),  # V3
])
def test_the_server_puts_a_json_answer_after_an_open_reasoning(tok, prompt_end, response_format, reasoning_first):
    req = p.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], response_format=response_format)
    plan = tools_plan.ChatPlan({}, None, "none")
    prompt = "<｜User｜>hi" + prompt_end
    so, origin = tools_plan.output_grammar(tok, req, plan, prompt)
    reading = tools_plan.output_reading(SimpleNamespace(reasoning_parser="deepseek_r1"), req, plan, prompt)
    assert origin == "response_format" and reading.reasoning == reasoning_first
    answer = json.dumps({"city": "Paris", "days": 3}, separators=(",", ":"))  # the grammar's JSON is compact
    with_reasoning = "Paris, 3 days." + demo.END_THINK + answer
    right, wrong = (with_reasoning, answer) if reasoning_first else (answer, with_reasoning)
    assert _read_params(tok, so, right) == "complete"
    assert _read_params(tok, so, wrong) != "complete"


@pytest.mark.parametrize(("structured", "answer", "wrong"), [
    ({"regex": "(yes|no)/[0-9]"}, "no/7", "maybe/7"),  # "/" is the Lark regex delimiter: escaped
    ({"choice": ['say "hi"', "c/d"]}, 'say "hi"', "c/e"),
])
def test_a_regex_or_choice_answer_follows_an_open_reasoning(tok, structured, answer, wrong):
    req = p.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], structured_outputs=structured)
    plan = tools_plan.ChatPlan({}, None, "none")
    prompt = "<｜User｜>hi<｜Assistant｜><think>\n"
    so, _ = tools_plan.output_grammar(tok, req, plan, prompt)
    reading = tools_plan.output_reading(SimpleNamespace(reasoning_parser="deepseek_r1"), req, plan, prompt)
    assert reading.reasoning
    assert _read_params(tok, so, "Hmm." + demo.END_THINK + answer) == "complete"
    assert _read_params(tok, so, "Hmm." + demo.END_THINK + wrong) == "refused"
    assert _read_params(tok, so, answer) != "complete"  # not inside the reasoning


def test_a_grammar_answer_holds_from_the_first_token_after_an_open_reasoning(tok):
    # A whole Lark grammar cannot be nested after the reasoning: it keeps the output (read as content).
    req = p.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                  structured_outputs={"grammar": 'start: "yes" | "no"'})
    plan = tools_plan.ChatPlan({}, None, "none")
    prompt = "<｜User｜>hi<｜Assistant｜><think>\n"
    so, _ = tools_plan.output_grammar(tok, req, plan, prompt)
    reading = tools_plan.output_reading(SimpleNamespace(reasoning_parser="deepseek_r1"), req, plan, prompt)
    assert so.grammar == 'start: "yes" | "no"' and not reading.reasoning
    assert _read_params(tok, so, "yes") == "complete"
    budget = req.model_copy(update={"thinking_token_budget": 8})
    with pytest.raises(Exception, match="structured_outputs.grammar"):
        tools_plan.output_grammar(tok, budget, plan, prompt)


@pytest.mark.parametrize(("structured", "budget"), [({"json": "[1, 2]"}, None), ({"json": "{not json"}, None),
                                                    ({"json": "[1, 2]"}, 4)])
def test_a_bad_json_schema_after_a_reasoning_section_is_a_400_naming_its_field(tok, structured, budget):
    req = p.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], structured_outputs=structured,
                                  thinking_token_budget=budget)
    with pytest.raises(APIError) as e:
        tools_plan.output_grammar(tok, req, tools_plan.ChatPlan({}, None, "none"),
                                  "<｜User｜>hi<｜Assistant｜><think>\n")
    assert e.value.status == 400 and e.value.param == "structured_outputs", e.value.message
