"""SamplingParams: how one request samples and when it stops, with vLLM's field names.

Validated once, at construction; the engine and the sampler trust every field afterwards.
"""

from __future__ import annotations

import copy
import math
from dataclasses import MISSING, dataclass, field, fields

_MAX_SEED = 2**64 - 1


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's names); exactly one field is set. The engine turns it into a
    grammar (engine/grammar.py) and masks every token the grammar does not allow at each step.

    json: a JSON schema (dict or its JSON text); regex: a regular expression the whole output matches;
    choice: the output is one of these strings; grammar: a Lark grammar (or GBNF) as llguidance reads it;
    json_object: any JSON object (OpenAI's meaning: never a bare array or scalar)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON only: no whitespace between tokens (compact output; a random-weight model otherwise loves it).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_fields = self.set_fields()
        if len(set_fields) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                             f"got {set_fields or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.regex is not None and (len(self.regex) - len(self.regex.rstrip("\\"))) % 2:
            # llguidance would drop it silently ("a\\" matched as "a"), not refuse it
            raise ValueError("structured_outputs.regex ends in a lone backslash (escape it as \\\\)")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its JSON text)")

    def set_fields(self) -> list[str]:
        return [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None] + (
            ["json_object"] if self.json_object else [])


@dataclass(init=False)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per output token, besides the sampled one
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # token id -> a value added to its logit before sampling (OpenAI's -100..100; -100 all but bans it). A
    # dict or (id, bias) pairs; EngineCoreRequest.to_dict sends pairs, as msgpack maps take string keys only.
    logit_bias: dict[int, float] | None = None

    def __init__(self, **kwargs: object) -> None:
        known = {f.name: f for f in fields(self)}
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise ValueError(f"SamplingParams got unknown field(s) {unknown}; known fields: {sorted(known)}")
        for name, f in known.items():
            if name in kwargs:
                value = kwargs[name]
            elif f.default_factory is not MISSING:
                value = f.default_factory()
            else:
                value = f.default
            setattr(self, name, value)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop, "a string or a list of strings")
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids, "a list of token ids")
        self.logit_bias = _as_bias(self.logit_bias)
        if isinstance(self.structured_outputs, dict):  # from EngineCoreRequest.from_dict (msgpack)
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        """True when sampling reads the request's earlier tokens (presence / frequency / repetition)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def needs_known_tokens(self) -> bool:
        """True when sampling a token reads the request's earlier output tokens on the host side, so
        they must be real tokens, not placeholders of a step still running (async scheduling then steps
        one at a time while such a request runs): penalties. A grammar's mask also depends on the token
        just sampled, but EngineCore gets that token inside the next step's launch, after its forward
        is queued (EngineCore._attach_grammar_bitmask), so it keeps async scheduling."""
        return self.has_penalties

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def _validate(self) -> None:
        _check_int("n", self.n, lo=1)
        _check_float("temperature", self.temperature, lo=0.0)
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, lo=-1)
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None:
            _check_int("seed", self.seed, lo=-(2**63), hi=_MAX_SEED)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, lo=0)
        for t, bias in (self.logit_bias or {}).items():
            _check_int("logit_bias token id", t, lo=0)
            _check_float(f"logit_bias[{t}]", bias, lo=-LOGIT_BIAS_LIMIT, hi=LOGIT_BIAS_LIMIT)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")


LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a bias, either way


def _as_bias(value: object) -> dict[int, float] | None:
    """logit_bias as {token id: bias}; None for none. Token ids may come as decimal strings (JSON's keys)."""
    if value is None:
        return None
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(x, (list, tuple)) and len(x) == 2 for x in value):
        pairs = [tuple(x) for x in value]
    else:
        raise ValueError(f"logit_bias must map token ids to biases, got {value!r}")
    bias = {}
    for token, b in pairs:
        if isinstance(token, str) and token.isdecimal():
            token = int(token)
        _check_int("logit_bias token id", token, lo=0)
        bias[token] = b
    return bias or None


def _as_list(name: str, value: object, what: str) -> list:
    """value as a list (None: empty); a scalar or a mapping is refused naming the field."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(f"{name} must be {what}, got {value!r}")


def _check_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")


def _check_float(name: str, value: object, lo: float | None = None, hi: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
