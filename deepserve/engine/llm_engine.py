"""LLMEngine: the front end and the EngineCore in one process (offline use, tests, the CLI)."""

from __future__ import annotations

from typing import Any

from deepserve.config import EngineArgs, EngineConfig
from deepserve.engine.core import EngineCore
from deepserve.engine.grammar import GrammarCompiler
from deepserve.engine.outputs import RequestOutput
from deepserve.engine.processors import InputProcessor, OutputProcessor
from deepserve.engine.scheduler import SchedulerStats
from deepserve.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, core: EngineCore, tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        self.config = config
        self.core = core
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(config, tokenizer, eos_token_ids)
        self.output_processor = OutputProcessor(tokenizer)
        # One process: the core reuses the front end's compiled grammars (the compile that validated a
        # request is the one its matcher is copied from).
        if tokenizer is not None:
            if core.grammars is None:
                core.grammars = GrammarCompiler(tokenizer, config.model.hf_config.vocab_size)
            self.input_processor.grammars = core.grammars

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        """The tokenizer first: the core warms its grammar compiler before the model loads (EngineCore.from_config)."""
        from deepserve.loader.tokenizer import load_eos_token_ids, load_tokenizer

        config = args.create_engine_config()
        if config.model.tokenizer is None:
            eos = getattr(config.model.hf_config, "eos_token_id", None)
            eos_ids = frozenset([eos] if isinstance(eos, int) else eos or [])
            return cls(config, EngineCore.from_config(config), None, eos_ids)
        tokenizer = load_tokenizer(config.model.tokenizer)
        core = EngineCore.from_config(config, grammars=GrammarCompiler(tokenizer, config.model.hf_config.vocab_size))
        return cls(config, core, tokenizer, load_eos_token_ids(config.model.model, tokenizer))

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, final_only: bool = False,
                    prompt_text: str | None = None) -> None:
        """Raises ValueError for a request the engine cannot serve; nothing else is affected.

        final_only: step() reports the request once, when it finishes (offline generate).
        prompt_text: the text to report as the prompt when `prompt` is token ids (chat)."""
        if request_id in self.output_processor.states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        core_requests = self.input_processor.process(request_id, prompt, params, arrival_time)
        text = prompt if isinstance(prompt, str) else prompt_text
        self.output_processor.add_request(request_id, text, core_requests, final_only)
        for core_request in core_requests:
            self.core.add_request(core_request)

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        core_ids = [cid for rid in ids for cid in self.output_processor.abort_request(rid)]
        self.core.abort_requests(core_ids)

    def step(self) -> list[RequestOutput]:
        outputs, stopped = self.output_processor.process(self.core.step())
        if stopped:
            self.core.abort_requests(stopped)  # their stop string matched; free their blocks now
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or self.core.has_unfinished_requests()

    def stats(self) -> SchedulerStats:
        return self.core.stats()

    def reset_prefix_cache(self) -> bool:
        return not self.has_unfinished_requests() and self.core.reset_prefix_cache()
