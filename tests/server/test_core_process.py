"""The engine-core wire protocol and loop, with a fake core: typed msgpack frames, no pickle,
aborts handled before the next step, a refused request reported without stopping the others, and
a clean exit when the API server's end closes. One test runs the real engine process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest

from deepserve.config import EngineArgs
from deepserve.engine.core import EngineCoreOutput, EngineCoreRequest
from deepserve.engine.core_process import (
    AbortRequests,
    AddRequests,
    EngineFailed,
    Shutdown,
    StepOutputs,
    _child_env,
    _reader,
    decode,
    encode,
    read_frame,
    serve_core,
    spawn_core_process,
)
from deepserve.engine.scheduler import SchedulerStats
from deepserve.sampling_params import SamplingParams
from deepserve.server import async_llm
from deepserve.server.async_llm import AsyncLLM, RequestFailedError, ServerStoppingError


class FakeCore:
    """Emits one token per step per request until max_tokens; records what it was told."""

    def __init__(self) -> None:
        self.requests: dict[str, list[int]] = {}
        self.max_tokens: dict[str, int] = {}
        self.log: list[str] = []

    def add_request(self, req: EngineCoreRequest) -> None:
        if req.request_id.startswith("crash"):
            raise RuntimeError("runner bug")
        self.requests[req.request_id] = []
        self.max_tokens[req.request_id] = req.sampling_params.max_tokens

    def abort_requests(self, ids: list[str]) -> None:
        for rid in ids:
            self.requests.pop(rid, None)
            self.log.append(f"abort {rid}")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[EngineCoreOutput]:
        self.log.append("step")
        outs = []
        for rid, toks in list(self.requests.items()):
            toks.append(len(toks))
            done = len(toks) >= self.max_tokens[rid]
            outs.append(EngineCoreOutput(rid, [toks[-1]], "length" if done else None, None, None, None, 0))
            if done:
                del self.requests[rid]
        return outs

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.requests), 0, 0.5, 0, 0, 0)


def request(rid: str, max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens, seed=2**64 - 1), [0], 0.0)


def test_round_trip_all_fields():
    req = request("r", 5)
    msg = decode(encode(AddRequests([req.to_dict()]))[4:])
    assert isinstance(msg, AddRequests)
    assert EngineCoreRequest.from_dict(msg.requests[0]) == req
    out = EngineCoreOutput("r", [7], "stop", "</s>", [[(7, -0.5, 1), (8, -1.0, 2)]], None, 3)
    back = decode(encode(StepOutputs([out.to_dict()], {"num_running": 1}, {"r": 0.25}))[4:])
    assert EngineCoreOutput.from_dict(back.outputs[0]) == out and back.queue_times == {"r": 0.25}


def test_messages_share_their_lists_instead_of_deep_copying():
    # dataclasses.asdict deep-copied every token: ~13 ms an engine step for 256 outputs on one CPU core,
    # on the core process's step loop. The dicts are packed at once, so sharing the lists is safe.
    import dataclasses

    out = EngineCoreOutput("r", [7, 8])
    assert out.to_dict()["new_token_ids"] is out.new_token_ids
    req = request("r", 5)
    d = req.to_dict()
    assert d["prompt_token_ids"] is req.prompt_token_ids and isinstance(d["sampling_params"], dict)
    # The bytes on the wire are what the deep-copying packing sent (logprob tuples, nested params and all).
    outs = [EngineCoreOutput("r", [7], "stop", "</s>", [[(7, -0.5, 1), (8, -1.0, 2)]], [[(3, -0.1, 1)]], 3), out]
    step = StepOutputs([o.to_dict() for o in outs], {"num_running": 1}, {"r": 0.25}, {"x": {"error": "e"}})
    deep = msgpack.packb({"type": "StepOutputs", **dataclasses.asdict(step)}, use_bin_type=True)
    assert encode(step)[4:] == deep
    deep_req = {**dataclasses.asdict(req), "sampling_params": dataclasses.asdict(req.sampling_params)}
    assert encode(AddRequests([d]))[4:] == msgpack.packb({"type": "AddRequests", "requests": [deep_req]},
                                                         use_bin_type=True)


@pytest.mark.parametrize("payload", [{"type": "Exec", "code": "x"}, {"type": "AbortRequests"},
                                     {"type": "AbortRequests", "request_ids": [], "extra": 1}, [1, 2], {}])
def test_unknown_or_malformed_messages_rejected(payload):
    with pytest.raises(ValueError, match="malformed"):
        decode(msgpack.packb(payload))


def test_serve_loop_with_fake_core():
    ours, theirs = socket.socketpair()
    core, inbox = FakeCore(), queue.Queue()
    threading.Thread(target=_reader, args=(theirs, inbox), daemon=True).start()
    result = {}
    loop = threading.Thread(target=lambda: result.setdefault("rc", serve_core(core, theirs, inbox)), daemon=True)
    loop.start()
    ours.settimeout(10)
    frames = ours.makefile("rb")

    ours.sendall(encode(AddRequests([request("a", 3).to_dict(), request("b", 1000).to_dict()])))
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    finished = None
    while finished is None:
        msg = read_frame(frames)
        for o in msg.outputs:
            tokens[o["request_id"]] += o["new_token_ids"]
            if o["finish_reason"]:
                finished = o
    assert finished["request_id"] == "a" and tokens["a"] == [0, 1, 2]

    ours.sendall(encode(AbortRequests(["b"])))
    while read_frame(frames).stats["num_running"] != 0:
        pass
    assert "abort b" in core.log and not core.requests

    ours.sendall(encode(Shutdown()))
    loop.join(timeout=10)
    assert result["rc"] == 0
    ours.close()
    theirs.close()


def test_loop_exits_when_api_server_disappears():
    ours, theirs = socket.socketpair()
    inbox = queue.Queue()
    threading.Thread(target=_reader, args=(theirs, inbox), daemon=True).start()
    ours.close()  # the API server died
    assert serve_core(FakeCore(), theirs, inbox) == 0
    theirs.close()


def start_loop(core: FakeCore) -> tuple[socket.socket, threading.Thread, dict]:
    ours, theirs = socket.socketpair()
    inbox = queue.Queue()
    threading.Thread(target=_reader, args=(theirs, inbox), daemon=True).start()
    result: dict = {}
    loop = threading.Thread(target=lambda: result.setdefault("rc", serve_core(core, theirs, inbox)), daemon=True)
    loop.start()
    ours.settimeout(10)
    return ours, loop, result


class BigStepCore(FakeCore):
    """FakeCore whose steps are counted (`steps`), each output carrying 2,000 tokens (a few KB a frame), and
    which raises at step `fail_at`."""

    steps = 0
    fail_at = 0

    def step(self) -> list[EngineCoreOutput]:
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("kernel fault")
        outs = super().step()
        return [EngineCoreOutput(o.request_id, o.new_token_ids * 2000, o.finish_reason, None, None, None, 0)
                for o in outs]


def wait_until_steps_stop(core: BigStepCore, limit_s: float = 30) -> int:
    """The core's step count once it has not moved for 0.5 s (its send blocked), or after limit_s."""
    deadline, last = time.monotonic() + limit_s, -1
    while core.steps != last and time.monotonic() < deadline:
        last = core.steps
        time.sleep(0.5)
    return core.steps


