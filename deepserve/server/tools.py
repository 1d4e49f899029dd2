"""What a chat request's tools, tool_choice, chat_template_kwargs and thinking_token_budget ask of the
server: the template's variables, the grammar the output must follow, and whether tool calls are parsed
out of the text (server/tool_parsers.py).

tool_choice (OpenAI's default: "auto" with tools, else "none"):
  none      the tools are not shown to the model and nothing is parsed;
  auto      the model may call them (needs --enable-auto-tool-choice, as in vLLM); calls are parsed;
  required  and a named function: the grammar (server/tool_grammar.py) makes the output tool calls whose
            arguments match the function's schema; they are parsed like auto's.
Every mode but none needs --tool-call-parser: it names the markup the model writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepserve.chat_markup import END_THINK, THINK
from deepserve.sampling_params import StructuredOutputsParams
from deepserve.server import protocol as p
from deepserve.server import tool_grammar as tg
from deepserve.server.errors import bad_request
from deepserve.server.settings import ServerSettings
from deepserve.server.structured import structured_outputs_of
from deepserve.server.tool_parsers import PARSERS


@dataclass(frozen=True)
class ChatPlan:
    template_kwargs: dict[str, Any]  # variables for the chat template, tools among them, and how it ends
    tool_parser: str | None  # parse tool calls out of the output with this parser
    choice: str  # none | auto | required | named


def template_kwargs_of(settings: ServerSettings, requested: dict[str, Any] | None) -> dict[str, Any]:
    """The chat template's variables: --default-chat-template-kwargs under the request's own."""
    return {**settings.default_chat_template_kwargs, **(requested or {})}


def plan_chat(settings: ServerSettings, req: p.ChatCompletionRequest) -> ChatPlan:
    """Raises APIError(400) naming the field or the server flag a request needs."""
    choice = p.tool_choice_of(req)
    kwargs = {**template_kwargs_of(settings, req.chat_template_kwargs), **p.template_flags(req)}
    if choice == "none":
        return ChatPlan(kwargs, None, choice)
    if choice == "auto" and not settings.enable_auto_tool_choice:
        raise bad_request(_auto_refused(settings), param="tool_choice")
    if settings.tool_call_parser is None:
        raise bad_request("tools need the server flag --tool-call-parser (deepseek_v3 or deepseek_v31), which "
                          "names the markup the model writes its calls in", param="tools")
    for i, tool in enumerate(req.tools or []):
        _check_schema(tool.function.parameters, f"tools.{i}.function.parameters")
    kwargs["tools"] = [template_tool(t) for t in req.tools or []]
    return ChatPlan(kwargs, settings.tool_call_parser, choice)


def template_tool(tool: p.Tool) -> dict[str, Any]:
    # A function without `parameters` takes none (OpenAI); templates read function.parameters
    # unconditionally (tojson of an Undefined fails), so they get the schema the grammar enforces.
    d = tool.model_dump(exclude_none=True)
    d["function"].setdefault("parameters", dict(tg.NO_PARAMETERS))
    return d


def _auto_refused(settings: ServerSettings) -> str:
    # Only advise what this server would accept: required and named calls need a tool-call parser too.
    needs = 'tool_choice "auto" (the default when tools are given) needs the server flags --enable-auto-tool-choice'
    if settings.tool_call_parser is not None:
        return f'{needs}; or send tool_choice "required", a named function, or "none"'
    return (f"{needs} and --tool-call-parser (deepseek_v3 or deepseek_v31); \"required\" and a named function "
            'need --tool-call-parser too; without them send tool_choice "none" (the tools are then not used)')


@dataclass(frozen=True)
class OutputReading:
    """How a request's output text is read: split into reasoning and content, tool calls parsed out."""

    reasoning: bool = False
    tool_parser: str | None = None


def prompt_thinking(prompt_text: str, continuing: bool = False) -> str | None:
    """Where the prompt leaves the reasoning section: "closed" (it ends in </think>, as V3.1's template
    writes with thinking off), "open" (it ends in <think>: V3.1 with thinking on, R1's newer template),
    else None (the model opens it itself, or never). `continuing` (continue_final_message): the prompt ends
    inside the assistant's message, so its last marker decides: an unclosed <think> is open, anything else
    (a closed section, or none: the message's answer goes on) closed."""
    if continuing:
        return "open" if prompt_text.rfind(THINK) > prompt_text.rfind(END_THINK) else "closed"
    end = prompt_text.rstrip()
    return "closed" if end.endswith(END_THINK) else "open" if end.endswith(THINK) else None


