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

import ctypes
import json
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deepserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # torch-free at run time (the engine/ rule): a slot is only handed on
    from deepserve.layers.sampling_metadata import MaskBuffers, MaskSlot

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
        # Tokens fed before the scheduler took them: (token, accepted, stopped after it or None when not
        # read, the error when refused).
        self._ahead: deque[tuple[int, bool, bool | None, str]] = deque()
        self._taken: tuple[bool, str] | None = None  # (stopped, error) of the token accept() just took

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar refused it (then the matcher is stuck in an
        error state: the request must end). A token already fed ahead is not consumed twice."""
        self._taken = None
        if self._ahead:
            fed, accepted, stopped, error = self._ahead.popleft()
            if fed == token_id:  # the scheduler takes a step's tokens in the order they were fed
                if stopped is not None:
                    self._taken = (stopped, error)
                return accepted
            # Out of step (a bug): the matcher's state is not this output's. Refused, so this request
            # ends with a warning instead of the step raising for every request in the engine.
            logger.error("grammar fed token %d ahead but the request took %d; ending the request", fed, token_id)
            self._ahead.clear()
            self._taken = (True, f"token {fed} was fed ahead but the request took {token_id}")
            return False
        return bool(self.matcher.consume_token(token_id))

    def feed_ahead(self, token_id: int, snapshot: bool = False) -> None:
        """Async scheduling: consume a token of the step before now, since the next step's mask depends on
        it, before the scheduler takes it (Request.check_stop calls accept, which then returns this
        result). One matcher at a time: a token costs ~5 us here, and llguidance's parallel
        consume_token_par was slower for 256 matchers on a 2-core sandbox (1.8 against 1.4 ms).

        snapshot: also read now whether the matcher stopped after this token (and its error if it refused
        it), so that the scheduler's accept / is_finished / error for this token do not touch the matcher:
        with DEEPSERVE_GRAMMAR_OVERLAP the next step's masks are being filled from the matchers on
        another thread meanwhile, and a matcher lent to that fill cannot be called."""
        accepted = bool(self.matcher.consume_token(token_id))
        stopped = bool(self.matcher.is_stopped()) if snapshot else None
        error = self.matcher.get_error() if snapshot and not accepted else ""
        self._ahead.append((token_id, accepted, stopped, error))

    def bitmask(self) -> bytes:
        """Allowed next tokens, one bit each. EOS is allowed only where the grammar accepts."""
        return self.matcher.compute_bitmask()

    @property
    def is_finished(self) -> bool:
        """The grammar has completed (or failed): nothing but EOS could follow. Right after accept() took a
        token fed ahead with a snapshot, as of that token (read at feed time)."""
        if self._taken is not None:
            return self._taken[0]
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        if self._taken is not None:
            return self._taken[1]
        return self.matcher.get_error()


@dataclass
class GrammarTiming:
    """Host seconds spent on masks since start-up, summed over the steps that built any: waiting for the
    in-flight step's tokens (async: the device's time, not the host's), feeding them to the matchers,
    and computing the masks."""

    steps: int = 0
    wait_s: float = 0.0
    feed_s: float = 0.0
    fill_s: float = 0.0  # with DEEPSERVE_GRAMMAR_OVERLAP: the fill thread's time, beside the main thread's work
    join_s: float = 0.0  # DEEPSERVE_GRAMMAR_OVERLAP: the main thread waiting for a fill still running
    beside: int = 0  # DEEPSERVE_GRAMMAR_OVERLAP: steps whose masks filled on their thread

    def add_fill(self, seconds: float) -> None:
        self.fill_s += seconds


class GrammarCompiler:
    """Compiles grammars for one tokenizer, each text once (an LRU of template matchers).

    vocab_size is the model's: masks cover every logit column, and columns past the tokenizer's own
    vocabulary are never allowed."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        # llguidance's view of the tokenizer (~0.9 s to build for 152k tokens): at start-up (warm_up) or first
        # use; compile() may run on EngineCore's compile thread while the front end compiles too (_ll_lock).
        self._ll_tokenizer: Any = None
        self._ll_lock = threading.Lock()
        self._templates: OrderedDict[str, Any] = OrderedDict()
        # compile() may run on EngineCore's compile thread while the step loop calls cached().
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> Any:
        with self._ll_lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
            return self._ll_tokenizer

    def warm_up(self) -> bool:
        """Build ll_tokenizer now, at start-up, so the first request with a grammar does not: that took 0.89 s
        for a 152k vocabulary on a 2-core sandbox, mostly inside llguidance's native build, which holds the
        GIL; in the engine core it ran beside the step loop (after the loop's own load of the tokenizer),
        slowing every running request. On one H200 it moved W1 with a JSON schema on every request, as a
        fresh engine's first run, from 0.88 to 0.92-0.95 of the same work unconstrained (a build on a thread
        beside the model's loading did no better; bench/RESULTS.md, 2026-12-03). Returns whether
        it was built: not when DEEPSERVE_GRAMMAR_WARMUP is off or llguidance is not installed, nor when the
        build fails (logged; the first request with a grammar then builds it and raises there, naming its
        request)."""
        if not grammar_warmup_enabled():
            return False
        try:
            self.ll_tokenizer  # noqa: B018 (built here)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 (a Rust panic is a BaseException; the first request retries)
            logger.warning("building the grammar engine's view of the tokenizer failed (left to the first "
                           "request with a grammar): %s", e)
            return False
        return True

    @property
    def bitmask_bytes(self) -> int:
        return mask_row_bytes(self.vocab_size)

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


