"""The engine-core wire protocol and loop, with a fake core: typed msgpack frames, no pickle,
aborts handled before the next step, and a clean exit when the API server's end closes."""

from __future__ import annotations

import queue
import socket
import threading

import msgpack
import pytest

from deepserve.engine.core import EngineCoreOutput, EngineCoreRequest
from deepserve.engine.core_process import (
    AbortRequests,
    AddRequests,
    Shutdown,
    StepOutputs,
    _reader,
    decode,
    encode,
    read_frame,
    serve_core,
)
from deepserve.engine.scheduler import SchedulerStats
from deepserve.sampling_params import SamplingParams


class FakeCore:
    """Emits one token per step per request until max_tokens; records what it was told."""

    def __init__(self) -> None:
        self.requests: dict[str, list[int]] = {}
        self.max_tokens: dict[str, int] = {}
        self.log: list[str] = []

    def add_request(self, req: EngineCoreRequest) -> None:
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
