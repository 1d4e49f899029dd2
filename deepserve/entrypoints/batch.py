"""`deepserve run-batch -i requests.jsonl -o results.jsonl [MODEL]`: OpenAI's batch file format, offline.

Each input line is one request, as OpenAI's Batch API and vLLM's run_batch take them:
`{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}` (or `/v1/completions`).
Each output line answers one input line, in the input's order:
`{"id": "batch_req_...", "custom_id": "r1", "response": {"status_code": 200, "request_id": "...", "body": {...}},
"error": null}`; a request the API refuses keeps its status and error body in `response`; a line that is not
a request (bad JSON, another url, a repeated custom_id, stream true) gets `response: null` and `error`.

The requests go through the server's own app in this process (no socket, no port): the same validation,
chat templates, parsers, structured output and errors as `deepserve serve`, with up to --max-concurrency
requests in the engine at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import secrets
import sys
import uuid
from collections.abc import Iterable, Iterator
from typing import IO, Any

logger = logging.getLogger(__name__)

URLS = ("/v1/chat/completions", "/v1/completions")
EXIT_ENGINE_DEAD = 1


def add_batch_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from deepserve.entrypoints.cli import DefaultsHelp, add_engine_args
    from deepserve.entrypoints.serve import add_request_args

    p = subparsers.add_parser("run-batch", help="answer a JSONL file of OpenAI batch requests, offline",
                              description=__doc__.split("\n\n")[1], formatter_class=DefaultsHelp)
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: the built-in demo model)")
    p.add_argument("-i", "--input-file", required=True, metavar="FILE",
                   help="JSONL of requests, one per line ('-' reads standard input)")
    p.add_argument("-o", "--output-file", required=True, metavar="FILE",
                   help="JSONL of results, one per request line, in order ('-' writes standard output)")
    p.add_argument("--max-concurrency", type=int, default=256,
                   help="requests in the engine at once (the engine batches them)")
    add_request_args(p.add_argument_group("requests"))
    add_engine_args(p)
    p.set_defaults(func=cmd_run_batch)
    return p


def cmd_run_batch(ns: argparse.Namespace) -> int:
    from deepserve.entrypoints.cli import engine_args_from, preset_tokenizer
    from deepserve.entrypoints.serve import DEMO_MODEL_NAME
    from deepserve.server.async_llm import AsyncLLM
    from deepserve.server.settings import ServerSettings
    from deepserve.server.state import ServerState

    if ns.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be a positive integer, got {ns.max_concurrency}")
    lines = _read_lines(ns.input_file)
    key = "sk-batch-" + secrets.token_hex(16)  # this process's own requests only: nothing listens
    settings = ServerSettings(
        served_model_names=list(ns.served_model_name or []), api_keys=[key], reasoning_parser=ns.reasoning_parser,
        enable_auto_tool_choice=ns.enable_auto_tool_choice, tool_call_parser=ns.tool_call_parser,
        default_chat_template_kwargs=ns.default_chat_template_kwargs, max_n=ns.max_n,
        max_waiting_requests=max(ServerSettings.max_waiting_requests, ns.max_concurrency),
        audit_log=ns.audit_log, audit_log_prompts=ns.audit_log_prompts)
    preset_tokenizer(ns)
    names = settings.served_model_names or [ns.model or DEMO_MODEL_NAME]
    engine = AsyncLLM.from_engine_args(engine_args_from(ns, ns.model))
    state = ServerState(settings, engine, names)
    try:
        with _open_output(ns.output_file) as out:
            counts = asyncio.run(run_batch(state, key, lines, out, ns.max_concurrency))
    finally:
        engine.kill_if_unstarted()
    failed = counts["lines"] - counts["ok"]
    print(f"run-batch: {counts['lines']} lines, {counts['ok']} answered 200, {failed} not "
          f"({counts['refused']} refused by the API, {counts['invalid']} not requests)", file=sys.stderr)
    if state.dead_reason is not None:
        print(f"run-batch: the engine stopped: {state.dead_reason}", file=sys.stderr)
        return EXIT_ENGINE_DEAD
    return 0


def _read_lines(path: str) -> list[tuple[int, str]]:
    """(line number in the file, text) of each line that is not blank."""
    if path == "-":
        text = sys.stdin.read()
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    return [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]


@contextlib.contextmanager
def _open_output(path: str) -> Iterator[IO[str]]:
    if path == "-":
        yield sys.stdout
        return
    with open(path, "w", encoding="utf-8") as f:
        yield f


async def run_batch(state: Any, key: str, lines: list[tuple[int, str]], out: IO[str],
                    concurrency: int) -> dict[str, int]:
    """Answers every line through the server's app (its lifespan starts and stops the engine) and writes
    the results in input order as they are ready; the counts of lines, 200s, API refusals and bad lines."""
    import httpx

    from deepserve.server.api_server import build_app

    app = build_app(state)
    counts = {"lines": len(lines), "ok": 0, "refused": 0, "invalid": 0}
    async with app.router.lifespan_context(app):
        await _wait_loaded(state)
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 0))
        async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None,
                                     headers={"Authorization": f"Bearer {key}"}) as client:
            gate = asyncio.Semaphore(concurrency)
            tasks = [asyncio.create_task(_answer(client, gate, req)) for req in _requests(lines)]
            for task in _progress(tasks):
                result = await task
                kind = "invalid" if result["response"] is None else (
                    "ok" if result["response"]["status_code"] == 200 else "refused")
                counts[kind] += 1
                out.write(json.dumps(result, ensure_ascii=False) + "\n")
                out.flush()
    return counts


async def _wait_loaded(state: Any) -> None:
    while not state.loaded:
        if state.dead_reason is not None:
            raise ValueError(f"the engine did not start: {state.dead_reason}")
        await asyncio.sleep(0.05)


def _progress(tasks: list) -> Iterable:
    from tqdm import tqdm

    return tqdm(tasks, desc="run-batch", unit="req", file=sys.stderr, disable=None)  # None: off unless a terminal


def _requests(lines: list[tuple[int, str]]) -> list[dict[str, Any]]:
    """Each line as {custom_id, url, body} or {custom_id, error}: what _answer sends or reports."""
    seen: set[str] = set()
    parsed = []
    for number, line in lines:
        req = _parse_line(line, number)
        cid = req.get("custom_id")
        if "error" not in req and cid in seen:
            req = {"custom_id": cid, "error": f"line {number}: custom_id {cid!r} was used by an earlier line"}
        seen.add(cid)
        parsed.append(req)
    return parsed


def _parse_line(line: str, number: int) -> dict[str, Any]:
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        return {"custom_id": None, "error": f"line {number} is not valid JSON: {e.msg} (column {e.colno})"}
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
    async with gate:
        r = await client.post(req["url"], json=req["body"])
    try:
        body = r.json()
    except ValueError:  # every error the app sends is JSON; this keeps a line for anything else
        body = {"error": {"message": r.text[:2000], "type": "internal_error", "code": None}}
    response = {"status_code": r.status_code, "request_id": r.headers.get("x-request-id"), "body": body}
    return {"id": line_id, "custom_id": req["custom_id"], "response": response, "error": None}