def test_send_thread_keeps_the_engine_stepping_while_the_api_server_reads_nothing(monkeypatch):
    # DEEPSERVE_CORE_SEND_THREAD=1: the API server reads nothing until the core has taken 100 steps (a
    # sendall on the step loop stopped at 50, when the socket's buffer was full); then every frame
    # arrives, in order, and the loop shuts down cleanly.
    monkeypatch.setenv("DEEPSERVE_CORE_SEND_THREAD", "1")
    core = BigStepCore()
    ours, loop, result = start_loop(core)
    ours.sendall(encode(AddRequests([request("long", 100).to_dict()])))
    assert wait_until_steps_stop(core) == 100, f"the engine stopped at step {core.steps} while nobody read"
    assert "engine-sender" in {t.name for t in threading.enumerate()}
    frames, tokens = ours.makefile("rb"), []
    while not tokens or tokens[-1] != 99:
        for o in read_frame(frames).outputs:
            tokens.append(o["new_token_ids"][0])
            assert o["new_token_ids"] == [tokens[-1]] * 2000
    assert tokens == list(range(100))
    ours.sendall(encode(Shutdown()))
    loop.join(timeout=10)
    assert result["rc"] == 0 and "engine-sender" not in {t.name for t in threading.enumerate()}


def test_send_thread_ends_the_loop_when_the_api_server_goes_away_behind_a_full_queue(monkeypatch):
    # The API server stops reading until the sender's queue and the socket are full (the step loop blocks),
    # then its end closes: the loop must end (0), not wait forever on a queue nobody empties.
    monkeypatch.setenv("DEEPSERVE_CORE_SEND_THREAD", "1")
    core = BigStepCore()
    core.add_request(request("long", 10**9))
    ours, theirs = socket.socketpair()
    result: dict = {}
    loop = threading.Thread(target=lambda: result.setdefault("rc", serve_core(core, theirs, queue.Queue())),
                            daemon=True)
    loop.start()
    blocked_at = wait_until_steps_stop(core)
    assert blocked_at < 10**6  # blocked: nobody reads
    ours.close()
    loop.join(timeout=10)
    assert not loop.is_alive() and result["rc"] == 0
    theirs.close()


