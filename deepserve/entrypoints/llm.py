"""The offline API, with vLLM's names: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
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


class LLM:
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
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        engine = self.llm_engine
        # Validate every request before adding any, so one bad prompt leaves the engine untouched.
        for (prompt, _), p in zip(prompt_list, params, strict=True):
            engine.input_processor.process("check", prompt, p)
        ids = [str(next(self._counter)) for _ in prompt_list]
        for request_id, (prompt, text), p in zip(ids, prompt_list, params, strict=True):
            engine.add_request(request_id, prompt, p, final_only=True, prompt_text=text)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation or a list of them, then generate."""
        from deepserve.loader.tokenizer import apply_chat_template

        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        texts = [apply_chat_template(tokenizer, conv, add_generation_prompt, **(chat_template_kwargs or {}))
                 for conv in conversations]
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
    if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    out = []
    for p in prompts:
        text = p if isinstance(p, str) else None
        if isinstance(p, dict):
            text = p.get("prompt")
            p = p.get("prompt_token_ids", text)
        if not isinstance(p, str | list):
            raise TypeError(f"a prompt must be a string, a list of token ids or a dict; got {type(p).__name__}")
        out.append((p, text))
    return out


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; give one, or one per prompt")
    return list(params)