def grammar_warmup_enabled() -> bool:
    """DEEPSERVE_GRAMMAR_WARMUP is on and llguidance is installed (structured output can be served)."""
    import importlib.util

    from deepserve import envs

    return envs.DEEPSERVE_GRAMMAR_WARMUP and importlib.util.find_spec("llguidance") is not None


def _short(message: str, limit: int = 500) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit] + "..."


def mask_row_bytes(vocab_size: int) -> int:
    """One row's mask: a bit per vocabulary entry, in whole 32-bit words."""
    return (vocab_size + 31) // 32 * 4


def fill_bitmasks(states: list[GrammarState | None], num_bytes: int,
                  buffers: MaskBuffers | None = None) -> bytearray | MaskSlot:
    """The masks of a step's sampling rows, row after row, num_bytes each (ceil(V / 32) words, V the
    model's vocabulary); a row without a grammar allows everything, and so does a row whose grammar has
    stopped (completed or refused a token): under async scheduling such a request already has a row in
    the step launched after the token that ended it, and that row's token is dropped (a row with nothing
    allowed would have no token to sample).

    llguidance's executor computes the rows on its own threads, without the GIL, straight into the one
    buffer: W1's 256 JSON-schema rows took 7.1 ms a step one after another on a 2-core sandbox and 4.8 ms
    this way there (more cores, more of a gain). It checks num_bytes against its tokenizer's vocabulary
    (ValueError otherwise) and writes exactly num_bytes per row. buffers: fill a slot of these pinned
    buffers instead of a new bytearray (DEEPSERVE_PINNED_GRAMMAR_MASKS)."""
    buffer, jobs = _fill_jobs(states, num_bytes, buffers)
    _fill(buffer, jobs, num_bytes, len(states))
    return buffer


def fill_bitmasks_beside(states: list[GrammarState | None], num_bytes: int, pool: ThreadPoolExecutor,
                         seconds: Callable[[float], None], buffers: MaskBuffers | None = None) -> Future:
    """fill_bitmasks on `pool`'s thread, returning once that thread is inside llguidance (which releases the
    GIL), so the caller's Python runs beside the fill: a thread that has to win the GIL from a busy caller
    starts late (CPython hands it over every 5 ms), and on a 2-core sandbox the fill then finished after
    the caller's work instead of beside it. The rows are chosen here, on the caller's thread; `seconds`
    gets the fill's own duration. The caller must not call these matchers until the future is done."""
    buffer, jobs = _fill_jobs(states, num_bytes, buffers)
    started = threading.Event()

    def run() -> bytearray:
        start = time.perf_counter()
        started.set()
        try:
            _fill(buffer, jobs, num_bytes, len(states))
        finally:
            seconds(time.perf_counter() - start)
        return buffer

    future = pool.submit(run)
    started.wait()
    return future


def _fill_jobs(states: list[GrammarState | None], num_bytes: int,
               buffers: MaskBuffers | None) -> tuple[bytearray | MaskSlot, list]:
    size = num_bytes * len(states)
    buffer = buffers.take(size) if buffers is not None else bytearray(b"\xff" * size)
    # The matcher's own state, tokens fed ahead included (is_finished may answer for an earlier token).
    jobs = [(s.matcher, row) for row, s in enumerate(states) if s is not None and not s.matcher.is_stopped()]
    return buffer, jobs


def _fill(buffer: bytearray | MaskSlot, jobs: list, num_bytes: int, rows: int) -> None:
    if not jobs:
        return
    if not isinstance(buffer, bytearray):  # a MaskSlot: llguidance writes its contiguous memory
        _executor().unsafe_compute_mask_ptr(jobs, buffer.address, num_bytes, rows)
        return
    view = (ctypes.c_char * len(buffer)).from_buffer(buffer)
    try:
        _executor().unsafe_compute_mask_ptr(jobs, ctypes.addressof(view), num_bytes, rows)
    finally:
        del view  # releases the export: the buffer may be handed on (torch.frombuffer)


_EXECUTOR: Any = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> Any:
    """One llguidance thread pool per process (80 % of the CPUs, at most 32: llguidance's default)."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            import llguidance

            _EXECUTOR = llguidance.LLExecutor()
        return _EXECUTOR