def test_send_thread_sends_engine_failed_after_every_queued_frame(monkeypatch):
    # The core fails at step 80 while the API server reads nothing: the 79 steps' frames come first, then
    # EngineFailed, and the loop returns 1.
    monkeypatch.setenv("DEEPSERVE_CORE_SEND_THREAD", "1")
    core = BigStepCore()
    core.fail_at = 80
    ours, loop, result = start_loop(core)
    ours.sendall(encode(AddRequests([request("long", 10**9).to_dict()])))
    wait_until_steps_stop(core)
    time.sleep(2.5)  # longer than a flush that gives up after 2 s would wait
    frames, messages = ours.makefile("rb"), []
    while not messages or not isinstance(messages[-1], EngineFailed):
        messages.append(read_frame(frames))
    tokens = [o["new_token_ids"][0] for m in messages[:-1] for o in m.outputs]
    assert tokens == list(range(79)) and "kernel fault" in messages[-1].error
    loop.join(timeout=10)
    assert result["rc"] == 1


def test_refused_request_is_reported_and_the_loop_serves_on():
    core = FakeCore()
    ours, loop, result = start_loop(core)
    frames = ours.makefile("rb")
    bad = request("bad", 4).to_dict()
    bad["sampling_params"]["min_tokens"] = 100  # > max_tokens: SamplingParams refuses it in the child
    ours.sendall(encode(AddRequests([bad, request("crash", 2).to_dict(), request("good", 2).to_dict()])))
    failed, finished = {}, []
    while "good" not in finished:
        msg = read_frame(frames)
        failed.update(msg.failed)
        finished += [o["request_id"] for o in msg.outputs if o["finish_reason"]]
    assert failed["bad"]["invalid"] is True and "min_tokens" in failed["bad"]["error"]
    assert failed["crash"] == {"error": "runner bug", "invalid": False}
    assert set(core.max_tokens) == {"good"}
    ours.sendall(encode(AddRequests([request("after", 1).to_dict()])))
    while not any(o["request_id"] == "after" and o["finish_reason"] for o in read_frame(frames).outputs):
        pass
    ours.sendall(encode(Shutdown()))
    loop.join(timeout=10)
    assert result["rc"] == 0


