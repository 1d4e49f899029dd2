"""The offline API, with vLLM's names: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from tqdm.auto import tqdm

from deepserve.config import EngineArgs
from deepserve.engine.llm_engine import LLMEngine
from deepserve.engine.outputs import RequestOutput
from deepserve.heap import heap_frozen_while_generating
from deepserve.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]  # text, token ids, or {"prompt": ...} / {"prompt_token_ids": [...]}
Params = SamplingParams | dict[str, Any]  # a dict: SamplingParams' fields, as SamplingParams(**it)


class LLM:
    """Tensor parallelism (tensor_parallel_size > 1) starts one process per rank, and each imports the main
    script again: a script must build the LLM under `if __name__ == "__main__":` (vLLM's rule too); without
    it the ranks exit at once and the error says so. trust_remote_code (vLLM's) is accepted and has no
    effect: deepserve never runs a checkpoint's remote code (EngineArgs.trust_remote_code)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        known = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s) {unknown}; known: {sorted(known - {'model'})}")
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: Params | Sequence[Params] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        engine = self.llm_engine
        # Validate every request before adding any, so one bad prompt leaves the engine untouched.
        for i, ((prompt, _), p) in enumerate(zip(prompt_list, params, strict=True)):
            try:
                engine.input_processor.process("check", prompt, p)
            except (ValueError, TypeError) as e:
                if len(prompt_list) == 1:
                    raise
                # Which of a list failed: the message alone (a length, a token id) does not say.
                raise type(e)(f"prompts[{i}]: {e}") from None
        ids = [str(next(self._counter)) for _ in prompt_list]
        for request_id, (prompt, text), p in zip(ids, prompt_list, params, strict=True):
            engine.add_request(request_id, prompt, p, final_only=True, prompt_text=text)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: Params | Sequence[Params] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation or a list of them, then generate.
        Messages, tools, continue_final_message and chat_template_kwargs mean what they mean in a
        /v1/chat/completions request and are checked the same way. `tools` are shown to the template (as
        vLLM's LLM.chat does); the model's calls stay in the output text, unparsed. `chat_template` is
        refused, as the server refuses it: the checkpoint's own template is used."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        texts = [_chat_text(tokenizer, conv, tools, chat_template, add_generation_prompt, continue_final_message,
                            chat_template_kwargs) for conv in conversations]
        # The template writes the special tokens itself; encoding must not add a second BOS.
        prompts = [{"prompt_token_ids": tokenizer.encode(t, add_special_tokens=False), "prompt": t} for t in texts]
        return self.generate(prompts, sampling_params, use_tqdm)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (GPU and host tier), so the next generate computes its prompts
        in full, e.g. a benchmark's second run. False, and nothing changed, while requests are unfinished."""
        return self.llm_engine.reset_prefix_cache()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            with heap_frozen_while_generating():
                while len(finished) < len(ids):
                    for output in engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in finished])
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[tuple[str | list[int], str | None]]:
    """(what the engine gets, the text to report as the prompt) per prompt."""
    if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and _is_token_id(prompts[0])):
        prompts = [prompts]
    prompts = list(prompts)
    out = []
    for i, p in enumerate(prompts):
        where = f"prompts[{i}]: " if len(prompts) > 1 else ""  # which of a list, as generate's other checks say
        text = p if isinstance(p, str) else None
        if isinstance(p, dict):
            text = p.get("prompt")
            p = p.get("prompt_token_ids", text)
        if not isinstance(p, str | list):
            raise TypeError(f"{where}a prompt must be a string, a list of token ids or a dict; got {type(p).__name__}")
        if isinstance(p, list):
            p = _token_ids(p, where)
        out.append((p, text))
    return out


def _token_ids(ids: list, where: str) -> list[int]:
    """The list as plain ints (numpy's too: they would reach the tensor-parallel step message, which msgpack
    writes), or a TypeError naming the first item that is no integer. Plain ints, the common case, pass in
    one quick scan: W1's prompts are inside the timed generate."""
    if all(type(t) is int for t in ids):
        return ids
    bad = next((j for j, t in enumerate(ids) if not _is_token_id(t)), None)
    if bad is not None:
        raise TypeError(f"{where}a list prompt holds token ids (integers); item {bad} is "
                        f"{type(ids[bad]).__name__} {ids[bad]!r:.40}")
    return [int(t) for t in ids]


def _is_token_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _chat_text(tokenizer: Any, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               chat_template: str | None, add_generation_prompt: bool, continue_final_message: bool,
               chat_template_kwargs: dict[str, Any] | None) -> str:
    """The prompt text of one conversation, through the server's own path: the request model and its checks
    (server/protocol.py), its message and tool shapes, then the template (loader/tokenizer.py)."""
    from pydantic import ValidationError

    from deepserve.loader.tokenizer import apply_chat_template
    from deepserve.server import protocol as p
    from deepserve.server.errors import APIError
    from deepserve.server.serving import template_message
    from deepserve.server.tools import template_tool

    body = {"messages": conversation, "tools": tools, "chat_template": chat_template,
            "add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
            "chat_template_kwargs": chat_template_kwargs}
    try:
        try:
            req = p.ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise p.validation_error(e) from None
        # No message limit offline: the server's is against a client's load, not a property of the model.
        p.check_chat(req, p.RequestLimits(max_messages=max(len(req.messages), 1)))
    except APIError as e:
        raise ValueError(e.message) from None
    kwargs = {**(req.chat_template_kwargs or {}), **p.template_flags(req)}
    if req.tools:
        kwargs["tools"] = [template_tool(t) for t in req.tools]
    return apply_chat_template(tokenizer, [template_message(m) for m in req.messages], **kwargs)


def _as_params_list(params: Params | Sequence[Params] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams | dict):
        return [_as_params(params, "sampling_params")] * n
    if not isinstance(params, Sequence) or isinstance(params, str):
        raise TypeError(f"sampling_params must be a SamplingParams, a dict of its fields, or a list of them (one "
                        f"per prompt); got {type(params).__name__}")
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; give one, or one per prompt")
    return [_as_params(p, f"sampling_params[{i}]") for i, p in enumerate(params)]


def _as_params(params: Any, name: str) -> SamplingParams:
    """A SamplingParams as given, or one built from a dict of its fields (vLLM takes only the object; a dict
    used to fail deep inside with an AttributeError)."""
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, dict):
        try:
            return SamplingParams(**params)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}: {e}") from None
    raise TypeError(f"{name} must be a SamplingParams or a dict of its fields, got {type(params).__name__}")
