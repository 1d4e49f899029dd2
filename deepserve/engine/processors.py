"""The front end of the engine: requests in (validate, tokenize, fan out n), outputs out
(detokenize, stop strings, gather n completions into one RequestOutput).

Runs beside the EngineCore in `LLMEngine`, or in the API server process when the core runs in its
own process. Torch-free; the tokenizer is passed in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from deepserve.config import EngineConfig
from deepserve.engine.core import EngineCoreOutput, EngineCoreRequest
from deepserve.engine.detokenizer import IncrementalDetokenizer, backend_decode
from deepserve.engine.grammar import GrammarCompiler
from deepserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from deepserve.engine.token_bytes import TokenBytes
from deepserve.sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        self.max_model_len = config.model.max_model_len
        self.pipeline_parallel = config.parallel.pipeline_parallel_size > 1
        self.vocab_size = config.model.hf_config.vocab_size
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(eos_token_ids)
        self.grammars: GrammarCompiler | None = None  # built at the first structured-output request

    def warm_grammars(self) -> None:
        """Build this front end's GrammarCompiler now (GrammarCompiler.warm_up): the API server's, at start-up,
        while its engine core loads in its own process."""
        if self.tokenizer is not None:
            self._grammar_compiler().warm_up()

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this engine runs with skip_tokenizer_init: "
                                 "pass token ids")
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                arrival_time: float | None = None) -> list[EngineCoreRequest]:
        """Validate one request and turn it into core requests: one, or n children for n > 1."""
        token_ids = self.tokenize(prompt)
        params = self._check(token_ids, params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        if params.n == 1:
            return [EngineCoreRequest(request_id, token_ids, params, self.eos_token_ids, arrival)]
        children = []
        for index in range(params.n):
            child = params.clone()
            child.n = 1
            if params.seed is not None:
                child.seed = (params.seed + index) % 2**64  # distinct, reproducible, still 64 bits
            if index:  # one prompt, one list: the first child's (a child that asks computes the whole prompt)
                child.prompt_logprobs = None
            wait_for = children[0].request_id if children else None
            children.append(EngineCoreRequest(child_request_id(index, request_id), token_ids, child,
                                              self.eos_token_ids, arrival, wait_for))
        return children

    def _check(self, token_ids: list[int], params: SamplingParams) -> SamplingParams:
        if not token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        # An id the model can never sample would silently never stop anything.
        bad = next((t for t in params.stop_token_ids or [] if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        bad = next((t for t in params.logit_bias or {} if t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if params.logit_bias:
            # The request's own copy: the sampler keeps its bias as tensors across steps
            # (sampling_metadata._bias_tensors), so a caller's later edit of its dict must not reach it.
            params = params.clone()
        if params.structured_outputs is not None:
            self.check_grammar(params)
        if self.pipeline_parallel and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs (a server's echo with logprobs asks for them too) is not supported "
                             "with pipeline_parallel_size > 1 yet")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.vocab_size:
                raise ValueError(f"{name} ({k}) must be <= the vocabulary size ({self.vocab_size})")
        room = self.max_model_len - len(token_ids)
        if params.max_tokens is None:
            if room < 1:
                raise ValueError(_too_long(len(token_ids), 1, self.max_model_len))
            params = params.clone()
            params.max_tokens = room
        elif params.max_tokens > room:
            raise ValueError(_too_long(len(token_ids), params.max_tokens, self.max_model_len))
        if params.min_tokens > params.max_tokens:
            raise ValueError(f"min_tokens ({params.min_tokens}) must be <= max_tokens ({params.max_tokens}, "
                             f"what is left of max_model_len={self.max_model_len} after the prompt)")
        return params


    def check_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar here, in the front end, so a bad schema, regex or grammar is
        refused before it reaches the core (GrammarError, a ValueError naming the problem)."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer; this engine runs with skip_tokenizer_init")
        self._grammar_compiler().compile(params.structured_outputs)

    def _grammar_compiler(self) -> GrammarCompiler:
        if self.grammars is None:
            self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        return self.grammars


def _drop_tokens_after_stop(completion: _Completion, keep: int | None, step_logprobs: list) -> None:
    """Cut the output at the token that completed the stop string: a step may have brought several (a
    speculative verify step), and tokens after the stop are not the request's output (its text already
    ends there). step_logprobs: the step's logprob entries (sampled token first), the last of which are
    dropped. Runs only when a stop string matched, never on a plain step."""
    if keep is None or keep >= len(completion.token_ids):
        return
    dropped = len(completion.token_ids) - keep
    del completion.token_ids[keep:]
    if completion.logprobs is not None:
        del completion.logprobs[keep:]
    completion.cumulative_logprob -= sum(entry[0][1] for entry in step_logprobs[len(step_logprobs) - dropped:])


def _too_long(num_prompt: int, max_tokens: int, max_model_len: int) -> str:
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the completion). "
        "Please reduce the prompt or max_tokens."
    )


def child_request_id(index: int, parent_id: str) -> str:
    return f"{index}_{parent_id}"


@dataclass
class _Completion:
    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # With skip_special_tokens off (tool-call parsing keeps DeepSeek's markers): the eos ids whose text
    # the output leaves out when the request ends on one (as it is, with the markers skipped, by default).
    hidden_eos: frozenset[int] = frozenset()

    def output(self) -> CompletionOutput:
        text = self.detokenizer.output_text if self.detokenizer else ""
        ends = list(self.detokenizer.token_text_ends) if self.detokenizer and self.logprobs is not None else None
        return CompletionOutput(self.index, text, list(self.token_ids),
                                self.cumulative_logprob if self.logprobs is not None else None,
                                self.logprobs, self.finish_reason, self.stop_reason, ends)


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[_Completion]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    final_only: bool = False  # report only the finished output (offline generate), not every step

    @property
    def finished(self) -> bool:
        if len(self.completions) == 1:  # n = 1, nearly every request: once per request and step, no generator
            return self.completions[0].finish_reason is not None
        return all(c.finish_reason is not None for c in self.completions)

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [c.output() for c in self.completions], self.finished,
                             self.prompt_logprobs, self.num_cached_tokens)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._token_bytes: TokenBytes | None = None  # built on the first logprobs
        self._fast_decode = backend_decode(tokenizer)
        self.states: dict[str, _RequestState] = {}
        self.child_to_parent: dict[str, tuple[_RequestState, _Completion]] = {}

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def add_request(self, request_id: str, prompt: str | None, core_requests: list[EngineCoreRequest],
                    final_only: bool = False) -> None:
        first = core_requests[0]
        params = first.sampling_params
        state = _RequestState(request_id, prompt, first.prompt_token_ids, [],
                              [None] if params.prompt_logprobs is not None else None, final_only=final_only)
        for index, core in enumerate(core_requests):
            logprobs = [] if params.logprobs is not None else None
            hidden = frozenset(core.eos_token_ids) if not core.sampling_params.skip_special_tokens else frozenset()
            completion = _Completion(index, self._detokenizer(core), logprobs=logprobs, hidden_eos=hidden)
            state.completions.append(completion)
            self.child_to_parent[core.request_id] = (state, completion)
        self.states[request_id] = state

    def _detokenizer(self, core: EngineCoreRequest) -> IncrementalDetokenizer | None:
        p = core.sampling_params
        if not p.detokenize or self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, core.prompt_token_ids, p.skip_special_tokens,
                                      p.stop, p.include_stop_str_in_output, p.min_tokens, self._fast_decode)

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; the core ids to abort."""
        state = self.states.pop(request_id, None)
        if state is None:
            return []
        ids = [cid for cid, (s, _) in self.child_to_parent.items() if s is state]
        for cid in ids:
            del self.child_to_parent[cid]
        return ids

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Cumulative RequestOutputs for the requests that changed, and the core ids to abort
        because a stop string ended them."""
        changed: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        for out in outputs:
            entry = self.child_to_parent.get(out.request_id)
            if entry is None:  # aborted here while the core was stepping
                continue
            state, completion = entry
            if self._apply(state, completion, out) and out.finish_reason is None:
                to_abort.append(out.request_id)
            if completion.finish_reason is not None:
                del self.child_to_parent[out.request_id]
                changed[state.request_id] = state  # final_only states are dropped below unless finished
            elif not state.final_only:
                changed[state.request_id] = state
        results = []
        for state in changed.values():
            finished = state.finished
            if state.final_only and not finished:
                continue
            results.append(state.output())
            if finished:
                del self.states[state.request_id]
        return results, to_abort

    def _apply(self, state: _RequestState, completion: _Completion, out: EngineCoreOutput) -> bool:
        """Fold one core output into its completion; True when a stop string ended it."""
        state.num_cached_tokens = out.num_cached_tokens
        # One prompt, one list: with n > 1 every child computes the prompt itself (prompt_logprobs keeps a
        # request out of the prefix cache) and sends its entries too; the first child's are the request's.
        if out.prompt_logprobs and state.prompt_logprobs is not None and completion.index == 0:
            state.prompt_logprobs.extend(self._logprob_dict(e) for e in out.prompt_logprobs)
        completion.token_ids.extend(out.new_token_ids)
        for entry in out.new_logprobs or []:
            completion.cumulative_logprob += entry[0][1]
            if completion.logprobs is not None:
                completion.logprobs.append(self._logprob_dict(entry))
        completion.finish_reason, completion.stop_reason = out.finish_reason, out.stop_reason
        detokenizer = completion.detokenizer
        if detokenizer is None:
            return False
        new = out.new_token_ids
        if new and out.finish_reason == "stop" and out.stop_reason is None and new[-1] in completion.hidden_eos:
            new = new[:-1]  # the eos that ended it: its token stays in token_ids, its text stays out
        stop = detokenizer.update(new) if new else None
        if out.finish_reason is not None and stop is None:
            stop = detokenizer.finish()  # flush a dangling partial character into the final text
        if stop is None:
            return False
        completion.finish_reason, completion.stop_reason = "stop", stop
        _drop_tokens_after_stop(completion, detokenizer.num_tokens_at_stop, out.new_logprobs or [])
        return True

    def _logprob_dict(self, entry: list[tuple[int, float, int]]) -> dict[int, Logprob]:
        if self.tokenizer is None:
            return {tid: Logprob(lp, rank) for tid, lp, rank in entry}
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tokenizer)
        out = {}
        for tid, lp, rank in entry:
            text = self.tokenizer.decode([tid])
            out[tid] = Logprob(lp, rank, text, self._token_bytes(tid, text))
        return out
