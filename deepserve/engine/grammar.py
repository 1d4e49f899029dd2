"""Structured output on llguidance: a request's StructuredOutputsParams -> a grammar -> a matcher whose
state follows the request's tokens and which says, before each step, which tokens may come next.

Why llguidance: JSON schema, regex, choice and Lark grammars in one engine, and its JSON strings never
take raw control characters (xgrammar 0.2.8 was seen letting them through under maxLength, which
json.loads rejects; tests/engine/test_grammar.py checks ours with json.loads).

Cost and stalls. Building a matcher compiles the grammar (the tokenizer-independent part is cheap; the
lexer is built lazily, a state at a time). Matchers are compiled once per (grammar text, tokenizer) and
cached; a request gets a deep copy. Every mask computation is bounded by llguidance's fuel limits
(LLParserLimits: lexer fuel, Earley items per step), so a pathological grammar puts its own request in
an error state instead of stalling the step loop; the front end (InputProcessor, in the API server's
process when the core runs apart) compiles a grammar first, to answer a bad one with a 400, so the
core's own compile of the same text is a cache-warm repeat in one process and a second, already
validated compile in two.

Torch-free (engine/ rule): masks are bytes, one bit per vocabulary entry, 32-bit little-endian words,
which the runner views as an int32 [rows, ceil(V / 32)] tensor.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Any

from deepserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Templates kept compiled; a request deep-copies one (LRU beyond this).
CACHE_SIZE = 256


class GrammarError(ValueError):
    """A schema, regex or grammar that llguidance refuses; the message says why."""


def grammar_spec(so: StructuredOutputsParams) -> str:
    """The llguidance grammar text for what the request asked. Raises GrammarError for a schema that is
    not JSON (the grammar's own errors come when it is compiled)."""
    import llguidance

    options = {"whitespace_flexible": False} if so.disable_any_whitespace else None
    try:
        if so.json is not None:
            schema = json.loads(so.json) if isinstance(so.json, str) else so.json
            if not isinstance(schema, dict):
                raise GrammarError("the JSON schema must be a JSON object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if so.json_object:
            # OpenAI's json_object: an object, never a bare array or scalar.
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
        if so.regex is not None:
            return llguidance.grammar_from("regex", so.regex)
        if so.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(so.choice))
        return llguidance.grammar_from("grammar", so.grammar)  # Lark, or GBNF converted to Lark
    except GrammarError:
        raise
    except (ValueError, TypeError) as e:
        raise GrammarError(str(e)) from None


class GrammarState:
    """One request's matcher: accept each sampled token, give the mask of the next."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar refused it (then the matcher is stuck in an
        error state: the request must end)."""
        return bool(self.matcher.consume_token(token_id))

    def bitmask(self) -> bytes:
        """Allowed next tokens, one bit each. EOS is allowed only where the grammar accepts."""
        return self.matcher.compute_bitmask()

    @property
    def is_finished(self) -> bool:
        """The grammar has completed (or failed): nothing but EOS could follow."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class GrammarCompiler:
    """Compiles grammars for one tokenizer, each text once (an LRU of template matchers).

    vocab_size is the model's: masks cover every logit column, and columns past the tokenizer's own
    vocabulary are never allowed."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer: Any = None  # llguidance's view of the tokenizer (~1 s to build): at first use
        self._templates: OrderedDict[str, Any] = OrderedDict()
        # compile() may run on EngineCore's compile thread while the step loop calls cached().
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
        return self._ll_tokenizer

    @property
    def bitmask_bytes(self) -> int:
        return (self.vocab_size + 31) // 32 * 4

    def compile(self, so: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher for the request; raises GrammarError naming what is wrong."""
        spec = grammar_spec(so)
        state = self._copy(spec)
        if state is not None:
            return state
        template = self._build(spec)  # outside the lock: llguidance releases the GIL while it compiles
        with self._lock:
            self._templates[spec] = template
            if len(self._templates) > CACHE_SIZE:
                self._templates.popitem(last=False)
        return GrammarState(template.deep_copy())

    def cached(self, so: StructuredOutputsParams) -> GrammarState | None:
        """A fresh matcher when the grammar is already compiled (a copy costs microseconds), else None."""
        return self._copy(grammar_spec(so))

    def _copy(self, spec: str) -> GrammarState | None:
        with self._lock:
            template = self._templates.get(spec)
            if template is None:
                return None
            self._templates.move_to_end(spec)
            return GrammarState(template.deep_copy())

    def _build(self, spec: str) -> Any:
        import llguidance

        matcher = llguidance.LLMatcher(self.ll_tokenizer, spec, log_level=0)
        if matcher.is_error():
            raise GrammarError(_short(matcher.get_error()))
        return matcher


def _short(message: str, limit: int = 500) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit] + "..."


def fill_bitmasks(states: list[GrammarState | None], num_bytes: int) -> bytes:
    """The masks of a step's sampling rows, row after row, num_bytes each; a row without a grammar allows
    everything. llguidance's rows can be a word longer than the model's vocabulary needs (seen with a
    small tokenizer and a large n_vocab): cut to size, or padded with zeros (not allowed)."""
    full = b"\xff" * num_bytes
    return b"".join(full if s is None else _fit(s.bitmask(), num_bytes) for s in states)


def _fit(mask: bytes, num_bytes: int) -> bytes:
    return mask[:num_bytes] if len(mask) >= num_bytes else mask + bytes(num_bytes - len(mask))
