"""`deepserve run-batch -i requests.jsonl -o results.jsonl [MODEL]`: OpenAI's batch file format, offline.

Each input line is one request, as OpenAI's Batch API and vLLM's run_batch take them:
`{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}` (or `/v1/completions`).
Each output line answers one input line, in the input's order:
`{"id": "batch_req_...", "custom_id": "r1", "response": {"status_code": 200, "request_id": "...", "body": {...}},
"error": null}`; a request the API refuses keeps its status and error body in `response`; a line that is not
a request (bad JSON, another url, a repeated custom_id, stream true) gets `response: null` and `error`.

The requests go through the server's own app in this process (no socket, no port): the same validation,
chat templates, parsers, structured output and errors as `deepserve serve`, with up to --max-concurrency
lines in flight at once.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import os
import secrets
import sys
import uuid
from collections.abc import Iterator
from typing import IO, Any

logger = logging.getLogger(__name__)

URLS = ("/v1/chat/completions", "/v1/completions")
EXIT_ENGINE_DEAD = 1
EPILOG = ("The last line on stderr counts the answers (200s, 4xx refusals, 5xx failures, lines that are not "
          "requests). Exit code: 0 when every line got its answer, 1 if the engine stopped on the way, 2 for a bad "
          "flag or file or an engine that never started.")
# Lines read ahead of the oldest unwritten result, per request allowed in the engine at once: results are
# written in input order, so a slow early line holds the later ones in memory; this bounds how many.
READ_AHEAD = 4


def add_batch_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from deepserve.entrypoints.cli import DefaultsHelp, add_engine_args, add_model_args
    from deepserve.entrypoints.serve import add_request_args

    p = subparsers.add_parser("run-batch", help="answer a JSONL file of OpenAI batch requests, offline",
                              description=__doc__.split("\n\n")[1], epilog=EPILOG, formatter_class=DefaultsHelp)
    add_model_args(p)
    p.add_argument("-i", "--input-file", required=True, metavar="FILE",
                   help="JSONL of requests, one per line ('-' reads standard input)")
    p.add_argument("-o", "--output-file", required=True, metavar="FILE",
                   help="JSONL of results, one per request line, in order ('-' writes standard output)")
    p.add_argument("--max-concurrency", type=int, default=256,
                   help="lines in flight at once (the engine batches them; a line with a list of prompts or n > 1 "
                        "runs that many sequences)")
    add_request_args(p.add_argument_group("requests"))
    add_engine_args(p)
    p.set_defaults(func=cmd_run_batch)
    return p


def batch_settings(ns: argparse.Namespace, key: str) -> Any:
    """The server's settings for a batch: its own key only, and no wait-queue limit (--max-concurrency
    bounds the requests in flight; the queue's 503s are for clients that can retry elsewhere)."""
    from deepserve.server.settings import ServerSettings

    return ServerSettings(
        served_model_names=list(ns.served_model_name or []), api_keys=[key], reasoning_parser=ns.reasoning_parser,
        enable_auto_tool_choice=ns.enable_auto_tool_choice, tool_call_parser=ns.tool_call_parser,
        default_chat_template_kwargs=ns.default_chat_template_kwargs, max_n=ns.max_n,
        max_waiting_requests=2**62, max_waiting_tokens=2**62, audit_log=ns.audit_log,
        audit_log_prompts=ns.audit_log_prompts)


def cmd_run_batch(ns: argparse.Namespace) -> int:
    from deepserve.entrypoints.cli import engine_args_from, preset_tokenizer
    from deepserve.entrypoints.serve import DEMO_MODEL_NAME
    from deepserve.server.async_llm import AsyncLLM
    from deepserve.server.state import ServerState

    if ns.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be a positive integer, got {ns.max_concurrency}")
    _check_files(ns.input_file, ns.output_file)
    key = "sk-batch-" + secrets.token_hex(16)  # this process's own requests only: nothing listens
    settings = batch_settings(ns, key)
    preset_tokenizer(ns)
    names = settings.served_model_names or [ns.model or DEMO_MODEL_NAME]
    with _results_stdout() if ns.output_file == "-" else contextlib.nullcontext() as stdout:
        engine = AsyncLLM.from_engine_args(engine_args_from(ns, ns.model))
        state = ServerState(settings, engine, names)
        try:
            counts = asyncio.run(run_batch(state, key, ns.input_file, ns.output_file, ns.max_concurrency, stdout))
        finally:
            engine.kill_if_unstarted()
    if state.dead_reason is not None:
        print(f"run-batch: the engine stopped: {state.dead_reason}", file=sys.stderr)
    print(f"run-batch: {counts['lines']} lines: {counts['ok']} answered 200, {counts['refused']} refused (4xx), "
          f"{counts['failed']} failed (5xx), {counts['invalid']} not requests", file=sys.stderr)
    return EXIT_ENGINE_DEAD if state.dead_reason is not None else 0


