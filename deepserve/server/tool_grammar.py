"""Grammars that enforce tool calls and a thinking budget, as llguidance Lark text for the existing
structured-output path (StructuredOutputsParams(grammar=...), engine/grammar.py).

- tool_choice "required" or a named function: the whole output is the model's tool-call markup
  (tool_parsers.Format), each call's arguments constrained by `%json` to that function's parameter
  schema, so the arguments always validate.
- thinking_token_budget: the output starts inside the reasoning section; at most `budget` tokens of it
  (llguidance's max_tokens on the thinking lexeme), then `</think>` is the only token allowed, then the
  answer (free text, the tool-call markup, or the response_format schema).
- enforced tool calls after a prompt that opened the reasoning (DeepSeek-V3.1 with `thinking: true`, R1's
  template): free reasoning first, then `</think>`, then the calls, so the calls are not forced into the
  reasoning section.

A marker that is one token of the tokenizer is written as that token (`<[id]>`), so the model cannot
spell it out of smaller pieces and the parsers see exactly what the template writes; otherwise it is
written as its text.
"""

from __future__ import annotations

import json
from typing import Any

from deepserve.chat_markup import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, END_THINK, SEP, THINK
from deepserve.sampling_params import StructuredOutputsParams
from deepserve.server.tool_parsers import Format

# The reasoning text never holds the closing tag itself: the grammar's own `</think>` closes it.
_THINK_TEXT = "/(?s:.*)/ & ~/(?s:.*)<\\/think>(?s:.*)/"
_ANY_TEXT = "/(?s:.*)/"
# OpenAI: a function defined without parameters takes none, so its arguments are {}.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def marker(tokenizer: Any, text: str) -> str:
    """The Lark spelling of a markup string: its token when it is one, else its text."""
    vocab = tokenizer.get_vocab()
    token_id = vocab.get(text)
    return f"<[{token_id}]>" if token_id is not None else _lit(text)


def _json_rule(schema: dict) -> str:
    # Compact JSON: a model (the demo's random weights most of all) may otherwise spend its tokens on spaces.
    own = schema.get("x-guidance")
    schema = {**schema, "x-guidance": {"whitespace_flexible": False, **(own if isinstance(own, dict) else {})}}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def tool_calls_rules(tokenizer: Any, fmt: Format, functions: list[dict], parallel: bool) -> list[str]:
    """Rules ending in `tool_calls`: one call (parallel False) or several, of the given functions."""
    mk = {m: marker(tokenizer, m) for m in (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)}
    rules = [f"tool_calls: {mk[CALLS_BEGIN]} {_calls(fmt, parallel)} {mk[CALLS_END]}",
             "call: " + " | ".join(f"fn{i}" for i in range(len(functions)))]
    for i, fn in enumerate(functions):
        if fmt.type_prefix:  # V3: "function" <sep> NAME "\n```json\n" ARGS "\n```"
            head = f"{mk[CALL_BEGIN]} {_lit(fmt.type_prefix.removesuffix(SEP))} {mk[SEP]} " \
                   f"{_lit(fn['name'] + fmt.args_open)}"
        else:  # V3.1: NAME <sep> ARGS
            head = f"{mk[CALL_BEGIN]} {_lit(fn['name'])} {mk[SEP]}"
        tail = f"{_lit(fmt.args_close)} {mk[CALL_END]}" if fmt.args_close else mk[CALL_END]
        rules.append(f"fn{i}: {head} args{i} {tail}")
        rules.append(f"args{i}: {_json_rule(fn.get('parameters') or NO_PARAMETERS)}")
    return rules


def _calls(fmt: Format, parallel: bool) -> str:
    """One call, or calls with exactly the template's gap between each two (V3: one "\\n"; V3.1: nothing),
    so a real model's second call is written as its template taught it. After each CALL_END only the
    gap (then, necessarily, the next call) or CALLS_END may come, so the markup has to end in CALLS_END.
    Required, not optional: an optional gap gives a model that does not know the format (the demo's
    random one) two ways to go on and one to stop after each call, and its calls then ran on to
    max_tokens in a test; free whitespace would be worse still."""
    if not parallel:
        return "call"
    gap = f"{_lit(fmt.call_gap)} " if fmt.call_gap else ""
    return f"call ({gap}call)*"


def answer_rules(so: StructuredOutputsParams | None) -> list[str]:
    """Rules ending in `answer` for what follows the reasoning: free text, the JSON of a response_format or
    structured_outputs.json, or a regex or choice. A whole Lark grammar cannot be nested (its rule names
    could be ours): ValueError."""
    if so is None:
        return ["answer: ANSWER_TEXT", f"ANSWER_TEXT: {_ANY_TEXT}"]
    if so.json is not None:
        schema = json.loads(so.json) if isinstance(so.json, str) else so.json  # JSONDecodeError: a ValueError
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return [f"answer: {_json_rule(schema)}"]
    if so.json_object:
        return [f"answer: {_json_rule({'type': 'object'})}"]
    if so.regex is not None:
        return [f"answer: {_start_body('regex', so.regex)}"]
    if so.choice is not None:
        return [f"answer: {_start_body('choice', json.dumps(so.choice))}"]
    raise ValueError("a grammar cannot follow a reasoning section")


def can_follow_reasoning(so: StructuredOutputsParams | None) -> bool:
    return so is None or so.grammar is None


def _start_body(kind: str, text: str) -> str:
    # llguidance's own translation of a regex or choice into Lark (its escaping of "/" and quotes), as the
    # body of our `answer` rule: "start: BODY" on one line.
    import llguidance

    grammar = llguidance.grammar_from(kind, text)
    lark = json.loads(grammar)["grammars"][0]["lark_grammar"] if grammar.lstrip().startswith("{") else grammar
    if not lark.startswith("start: ") or "\n" in lark.strip():
        raise ValueError(f"a {kind} this server cannot place after a reasoning section")
    return lark.removeprefix("start: ").strip()


def thinking_rules(tokenizer: Any, budget: int | None, opened: bool) -> list[str]:
    """Rules ending in `thinking`: [<think>] reasoning, then </think>; at most `budget` tokens of it, or
    as many as max_tokens leaves when budget is None.
    opened: the prompt already ends inside the reasoning section (the template wrote <think>)."""
    open_tag = "" if opened else marker(tokenizer, THINK) + " "
    if budget == 0:
        return [f"thinking: {open_tag}{marker(tokenizer, END_THINK)}"]
    end = marker(tokenizer, END_THINK)
    if budget is None and not end.startswith("<["):
        # </think> spelled as text: llguidance's lexer is greedy, so a reasoning lexeme followed by the
        # text "</think>" could never end; a lazy lexeme with that suffix ends at its first </think>.
        return [f"thinking: {open_tag}reasoning", f"reasoning[suffix={end}]: {_ANY_TEXT}"]
    # A budget ends the lexeme after `budget` tokens, and </think> follows. (Spelled as text, </think>
    # cannot end it sooner, for the reason above: the reasoning then always takes its whole budget.)
    bound = "" if budget is None else f"[max_tokens={budget}]"
    return [f"thinking: {open_tag}reasoning {end}",
            f"reasoning{bound}: REASONING_TEXT",
            f"REASONING_TEXT: {_THINK_TEXT}"]


def build(rules_by_part: list[list[str]], parts: list[str]) -> StructuredOutputsParams:
    lines = ["start: " + " ".join(parts)] + [r for rules in rules_by_part for r in rules]
    return StructuredOutputsParams(grammar="\n".join(lines) + "\n")