def test_real_engine_process_refuses_one_request_and_serves_the_next():
    """The request reaches the real engine child (as if every API check missed it): only that
    request fails, as invalid, and the engine keeps serving."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    async def run() -> None:
        llm = AsyncLLM.from_engine_args(EngineArgs(max_model_len=128, cpu_kv_cache_gib=0.02))
        await llm.start()
        try:
            bad = llm.prepare("bad", [5, 6, 7], SamplingParams(max_tokens=4))
            bad[0].sampling_params.min_tokens = 10**5
            with pytest.raises(RequestFailedError, match="min_tokens") as e:
                async for _ in llm.generate("bad", None, bad):
                    pass
            assert e.value.invalid and not llm.streams
            good = llm.prepare("good", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True, n=2))
            outs = [o async for o in llm.generate("good", None, good)]
            assert outs[-1].finished and [len(c.token_ids) for c in outs[-1].outputs] == [4, 4]
            assert llm.dead_reason is None and llm.client.proc.poll() is None
        finally:
            await llm.shutdown()

    asyncio.run(run())


def test_abort_all_ends_open_and_not_yet_started_requests_but_keeps_finished_results():
    # The server's second signal: streams already open end with ServerStoppingError; a generate()
    # created but not yet iterated (a response whose body runs later) is refused the same way instead
    # of reaching the engine; a request whose final result is in keeps it.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    async def run() -> None:
        llm = AsyncLLM.from_engine_args(EngineArgs(max_model_len=128, cpu_kv_cache_gib=0.02))
        await llm.start()
        try:
            done_req = llm.prepare("done", [5, 6], SamplingParams(max_tokens=2, ignore_eos=True))
            done = llm.generate("done", None, done_req)
            first = await done.__anext__()
            while not first.finished:  # read up to the final result, not past it
                first = await done.__anext__()
            running = llm.generate("long", None, llm.prepare("long", [5, 6, 7], SamplingParams(
                max_tokens=100, ignore_eos=True)))
            await running.__anext__()
            later = llm.generate("later", None, llm.prepare("later", [8], SamplingParams(max_tokens=4)))
            assert llm.abort_all("test") == 1
            with pytest.raises(ServerStoppingError, match="test"):
                async for _ in running:
                    pass
            with pytest.raises(ServerStoppingError, match="test"):
                await later.__anext__()
            assert not llm.streams or list(llm.streams) == ["done"]
            await done.aclose()
        finally:
            await llm.shutdown()

    asyncio.run(run())


def test_reader_reports_the_end_of_the_connection_before_shutdown():
    ours, theirs = socket.socketpair()
    inbox, ended = queue.Queue(), threading.Event()
    t = threading.Thread(target=_reader, args=(theirs, inbox, ended.set), daemon=True)
    t.start()
    ours.close()
    t.join(timeout=10)
    assert ended.is_set() and isinstance(inbox.get_nowait(), Shutdown)
    theirs.close()


def test_child_exits_when_the_server_goes_away_while_it_loads(tmp_path):
    # The server spawns the child before its own start-up work; if that work fails (or the server is
    # killed) the child must not go on loading a model for nobody: it exits on the connection's end,
    # before building the engine (its log says so; a child that loaded first would not).
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "core.sock"))
    listener.listen(1)
    listener.settimeout(120)
    cmd = [sys.executable, "-m", "deepserve.engine.core_process", "--address", str(tmp_path / "core.sock"),
           "--engine-args", json.dumps({"max_model_len": 128, "cpu_kv_cache_gib": 0.02})]
    proc = subprocess.Popen(cmd, env=_child_env(), stderr=subprocess.PIPE, text=True)
    try:
        conn, _ = listener.accept()
        conn.close()
        _, err = proc.communicate(timeout=120)
    finally:
        listener.close()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert "went away while the engine was loading" in err and "start-up:" not in err
    assert not (tmp_path / "core.sock").exists()  # the child removed the path once connected


def _spawn_child(tmp_path, engine_args: dict) -> tuple[socket.socket, subprocess.Popen]:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "core.sock"))
    listener.listen(1)
    cmd = [sys.executable, "-m", "deepserve.engine.core_process", "--address", str(tmp_path / "core.sock"),
           "--engine-args", json.dumps(engine_args)]
    return listener, subprocess.Popen(cmd, env=_child_env(), stderr=subprocess.PIPE, text=True)


def _wait(condition, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_connection_never_accepted_ends_the_loading_child_without_an_error(tmp_path):
    # A server that stops before its lifespan accepts the child closes its listener: the pending
    # connection is reset (not EOF), which is the same news and no error.
    listener, proc = _spawn_child(tmp_path, {"max_model_len": 128, "cpu_kv_cache_gib": 0.02})
    try:
        _wait(lambda: not (tmp_path / "core.sock").exists(), "the child to connect")  # it unlinks then
        listener.close()
        _, err = proc.communicate(timeout=120)
    finally:
        listener.close()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "went away while the engine was loading" in err
    assert "read failed" not in err and "ERROR" not in err


def _proc_file(pid: int, name: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read()
    except OSError:
        return b""  # gone


def _stat(pid: int) -> list[bytes]:
    """/proc/PID/stat's fields after the command name: state, parent pid, ..."""
    text = _proc_file(pid, "stat")
    return text.rsplit(b")", 1)[1].split() if text else []


