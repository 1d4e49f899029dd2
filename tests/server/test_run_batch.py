"""`deepserve run-batch`: OpenAI's batch JSONL in, one result line per request line out, in order, through the
real CLI and engine process with the demo model. Bodies are judged by the openai package's own response
types; the greedy completion against the offline LLM API on the same model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import openai.types
import openai.types.chat
import pytest
from serverkit import ROOT

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "temperature": 0}
COMPLETION = {"prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0, "logprobs": 1}


def _line(custom_id, url, body, **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra})


LINES = [
    _line("chat", "/v1/chat/completions", CHAT),
    _line("completion", "/v1/completions", COMPLETION),
    _line("refused", "/v1/completions", {"prompt": "x", "temperature": 9}),
    "",  # blank lines are skipped, as JSONL readers do; the line numbers in messages are the file's
    "{not json",
    _line("completion", "/v1/completions", {"prompt": "again"}),
    _line("embed", "/v1/embeddings", {"input": "x"}),
    _line("streamed", "/v1/completions", {"prompt": "x", "stream": True}),
    _line("n2", "/v1/chat/completions", {**CHAT, "n": 2, "temperature": 0.8, "seed": 3}),
    # U+2028 inside a JSON string, unescaped: one line all the same (str.splitlines would cut it in two)
    _line("separator", "/v1/completions", {"prompt": "a\u2028b", "max_tokens": 2}).replace("\\u2028", "\u2028"),
]
NOT_UTF8 = b'{"custom_id": "latin1", "url": "/v1/completions", "body": {"prompt": "caf\xe9"}}'


def run_batch(tmp_path, lines: list[str], *flags: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes("\n".join(lines).encode() + b"\n" + NOT_UTF8 + b"\n")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-m", "deepserve.entrypoints.cli", "run-batch", "-i", str(src), "-o",
                           str(dst), "--max-model-len", "512", "--cpu-kv-cache-gib", "0.05", *flags],
                          capture_output=True, text=True, env=env, timeout=300)
    results = [json.loads(line) for line in dst.read_text().splitlines()] if dst.exists() else []
    return done, results


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    return run_batch(tmp_path_factory.mktemp("batch"), LINES)


def test_each_request_line_gets_its_result_in_order(batch):
    done, results = batch
    assert done.returncode == 0, done.stderr[-3000:]
    # a repeated custom_id's error line has custom_id null: a reader keyed by custom_id keeps the first's result
    assert [r["custom_id"] for r in results] == ["chat", "completion", "refused", None, None, "embed",
                                                "streamed", "n2", "separator", None]
    assert len({r["id"] for r in results}) == len(results) and all(r["id"].startswith("batch_req_") for r in results)
    assert "10 lines: 4 answered 200, 1 refused (4xx), 0 failed (5xx), 5 not requests" in done.stderr
    assert results[8]["response"]["body"]["usage"]["completion_tokens"] == 2
    assert results[9]["error"]["message"] == "line 11 is not UTF-8 text"


def test_answers_are_the_apis_own_responses(batch):
    _, results = batch
    chat, completion, n2 = results[0]["response"], results[1]["response"], results[7]["response"]
    assert chat["status_code"] == completion["status_code"] == n2["status_code"] == 200
    parsed = openai.types.chat.ChatCompletion.model_validate(chat["body"])
    assert parsed.choices[0].finish_reason in ("length", "stop") and 0 < parsed.usage.completion_tokens <= 6
    assert chat["request_id"] and chat["body"]["id"].endswith(chat["request_id"])
    assert len(openai.types.chat.ChatCompletion.model_validate(n2["body"]).choices) == 2
    text = openai.types.Completion.model_validate(completion["body"])
    assert len(text.choices[0].logprobs.tokens) == text.usage.completion_tokens == 5
    from deepserve import LLM, SamplingParams

    offline = LLM(device="cpu", num_gpu_blocks_override=64, max_model_len=512)
    want = offline.generate([COMPLETION["prompt"]], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].text
    assert text.choices[0].text == want


def test_bad_lines_and_refusals_say_why(batch):
    _, results = batch
    refused = results[2]
    assert refused["error"] is None and refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["param"] == "temperature"
    reasons = {r["custom_id"]: r["error"]["message"] for r in results[3:7] if r["custom_id"]}
    reasons[None] = " ".join(r["error"]["message"] for r in results[3:5])  # bad JSON; the repeated custom_id
    assert all(r["response"] is None and r["error"]["code"] == "invalid_batch_line" for r in results[3:7])
    assert "line 5 is not valid JSON" in reasons[None]
    assert "custom_id 'completion' was used by an earlier line" in reasons[None]
    assert "url must be one of /v1/chat/completions, /v1/completions" in reasons["embed"]
    assert "body.stream must be false" in reasons["streamed"]


def test_results_alone_on_stdout_and_a_failed_start_leaves_the_output_file(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "deepserve.entrypoints.cli", "run-batch", "-i", "-", "--max-model-len", "512"]
    done = subprocess.run([*cmd, "-o", "-", "--cpu-kv-cache-gib", "0.05"], input=LINES[1] + "\n" + LINES[0] + "\n",
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [json.loads(line)["custom_id"] for line in done.stdout.splitlines()] == ["completion", "chat"]
    # The engine process fails at start-up (a KV cache smaller than one sequence): the file is left as it was.
    kept = tmp_path / "results.jsonl"
    kept.write_text("earlier results\n")
    failed = subprocess.run([*cmd, "-o", str(kept), "--cpu-kv-cache-gib", "0.000001"], input=LINES[0],
                            capture_output=True, text=True, env=env, timeout=300)
    assert failed.returncode == 2 and "the engine did not start" in failed.stderr
    assert kept.read_text() == "earlier results\n"


PRINTS_DURING_THE_RUN = """
import os, sys
from deepserve.entrypoints.batch import _results_stdout
with _results_stdout() as results:
    print("print noise")  # buffered: PYTHONUNBUFFERED is unset
    os.write(1, b"fd noise\\n")  # what an engine process or a native library writes
    results.write("RESULT\\n")