def reasoning_first(req: p.ChatCompletionRequest, plan: ChatPlan, thinking: str | None) -> bool:
    """Whether a grammar on this output starts with a reasoning section (then the enforced answer): the one
    decision output_grammar builds from and output_reading reads by. A section the prompt opened comes first
    before enforced calls and a structured answer (free reasoning, as vLLM applies a grammar after the
    reasoning ends); a thinking budget asks for one; a prompt that closed it leaves none. A whole Lark
    grammar holds from the first token when the prompt opened the section (it cannot follow it)."""
    if thinking == "closed":
        return False
    if req.thinking_token_budget is not None:
        return True
    if thinking != "open":
        return False
    so = structured_outputs_of(req)[0]
    return plan.choice in ("required", "named") or (so is not None and tg.can_follow_reasoning(so))


def _enforced_from_first_token(req: p.ChatCompletionRequest, plan: ChatPlan, thinking: str | None) -> bool:
    # Tool calls or a structured answer enforced from the first output token: there is no reasoning in it.
    enforced = plan.choice in ("required", "named") or structured_outputs_of(req)[0] is not None
    return enforced and not reasoning_first(req, plan, thinking)


def output_reading(settings: ServerSettings, req: p.ChatCompletionRequest, plan: ChatPlan,
                   prompt_text: str) -> OutputReading:
    # No reasoning section in the output: the prompt closed it, or the grammar makes the output tool
    # calls or the structured answer from its first token (the reply is then content, never reasoning).
    thinking = prompt_thinking(prompt_text, req.continue_final_message)
    reasoning = thinking != "closed" and not _enforced_from_first_token(req, plan, thinking)
    return OutputReading(settings.reasoning_parser is not None and reasoning, plan.tool_parser)


def _check_schema(schema: dict | None, field: str) -> None:
    import llguidance

    if schema is None:
        return
    try:
        error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema))
    except (ValueError, TypeError) as e:
        error = str(e)
    if error:
        raise bad_request(f"{field} is not a usable JSON schema: {' '.join(error.split())[:400]}", param=field)


def output_grammar(tokenizer: Any, req: p.ChatCompletionRequest, plan: ChatPlan,
                   prompt_text: str) -> tuple[StructuredOutputsParams | None, str | None]:
    """(what the output must match, the request field that asked for it) after tools and the thinking
    budget are taken into account; None when the output is free."""
    so, origin = structured_outputs_of(req)
    answer_parts: list[list[str]] = []
    answer = None
    if plan.choice in ("required", "named"):
        functions = [t.function for t in req.tools or []]
        if plan.choice == "named":
            functions = [f for f in functions if f.name == req.tool_choice.function.name]
        parallel = plan.choice == "required" and req.parallel_tool_calls is not False
        answer_parts.append(tg.tool_calls_rules(tokenizer, PARSERS[plan.tool_parser],
                                                [f.model_dump() for f in functions], parallel))
        answer, origin = "tool_calls", "tools"
    budget = req.thinking_token_budget
    thinking = prompt_thinking(prompt_text, req.continue_final_message)
    if not reasoning_first(req, plan, thinking):  # the grammar, if any, holds from the first token
        return (tg.build(answer_parts, [answer]), origin) if answer is not None else (so, origin)
    if answer is None:
        if not tg.can_follow_reasoning(so):
            field = "structured_outputs.grammar" if origin == "structured_outputs" else origin
            raise bad_request(f"thinking_token_budget cannot be combined with {field}; it can with JSON, "
                              "regex or choice outputs, tools, or free text", param="thinking_token_budget")
        try:
            answer_parts.append(tg.answer_rules(so))
        except ValueError as e:  # the schema, regex or choice itself: name the field it came in
            raise bad_request(f"{origin}: {e}", param=origin) from None
        answer = "answer"
        origin = origin or "thinking_token_budget"
    # The reasoning, bounded by the budget when there is one, then the answer. Unbounded only in a section
    # the prompt opened: without it the calls or the JSON would be forced inside the reasoning.
    rules = tg.thinking_rules(tokenizer, budget, opened=thinking == "open")
    return tg.build([rules, *answer_parts], ["thinking", answer]), origin