def _check_files(input_path: str, output_path: str) -> None:
    """Before the engine loads (minutes for a large model): the input is there, the output can be made and is
    not the input (opening it would empty the requests before they are read)."""
    if input_path != "-" and (not os.path.exists(input_path) or os.path.isdir(input_path)):
        raise ValueError(f"--input-file {input_path}: no such file")  # a pipe or /dev/stdin is fine
    if output_path == "-":
        return
    folder = os.path.dirname(os.path.abspath(output_path))
    if not os.path.isdir(folder):
        raise ValueError(f"--output-file {output_path}: its folder {folder} does not exist")
    if os.path.isdir(output_path):
        raise ValueError(f"--output-file {output_path} is a folder; give a file path")
    if input_path != "-" and os.path.exists(output_path) and os.path.samefile(input_path, output_path):
        raise ValueError(f"--output-file {output_path} is the input file: writing it would erase the requests; "
                         "give another path")


@contextlib.contextmanager
def _results_stdout() -> Iterator[IO[str]]:
    """Standard output for the results alone: file descriptor 1 points at stderr meanwhile, so what the engine
    processes (started now, inheriting it) or a library prints lands there, not among the JSON lines."""
    sys.stdout.flush()
    results = os.fdopen(os.dup(1), "w", encoding="utf-8")
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield results
    finally:
        results.close()
        sys.stdout.flush()  # what this process printed meanwhile goes where fd 1 pointed then: stderr
        os.dup2(saved, 1)
        os.close(saved)


def _input_lines(path: str) -> Iterator[tuple[int, str | None]]:
    """(line number, text) of each line that is not blank, read as it is needed; text None for a line that is
    not UTF-8. Lines end at "\n" only (JSON text may hold U+2028 and the like unescaped, where
    str.splitlines would also break)."""
    with contextlib.nullcontext(sys.stdin.buffer) if path == "-" else open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8").rstrip("\r\n")  # a BOM may start it
            except UnicodeDecodeError:
                yield number, None
                continue
            if line.strip():
                yield number, line


@contextlib.contextmanager
def _output(path: str, stdout: IO[str] | None) -> Iterator[IO[str]]:
    if stdout is not None:
        yield stdout
        return
    with open(path, "w", encoding="utf-8") as f:
        yield f


async def run_batch(state: Any, key: str, input_path: str, output_path: str, concurrency: int,
                    stdout: IO[str] | None = None) -> dict[str, int]:
    """Answers every line through the server's app (its lifespan starts and stops the engine) and writes
    the results in input order as they are ready; the output is opened only once the engine serves, so a
    failed start leaves an earlier file as it was. Returns the counts by kind of answer."""
    import httpx

    from deepserve.server.api_server import build_app

    app = build_app(state)
    counts = {"lines": 0, "ok": 0, "refused": 0, "failed": 0, "invalid": 0}
    async with app.router.lifespan_context(app):
        await _wait_loaded(state)
        # raise_app_exceptions=False: a bug in one request is its 500 line (the app's own handler), not the end
        # of the batch.
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 0), raise_app_exceptions=False)
        client = httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None,
                                   headers={"Authorization": f"Bearer {key}"})
        async with client:
            await _answer_all(client, _input_lines(input_path), output_path, stdout, concurrency, counts)
    return counts


async def _answer_all(client: Any, lines: Iterator[tuple[int, str | None]], output_path: str,
                      stdout: IO[str] | None, concurrency: int, counts: dict[str, int]) -> None:
    with _output(output_path, stdout) as out:
        gate = asyncio.Semaphore(concurrency)
        pending: collections.deque[asyncio.Task] = collections.deque()

        async def write_oldest() -> None:
            result = await pending.popleft()
            out.write(_json_line(result))
            out.flush()
            counts["lines"] += 1
            counts[_kind(result)] += 1

        for req in _requests(lines):
            pending.append(asyncio.create_task(_answer(client, gate, req)))
            while len(pending) >= READ_AHEAD * concurrency:
                await write_oldest()
        while pending:
            await write_oldest()