def _children_of(pid: int) -> set[int]:
    return {int(e) for e in os.listdir("/proc") if e.isdigit() and _stat(int(e))[1:2] == [str(pid).encode()]}


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process parents from /proc")
def test_ranks_of_a_child_that_leaves_while_loading_leave_too(tmp_path):
    # Tensor parallel on CPU (gloo): the engine process spawns rank 1, then its server goes away; the
    # rank must not go on loading (and, on a GPU, holding memory) for nobody.
    listener, proc = _spawn_child(tmp_path, {"max_model_len": 128, "cpu_kv_cache_gib": 0.02,
                                             "tensor_parallel_size": 2, "device": "cpu"})
    ranks: set[int] = set()
    try:
        conn, _ = listener.accept()
        _wait(lambda: ranks.update(_ranks_of(proc.pid)) or ranks, "the engine to start its rank")
        conn.close()
        proc.communicate(timeout=120)
        _wait(lambda: not any(_alive(r) for r in ranks), "the rank to exit", 30)
    finally:
        listener.close()
        if proc.poll() is None:
            proc.kill()
        for r in ranks:
            with contextlib.suppress(OSError):
                os.kill(r, 9)


def _ranks_of(engine: int) -> set[int]:
    """The engine's ranks: spawned children (DEEPSERVE_RANK_START_METHOD=spawn), or the forks of its rank
    fork server (runner/rank_start.py; the server itself is no rank), not multiprocessing's tracker."""
    ranks = set()
    for child in _children_of(engine):
        cmdline = _proc_file(child, "cmdline")
        if b"spawn_main" in cmdline:
            ranks.add(child)
        elif b"multiprocessing.forkserver" in cmdline:
            ranks |= _children_of(child)
    return ranks


def _alive(pid: int) -> bool:
    return _stat(pid)[:1] not in ([], [b"Z"])


@pytest.mark.parametrize(("args", "said"), [
    (dict(max_model_len=10**9), "max_model_len"),
    # A missing key file is refused by the server's process too, at once, not by the engine after a traceback.
    (dict(decryption_key_file="/nonexistent/deepserve.key"), "--decryption-key-file: cannot read"),
])
def test_a_server_side_start_up_failure_stops_the_spawned_child(monkeypatch, args, said):
    spawned = []

    def spawn(engine_args):
        spawned.append(spawn_core_process(engine_args))
        return spawned[-1]

    monkeypatch.setattr(async_llm, "spawn_core_process", spawn)
    with pytest.raises(ValueError, match=said):
        AsyncLLM.from_engine_args(EngineArgs(**args))
    assert len(spawned) == 1 and spawned[0].proc.poll() is not None
    assert not os.path.exists(spawned[0].tmpdir)


def test_a_failure_to_build_is_logged_with_its_traceback_unless_a_refusal_and_reaches_the_server(caplog):
    # A ValueError may be a bug: logged with its traceback, as anything else. A ConfigRefused (input the code
    # checked, e.g. a folder without config.json) is one line. The server gets each one's type and message.
    from deepserve.engine.core_process import _HEADER, _report_failure
    from deepserve.errors import ConfigRefused

    sent: list[bytes] = []
    errors = (ValueError("Unrecognized model in /tmp/x"), RuntimeError("CUDA error: an illegal access"),
              ConfigRefused("model folder '/tmp/x' has no config.json"))
    for error in errors:
        caplog.clear()
        with caplog.at_level("ERROR", logger="deepserve.engine.core_process"):
            try:
                raise error
            except Exception as e:
                assert _report_failure(e, sent.append) == 1
        logged = [r for r in caplog.records if r.levelname == "ERROR"]
        assert len(logged) == 1
        if isinstance(error, ConfigRefused):
            assert logged[0].exc_info is None and "has no config.json" in logged[0].getMessage()
        else:
            assert logged[0].exc_info[1] is error
    said = [decode(frame[_HEADER.size:]) for frame in sent]
    assert all(isinstance(m, EngineFailed) for m in said)
    assert [m.error for m in said] == ["ValueError: Unrecognized model in /tmp/x",
                                       "RuntimeError: CUDA error: an illegal access",
                                       "ConfigRefused: model folder '/tmp/x' has no config.json"]


def test_the_engine_process_takes_a_numeric_log_level(tmp_path):
    # spawn_core_process passes the server's level as a number: a custom level (25) has no name, and its
    # "Level 25" once ended the engine process at start ("Unknown level").
    cmd = [sys.executable, "-m", "deepserve.engine.core_process", "--address", str(tmp_path / "gone.sock"),
           "--engine-args", "{}", "--log-level", "25"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert done.returncode == 0, done.stderr[-2000:]
    # No server at that address: the engine says so at WARNING (30 >= 25) and exits without loading.
    assert "engine WARNING the API server went away before the engine connected" in done.stderr