print("after the run")
"""


def test_with_results_on_stdout_what_else_is_printed_meanwhile_goes_to_stderr():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run([sys.executable, "-c", PRINTS_DURING_THE_RUN], capture_output=True, text=True,
                          env={**env, "PYTHONPATH": ROOT}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "RESULT\nafter the run\n"
    assert "print noise" in done.stderr and "fd noise" in done.stderr


def test_a_line_utf8_cannot_spell_is_written_escaped():
    from deepserve.entrypoints.batch import _json_line

    line = _json_line({"custom_id": "caf\u00e9 \ud800"})
    assert json.loads(line) == {"custom_id": "caf\u00e9 \ud800"} and line.isascii()
    assert _json_line({"custom_id": "caf\u00e9"}) == '{"custom_id": "caf\u00e9"}\n'


def test_a_request_that_gets_no_answer_is_a_line_saying_why():
    import asyncio

    from deepserve.entrypoints.batch import _answer, _kind

    class Broken:
        async def post(self, url, json):
            raise RuntimeError("no route")

    req = {"custom_id": "x", "url": "/v1/completions", "body": {}}
    result = asyncio.run(_answer(Broken(), asyncio.Semaphore(1), req))
    assert result["response"] is None and result["error"] == {"code": "internal_error",
                                                               "message": "RuntimeError: no route"}
    assert _kind(result) == "failed"


@pytest.mark.parametrize(("args", "says"), [
    (["-i", "{tmp}/nope.jsonl", "-o", "{tmp}/out.jsonl"], "--input-file {tmp}/nope.jsonl: no such file"),
    (["-i", "{tmp}/in.jsonl", "-o", "{tmp}/in.jsonl"], "is the input file: writing it would erase the requests"),
    (["-i", "{tmp}/in.jsonl", "-o", "{tmp}/no-folder/out.jsonl"], "its folder {tmp}/no-folder does not exist"),
])
def test_bad_files_are_one_line_naming_the_flag_before_anything_loads(tmp_path, args, says):
    (tmp_path / "in.jsonl").write_text(LINES[0] + "\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-m", "deepserve.entrypoints.cli", "run-batch",
                           *[a.format(tmp=tmp_path) for a in args]], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 2 and says.format(tmp=tmp_path) in done.stderr and "Traceback" not in done.stderr
    assert "engine" not in done.stderr  # refused before the model loads
    assert (tmp_path / "in.jsonl").read_text() == LINES[0] + "\n"


def test_a_byte_order_mark_before_the_first_line_is_not_part_of_it():
    from deepserve.entrypoints.batch import _parse_line

    assert "error" not in _parse_line(LINES[0], 1)
    import tempfile

    from deepserve.entrypoints.batch import _input_lines

    with tempfile.NamedTemporaryFile("wb", suffix=".jsonl", delete=False) as f:
        f.write(b"\xef\xbb\xbf" + LINES[0].encode() + b"\r\n" + LINES[1].encode() + b"\n")
    assert [line for _, line in _input_lines(f.name)] == [LINES[0], LINES[1]]
    os.unlink(f.name)


def test_a_line_json_cannot_read_is_that_lines_error_not_the_runs():
    from deepserve.entrypoints.batch import _parse_line

    huge = '{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 1%s}}'
    said = _parse_line(huge % ("0" * sys.get_int_max_str_digits()), 3)
    assert said["custom_id"] is None and said["error"].startswith("line 3 holds a number too long to read")
    assert _parse_line("[" * 100_000 + "]" * 100_000, 4)["error"] == "line 4 is nested too deeply"


def test_by_default_the_engine_process_logs_warnings_only(batch):
    # --log-level's help: WARNING for every command but serve and router. The engine process once logged
    # its INFO start-up lines whatever the flag said.
    done, _ = batch
    assert " INFO " not in done.stderr, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1].startswith("run-batch: ")  # the counts: printed, not logged
