"""The tool-call and thinking-budget grammars, compiled by the engine's GrammarCompiler for the demo
tokenizer and walked with random tokens among those each mask allows (no model: only the grammar decides).
Arguments are checked with jsonschema; the budget by counting the sampled tokens between the markers."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from deepserve import demo
from deepserve.engine.grammar import GrammarCompiler
from deepserve.server import tool_grammar as tg
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
