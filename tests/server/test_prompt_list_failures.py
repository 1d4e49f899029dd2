"""When one prompt of a completion list fails, the audit says so of that prompt alone: its record is an
error, the others (ended because of it) are aborted; all carry the response's status. Unit level: the
engine never fails one part of a list that the API's checks let through, so no end-to-end request can
make it happen."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from deepserve.server import serving, streaming
from deepserve.server.errors import APIError, bad_request


class Part:
    """What _collect_all and streaming.end_parts use of a Generation: its id, abort, finish."""

    def __init__(self, i: int, aborted: list) -> None:
        self.request_id, self.finished, self.outcome = f"cmpl-x-{i}", False, None
        self.st = SimpleNamespace(engine=SimpleNamespace(abort=aborted.append))

    def finish(self, outcome: str, status: int = 200) -> None:
        if not self.finished:
            self.finished, self.outcome = True, (outcome, status)


def collecting_with(monkeypatch, collect) -> None:
    """_collect_all with `collect` in place of each part's generation, and no client to lose."""
    async def awaited(request, work):
        return await work

    monkeypatch.setattr(streaming, "collect", collect)
    monkeypatch.setattr(serving, "_generate", lambda gen, req, core: None)
    monkeypatch.setattr(serving, "unless_disconnected", awaited)


def test_collect_all_audits_the_failed_prompt_as_the_error_and_the_rest_as_aborted(monkeypatch):
    async def collect(gen, req, agen, chat):
        if gen.request_id.endswith("-1"):
            await asyncio.sleep(0)
            raise bad_request("prompt 1 refused", param="prompt.1")
        await asyncio.sleep(30)  # still generating when its sibling fails

    collecting_with(monkeypatch, collect)
    aborted: list = []
    parts = [Part(i, aborted) for i in range(3)]

    async def run() -> None:
        with pytest.raises(APIError) as e:
            await serving._collect_all(None, SimpleNamespace(n=1), parts, [[], [], []], chat=False)
        assert e.value.headers["x-request-id"] == "cmpl-x"

    asyncio.run(run())
    assert [p.outcome for p in parts] == [("aborted", 400), ("error", 400), ("aborted", 400)]
    assert sorted(aborted) == ["cmpl-x-0", "cmpl-x-1", "cmpl-x-2"]


@pytest.mark.parametrize(("code", "outcome"), [("engine_dead", "error"), ("server_stopping", "aborted")])
def test_the_engines_death_or_the_servers_shutdown_ends_every_prompt_alike(monkeypatch, code, outcome):
    # Raised through one part's task (it woke first), but no part failed alone: the engine's death is every
    # prompt's error; the shutdown aborted them all, as the stream records it (no error to alert on).
    async def collect(gen, req, agen, chat):
        if gen.request_id.endswith("-0"):
            await asyncio.sleep(0)
            raise APIError(503, "the engine failed, or the server is stopping", code=code)
        await asyncio.sleep(30)

    collecting_with(monkeypatch, collect)
    parts = [Part(i, []) for i in range(2)]
    with pytest.raises(APIError):
        asyncio.run(serving._collect_all(None, SimpleNamespace(n=1), parts, [[], []], chat=False))
    assert [p.outcome for p in parts] == [(outcome, 503)] * 2


def test_one_prompt_that_fails_is_still_an_error(monkeypatch):
    async def collect(gen, req, agen, chat):
        raise RuntimeError("boom")

    collecting_with(monkeypatch, collect)
    part = Part(0, [])
    with pytest.raises(RuntimeError):
        asyncio.run(serving._collect_all(None, SimpleNamespace(n=1), [part], [[]], chat=False))
    assert part.outcome == ("error", 500)


def test_merged_names_the_part_that_failed():
    async def outputs(i: int, fail_after: int | None):
        for k in range(3):
            if k == fail_after:
                raise RuntimeError(f"part {i}")
            yield f"{i}.{k}"
            await asyncio.sleep(0)

    async def run(agens) -> tuple[list, list[int]]:
        seen, failed = [], []
        with pytest.raises(RuntimeError):
            async for _part, out in streaming._merged(agens, failed):
                seen.append(out)
        return seen, failed

    seen, failed = asyncio.run(run([outputs(0, None), outputs(1, 2), outputs(2, None)]))
    assert failed == [1] and "1.1" in seen
    assert asyncio.run(run([outputs(0, 1)])) == (["0.0"], [0])  # one part: iterated directly


def test_end_aborts_the_unfailed_parts_and_keeps_finished_ones():
    aborted: list = []
    parts = [Part(i, aborted) for i in range(4)]
    parts[3].finish("ok")  # finished before the failure: untouched
    streaming.end_parts(parts, "error", 400, [2])
    assert [p.outcome for p in parts] == [("aborted", 400), ("aborted", 400), ("error", 400), ("ok", 200)]
    assert aborted == ["cmpl-x-0", "cmpl-x-1", "cmpl-x-2"]
    unknown = [Part(i, []) for i in range(2)]  # no part named (the engine died, or the stream's own code)
    streaming.end_parts(unknown, "error", 503, [])
    assert [p.outcome for p in unknown] == [("error", 503)] * 2