def _json_line(result: dict[str, Any]) -> str:
    """The result as one line of UTF-8 JSON; with \\u escapes where a string holds what UTF-8 cannot (a lone
    surrogate, which JSON input may carry), so no line can stop the run."""
    line = json.dumps(result, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        line = json.dumps(result)
    return line + "\n"


def _kind(result: dict[str, Any]) -> str:
    if result["response"] is None:
        return "invalid" if result["error"]["code"] == "invalid_batch_line" else "failed"
    status = result["response"]["status_code"]
    return "ok" if status == 200 else "refused" if status < 500 else "failed"


async def _wait_loaded(state: Any) -> None:
    while not state.loaded:
        if state.dead_reason is not None:
            raise ValueError(f"the engine did not start: {state.dead_reason}")
        await asyncio.sleep(0.05)


def _requests(lines: Iterator[tuple[int, str | None]]) -> Iterator[dict[str, Any]]:
    """Each line as {custom_id, url, body} or {custom_id, error}: what _answer sends or reports."""
    seen: set[str] = set()
    for number, line in lines:
        req = _parse_line(line, number)
        cid = req.get("custom_id")
        if "error" not in req and cid in seen:  # custom_id null: a reader keyed by custom_id keeps the first's result
            req = {"custom_id": None, "error": f"line {number}: custom_id {cid!r} was used by an earlier line"}
        seen.add(cid)
        yield req


def _parse_line(line: str | None, number: int) -> dict[str, Any]:
    if line is None:
        return {"custom_id": None, "error": f"line {number} is not UTF-8 text"}
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        return {"custom_id": None, "error": f"line {number} is not valid JSON: {e.msg} (column {e.colno})"}
    except ValueError:  # json.loads' one other failure: an integer literal past Python's digit limit
        return {"custom_id": None, "error": f"line {number} holds a number too long to read "
                                            f"(over {sys.get_int_max_str_digits():,} digits)"}
    except RecursionError:
        return {"custom_id": None, "error": f"line {number} is nested too deeply"}
    if not isinstance(d, dict):
        return {"custom_id": None, "error": f"line {number} must be a JSON object"}
    cid = d.get("custom_id")
    problem = _line_problem(d)
    if problem is not None:
        return {"custom_id": cid if isinstance(cid, str) else None, "error": f"line {number}: {problem}"}
    return {"custom_id": cid, "url": d["url"], "body": d["body"]}


def _line_problem(d: dict[str, Any]) -> str | None:
    if not isinstance(d.get("custom_id"), str) or not d["custom_id"]:
        return "custom_id must be a non-empty string"
    if d.get("method", "POST") != "POST":
        return f"method must be POST, got {d.get('method')!r}"
    if d.get("url") not in URLS:
        return f"url must be one of {', '.join(URLS)}, got {d.get('url')!r}"
    if not isinstance(d.get("body"), dict):
        return "body must be a JSON object (the request the url takes)"
    if d["body"].get("stream"):
        return "body.stream must be false in a batch (each result is written whole)"
    extra = sorted(set(d) - {"custom_id", "method", "url", "body"})
    if extra:
        return f"unknown field(s) {extra} (a line has custom_id, method, url and body)"
    return None


async def _answer(client: Any, gate: asyncio.Semaphore, req: dict[str, Any]) -> dict[str, Any]:
    line_id = f"batch_req_{uuid.uuid4().hex}"
    if "error" in req:
        return {"id": line_id, "custom_id": req["custom_id"], "response": None,
                "error": {"code": "invalid_batch_line", "message": req["error"]}}
    try:
        async with gate:
            r = await client.post(req["url"], json=req["body"])
    except Exception as e:  # the request never got an answer (e.g. a body json cannot encode): its line says so
        logger.exception("run-batch: %s failed", req["custom_id"])
        return {"id": line_id, "custom_id": req["custom_id"], "response": None,
                "error": {"code": "internal_error", "message": f"{type(e).__name__}: {e}"}}
    try:
        body = r.json()
    except ValueError:  # every error the app sends is JSON; this keeps a line for anything else
        body = {"error": {"message": r.text[:2000], "type": "internal_error", "code": None}}
    response = {"status_code": r.status_code, "request_id": r.headers.get("x-request-id"), "body": body}
    return {"id": line_id, "custom_id": req["custom_id"], "response": response, "error": None}
