"""OpenAI request schemas (pydantic v2, strict) and their translation to SamplingParams.

Strict mode on purpose: `"n": 1.5`, `"temperature": "hot"`, `true` for a number, NaN and infinity all
fail with the field named, instead of being coerced. Unknown fields are rejected too (a typo such as
`temprature` must not silently sample at the default), except the OpenAI fields listed in
`_IGNORED`, which clients send routinely and which do not change what we generate.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, fields
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, FiniteFloat, ValidationError

from deepserve.sampling_params import SamplingParams
from deepserve.server.errors import APIError, bad_request
from deepserve.server.structured import structured_outputs_of

MAX_SEED = 2**64 - 1
MIN_SEED = -(2**63)
MAX_LOGPROBS = 20
COMPLETION_MAX_TOKENS = 16  # /v1/completions without max_tokens: OpenAI's and vLLM's default
# logit_bias entries a request may send: each is host work in every step the request samples
# (SamplingMetadata's index lists); banning a large part of the vocabulary is structured output's job.
MAX_LOGIT_BIAS = 1024
# Prompts one /v1/completions request may hold (OpenAI's list form): each runs as a request of its own.
MAX_PROMPTS = 256


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = 16
    max_stop: int = 8
    max_stop_chars: int = 256
    max_messages: int = 2048


def _utf8_clean(s: str) -> str:
    # JSON "\ud800" escapes decode to lone surrogates that no tokenizer can encode.
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains an unpaired UTF-16 surrogate at character {e.start}") from None
    return s


def _string_or_strings(value: Any) -> Any:
    # Before the union's own checks: for a value of neither shape they report only one member ("stop: Input
    # should be a valid string") and hide that a list is taken too. The message is SamplingParams' own.
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value)):
        return value
    raise ValueError(f"must be a string or a list of strings, got {json.dumps(value, default=repr)[:80]}")


def _token_id_key(key: str) -> str:
    if not (key.isascii() and key.isdigit() and len(key) <= 10):
        raise ValueError(f"a key must be a token id (up to 10 decimal digits), got {key[:40]!r}")
    return key


def _one_prompt_shape(value: Any) -> Any:
    # Before the union's checks: a list mixing shapes (["hi", 5], ["hi", [5]]) failed every member, and the
    # error shown was the first member's about element 0, the valid one. This names the element that differs.
    if not isinstance(value, list) or not value:
        return value
    kinds = [_prompt_item_kind(x) for x in value]
    odd = next((i for i, k in enumerate(kinds) if k != kinds[0] or k is None), None)
    if odd is not None:
        after = f" after {json.dumps(value[0], default=repr)[:40]}" if odd else ""
        raise ValueError("must be a string, a list of token ids, or a list of strings or of token-id lists: "
                         f"element {odd} is {json.dumps(value[odd], default=repr)[:40]}{after}")
    return value


def _prompt_item_kind(x: Any) -> str | None:
    if isinstance(x, bool):
        return None
    return "int" if isinstance(x, int) else "str" if isinstance(x, str) else "list" if isinstance(x, list) else None


Text = Annotated[str, AfterValidator(_utf8_clean)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Prob = Annotated[FiniteFloat, Field(ge=0.0, le=1.0)]
Penalty = Annotated[FiniteFloat, Field(ge=-2.0, le=2.0)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names, vLLM extras)."""

    model: Annotated[str, Field(max_length=512)] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[FiniteFloat, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[FiniteFloat, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None
    min_p: Prob | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[FiniteFloat, Field(gt=0.0, le=10.0)] | None = None
    seed: Annotated[int, Field(ge=MIN_SEED, le=MAX_SEED)] | None = None
    stop: Annotated[Text | list[Text], BeforeValidator(_string_or_strings)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's extra: each prompt token's logprob and the top k at its position (never streamed, as in vLLM).
    prompt_logprobs: Annotated[int, Field(ge=-1, le=MAX_LOGPROBS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's: token id (a decimal string, JSON's keys) -> a bias of -100..100 added to its logit.
    logit_bias: Annotated[dict[Annotated[str, AfterValidator(_token_id_key)],
                               Annotated[FiniteFloat, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    # Structured output (server/structured.py): OpenAI's response_format, vLLM's structured_outputs and
    # its older guided_* names; at most one per request.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Accepted and ignored: bookkeeping fields of OpenAI's API that do not change generation.
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]  # OpenAI's rule for function names


class FunctionCall(_Strict):
    name: FunctionName
    arguments: Text  # JSON text, as the model wrote it


class ToolCall(_Strict):
    """A call in an assistant message of the history (what an earlier response returned)."""

    id: Annotated[str, Field(max_length=256)] | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Strict):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema for the arguments; none: any object
    strict: bool | None = None  # arguments are always held to the schema when a call is enforced


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Annotated[str, Field(max_length=256)] | None = None
    reasoning_content: Text | None = None  # echoed back by clients of R1; dropped before templating
    tool_calls: list[ToolCall] | None = None  # assistant messages only
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None  # tool messages only


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # variables for the chat template (V3.1: thinking)
    thinking_token_budget: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None  # most tokens of reasoning
    # vLLM's: the template's assistant header after the messages (a new reply), or (continue_final_message,
    # with add_generation_prompt false) the last message left open for the output to continue.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Rejected below with a clear message; declared so the error is not "unrecognized argument".
    chat_template: Any = None


class CompletionRequest(_SamplingFields):
    prompt: Annotated[Text | Annotated[list[TokenId], Field(min_length=1)] | list[Text] | list[list[TokenId]],
                      BeforeValidator(_one_prompt_shape)]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    # 0 with echo scores the prompt and generates nothing (vLLM's and the legacy OpenAI API's form, which
    # evaluation harnesses send for loglikelihoods); _check_completion refuses 0 without echo.
    max_tokens: Annotated[int, Field(ge=0)] | None = None


class TokenizeRequest(_Strict):
    model: Annotated[str, Field(max_length=512)] | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    # None: True for a prompt; False for messages, whose chat template writes the special tokens itself
    # (what a chat request gets). True with messages adds them once more, as asked (vLLM's meaning).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # with messages: as a chat request's, over the server's


class DetokenizeRequest(_Strict):
    model: Annotated[str, Field(max_length=512)] | None = None
    tokens: list[TokenId]


def too_long_number_message() -> str:
    return f"request body holds a number too long to read (over {sys.get_int_max_str_digits():,} digits)"


def parse_body(raw: bytes, model: type[_Strict], limits: RequestLimits) -> Any:
    """Bytes of a request body → a validated request, or APIError(400) naming the field."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8 (invalid byte at offset {e.start})") from None
    try:
        data = json.loads(text)  # NaN/Infinity parse to floats and then fail the field's finite check
    except json.JSONDecodeError as e:
        where = f"line {e.lineno}, column {e.colno}"
        raise bad_request(f"request body is not valid JSON: {e.msg} ({where})") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    except ValueError:  # the one other failure of json.loads: an integer literal past Python's digit limit
        raise bad_request(too_long_number_message()) from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    if isinstance(req, TokenizeRequest):
        _check_tokenize(req)
    if not isinstance(req, _SamplingFields):
        return req
    _check_common(req, limits)
    if isinstance(req, ChatCompletionRequest):
        check_chat(req, limits)
    else:
        _check_completion(req)
    return req


def _check_tokenize(req: TokenizeRequest) -> None:
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt or messages", param="prompt")
    # The chat template's inputs: a plain prompt goes through no template, so they would be ignored silently.
    if req.prompt is not None and req.chat_template_kwargs:
        raise bad_request("chat_template_kwargs applies to messages only: a prompt is tokenized as it is; send "
                          "messages instead, or leave chat_template_kwargs out", param="chat_template_kwargs")
    if req.prompt is not None and not req.add_generation_prompt:
        raise bad_request("add_generation_prompt applies to messages only: a prompt is tokenized as it is; send "
                          "messages instead, or leave add_generation_prompt out", param="add_generation_prompt")
    if req.prompt is not None and req.continue_final_message:
        raise bad_request("continue_final_message applies to messages only: a prompt is tokenized as it is; send "
                          "messages instead, or leave continue_final_message out", param="continue_final_message")
    _check_continuation(req)
    _check_template_kwargs(req.chat_template_kwargs)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "constrained-str"}


def validation_error(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    # For a union field every member reports; the deepest location is the most specific complaint.
    err = max((x for x in errors if x["loc"][:1] == errors[0]["loc"][:1]), key=lambda x: len(x["loc"]))
    # Union members appear in `loc` as type tags ("str", "list[int]"); keep only the field path.
    parts = [str(p) for p in err["loc"] if isinstance(p, int) or ("[" not in p and p not in _TYPE_TAGS)]
    param = ".".join(parts) or None
    if err["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param=param)
    msg = err["msg"].removeprefix("Value error, ")
    return bad_request(f"{param}: {msg}" if param else msg, param=param)


def _check_common(req: _SamplingFields, limits: RequestLimits) -> None:
    if req.n > limits.max_n:
        raise bad_request(f"n must be <= {limits.max_n}, got {req.n}", param="n")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported (it must equal n)", param="best_of")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    stops = stop_list(req)
    if len(stops) > limits.max_stop:
        raise bad_request(f"at most {limits.max_stop} stop sequences are allowed, got {len(stops)}", "stop")
    for s in stops:
        if not s or len(s) > limits.max_stop_chars:
            raise bad_request(f"each stop sequence must have 1 to {limits.max_stop_chars} characters", "stop")
    if req.max_tokens is not None and req.min_tokens > req.max_tokens:
        raise bad_request("min_tokens must be <= max_tokens", param="min_tokens")
    if req.prompt_logprobs is not None and req.prompt_logprobs < 0:
        raise bad_request(f"prompt_logprobs must be 0 to {MAX_LOGPROBS} (vLLM's -1, the whole vocabulary, is not "
                          "supported)", param="prompt_logprobs")
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs is not available with stream: true (as in vLLM): send the request "
                          "without stream, or leave prompt_logprobs out", param="prompt_logprobs")
    structured_outputs_of(req)  # conflicting or malformed structured-output fields: 400 before tokenizing


# apply_chat_template's own arguments: a template variable of these names would replace what we pass.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents", "tokenize",
                                      "add_generation_prompt", "continue_final_message", "chat_template",
                                      "return_dict", "return_tensors", "tokenizer_kwargs", "padding",
                                      "truncation", "max_length", "return_assistant_tokens_mask"})


def check_chat(req: ChatCompletionRequest, limits: RequestLimits) -> None:
    if req.chat_template is not None:
        raise bad_request("a chat template cannot be supplied by the request; the model's own is used "
                          "(its variables can be set with chat_template_kwargs)", "chat_template")
    _check_template_kwargs(req.chat_template_kwargs)
    _check_continuation(req)
    _check_tools(req)
    for i, m in enumerate(req.messages):
        if m.tool_calls is not None and m.role != "assistant":
            raise bad_request(f"messages.{i}.tool_calls is only allowed in assistant messages",
                              param=f"messages.{i}.tool_calls")
        if m.role == "tool" and not m.tool_call_id:
            raise bad_request(f"messages.{i}.tool_call_id is required for a message of role tool",
                              param=f"messages.{i}.tool_call_id")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    if len(req.messages) > limits.max_messages:
        raise bad_request(f"at most {limits.max_messages} messages are allowed", param="messages")
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        if req.max_tokens != req.max_completion_tokens:
            raise bad_request("set max_completion_tokens or max_tokens, not both", "max_completion_tokens")


def _check_continuation(req: ChatCompletionRequest | TokenizeRequest) -> None:
    # The template either starts a new assistant reply or leaves the last message open, not both (vLLM refuses
    # the pair the same way; transformers' apply_chat_template would raise inside the template).
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request("continue_final_message continues the last message instead of starting a new reply: "
                          "set add_generation_prompt to false with it", param="continue_final_message")


def _check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    reserved = sorted(set(kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise bad_request(f"chat_template_kwargs.{reserved[0]} cannot be set: the server passes it to the "
                          "template itself", param=f"chat_template_kwargs.{reserved[0]}")


def _check_tools(req: ChatCompletionRequest) -> None:
    names = [t.function.name for t in req.tools or []]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad_request(f"tools.{i}.function.name: {name!r} is defined twice", f"tools.{i}.function.name")
    choice = req.tool_choice
    if choice is not None and choice != "none" and not req.tools:
        raise bad_request("tool_choice needs tools: give the functions the model may call", "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise bad_request(f"tool_choice.function.name: {choice.function.name!r} is not one of the tools "
                          f"({', '.join(names)})", param="tool_choice.function.name")
    if tool_choice_of(req) in ("required", "named") and structured_outputs_of(req)[1] is not None:
        raise bad_request("a required or named tool_choice cannot be combined with "
                          f"{structured_outputs_of(req)[1]}: the output is the tool calls", "tool_choice")
    if tool_choice_of(req) in ("required", "named") and stop_list(req):
        # A stop string could cut the enforced arguments mid-JSON: the calls would no longer validate.
        raise bad_request("stop cannot be combined with a required or named tool_choice (it could end the "
                          "output inside a call's arguments); leave stop out", "stop")
    if tool_choice_of(req) in ("required", "named") and req.stop_token_ids:
        # The same for a stop token the grammar forces (a tool-call marker ends the calls mid-markup).
        raise bad_request("stop_token_ids cannot be combined with a required or named tool_choice (a stop "
                          "token could end the output inside a call); leave stop_token_ids out", "stop_token_ids")


def tool_choice_of(req: ChatCompletionRequest) -> str:
    """none | auto | required | named, with OpenAI's default: auto when there are tools, else none."""
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        return "named"
    if not req.tools:
        return "none"
    return choice or "auto"


def _check_completion(req: CompletionRequest) -> None:
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens 0 is only allowed with echo: true (it returns the prompt, with its "
                          "logprobs when logprobs is set, and generates nothing)", param="max_tokens")
    prompts = prompt_list(req)  # never empty: [] is one (empty) prompt
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
    for i, prompt in enumerate(prompts):
        if prompt in ("", []):  # "", [""] and [[]] alike
            raise bad_request("prompt must not be empty", param="prompt" if len(prompts) == 1 else f"prompt.{i}")


def stop_list(req: _SamplingFields) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


def prompt_list(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: a string or one token-id list is one prompt; a list of them is that many."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], str | list):
        return list(p)
    return [p]


def single_prompt(req: CompletionRequest) -> str | list[int]:
    """The prompt of a request that holds one (split_prompts makes every part such a request)."""
    return prompt_list(req)[0]


def split_prompts(req: CompletionRequest) -> list[CompletionRequest]:
    """One request per prompt, each with every other field as sent."""
    prompts = prompt_list(req)
    return [req] if len(prompts) == 1 else [req.model_copy(update={"prompt": prompt}) for prompt in prompts]


def scores_prompt_only(req: _SamplingFields) -> bool:
    """A completion with echo and max_tokens 0: the engine runs it for one token, which the server drops
    (serving.prompt_only), so the answer is the prompt and its logprobs alone."""
    return isinstance(req, CompletionRequest) and req.echo and req.max_tokens == 0


def max_tokens_of(req: _SamplingFields) -> int | None:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


def num_prompt_logprobs(req: _SamplingFields) -> int | None:
    """The prompt logprobs the engine computes: the request's, or with echo and logprobs (vLLM's rule) as many
    as `logprobs`, which the echoed prompt tokens carry."""
    if isinstance(req, CompletionRequest) and req.echo and req.prompt_logprobs is None:
        return req.logprobs
    return req.prompt_logprobs


def template_flags(req: ChatCompletionRequest | TokenizeRequest) -> dict[str, bool]:
    """What the chat template is asked to end the prompt with (apply_chat_template's own arguments)."""
    return {"add_generation_prompt": req.add_generation_prompt, "continue_final_message": req.continue_final_message}


def num_logprobs(req: _SamplingFields) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


_PARAM_NAMES = frozenset(f.name for f in fields(SamplingParams))


def field_named_in(message: str) -> str | None:
    """The first sampling field a validation message names ("min_tokens (9) must be <= max_tokens
    (4)" → min_tokens), so a 400 raised below the schema can still point at the field."""
    return next((w for w in re.findall(r"[a-z_]+", message) if w in _PARAM_NAMES), None)


def to_sampling_params(req: _SamplingFields, default_max_tokens: int | None) -> SamplingParams:
    """Only fields the client set are passed, so SamplingParams keeps vLLM's defaults for the rest."""
    kwargs: dict[str, Any] = {
        "n": req.n,
        "max_tokens": 1 if scores_prompt_only(req) else max_tokens_of(req) or default_max_tokens,
        "stop": stop_list(req),
        "stop_token_ids": list(req.stop_token_ids or []),
        "min_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "logprobs": num_logprobs(req),
        "prompt_logprobs": num_prompt_logprobs(req),
        "structured_outputs": structured_outputs_of(req)[0],
        "logit_bias": {int(token): bias for token, bias in req.logit_bias.items()} if req.logit_bias else None,
    }
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:  # anything our schema let through but SamplingParams refuses
        raise bad_request(str(e), param=field_named_in(str(e))) from None
