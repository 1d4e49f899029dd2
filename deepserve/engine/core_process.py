"""The engine core in its own process, and the API server's client for it.

    API server process (asyncio)                    engine core process
    EngineCoreClient.add/abort  ── AddRequests ──▶  reader thread → inbox
                                ── AbortRequests ▶  loop: drain inbox, core.step()
    on_outputs(StepOutputs)     ◀── StepOutputs ──  outputs + scheduler stats (sent from the loop, or from
                                                    a sender thread with DEEPSERVE_CORE_SEND_THREAD=1)

Wire format: a 4-byte big-endian length, then a msgpack map whose "type" names one of the message
dataclasses below; decoding checks the type and its fields (no pickle, nothing executable). The
socket is a unix socket in a fresh 0700 directory, accepted only from the child we spawned.

Invariants: messages are handled before the next step, so an abort lands within one step; a request
the core refuses (a bad request that slipped past the API server's checks) is reported back in
`StepOutputs.failed` and everyone else keeps running; the child exits when the parent's end closes
(the parent died); the parent sees EOF when the child dies and reports it through `on_dead`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import queue
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, BinaryIO

import msgpack

from deepserve import envs
from deepserve.errors import ConfigRefused
from deepserve.heap import freeze_startup_heap

if TYPE_CHECKING:  # the core is built lazily, in the child process
    from deepserve.engine.core import EngineCore

logger = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")
MAX_FRAME = 512 * 1024 * 1024
_SEND_EVERY = 0.25  # seconds: stats reach the API server at least this often while busy
# Frames the sender thread may hold behind a reader that stopped reading: ~2.5 MB of 256-output frames, some
# 0.6 s of H200 decode steps (a full garbage collection in the API server took up to ~0.3 s on our CPU).
SEND_QUEUE_FRAMES = 64


@dataclass
class AddRequests:
    requests: list[dict[str, Any]]  # EngineCoreRequest.to_dict()


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass


@dataclass
class Ready:
    num_blocks: int
    max_model_len: int


@dataclass
class StepOutputs:
    outputs: list[dict[str, Any]]  # EngineCoreOutput.to_dict()
    stats: dict[str, Any]  # SchedulerStats fields
    queue_times: dict[str, float] = field(default_factory=dict)  # request id → seconds before first token
    # request id → {"error": message, "invalid": the request's own fault (ValueError), not the engine's}
    failed: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class EngineFailed:
    error: str


MESSAGES: dict[str, type] = {c.__name__: c for c in (AddRequests, AbortRequests, Shutdown, Ready,
                                                    StepOutputs, EngineFailed)}


def encode(msg: Any) -> bytes:
    # vars(): the message's fields, values shared (plain data msgpack walks); dataclasses.asdict would
    # deep-copy every element, ~8-13 ms a step for 256 outputs on one CPU core (bench/api_host_cost.py).
    body = msgpack.packb({"type": type(msg).__name__, **vars(msg)}, use_bin_type=True)
    return _HEADER.pack(len(body)) + body


def decode(body: bytes) -> Any:
    d = msgpack.unpackb(body, raw=False)
    cls = MESSAGES.get(d.pop("type", None)) if isinstance(d, dict) else None
    if cls is None or set(d) != {f.name for f in fields(cls)}:
        raise ValueError(f"malformed engine message: {str(d)[:200]}")
    return cls(**d)


def _body_size(header: bytes) -> int:
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME:
        raise ValueError(f"engine message of {size} bytes exceeds {MAX_FRAME}")
    return size


def read_frame(f: BinaryIO) -> Any | None:
    """The next message from a socket's file, None at EOF."""
    header = f.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    size = _body_size(header)
    body = f.read(size)
    return decode(body) if len(body) == size else None


# ---------------------------------------------------------------- the engine core process


def _reader(sock: socket.socket, inbox: queue.Queue, on_eof: Callable[[], None] | None = None) -> None:
    f = sock.makefile("rb")
    try:
        while (msg := read_frame(f)) is not None:
            inbox.put(msg)
    except ConnectionResetError:
        pass  # the server closed its listener before accepting us (it stopped during start-up): an end
    except (OSError, ValueError) as e:
        logger.error("engine socket read failed: %s", e)
    if on_eof is not None:
        on_eof()
    inbox.put(Shutdown())  # EOF: the API server is gone, so are its clients


def _drain(inbox: queue.Queue, block: bool) -> list[Any]:
    msgs = []
    try:
        msgs.append(inbox.get(timeout=1.0) if block else inbox.get_nowait())
        while True:
            msgs.append(inbox.get_nowait())
    except queue.Empty:
        return msgs


def _handle(core: Any, msgs: list[Any], added_at: dict[str, float], failed: dict[str, dict]) -> bool:
    """Apply messages to the core; False on Shutdown. Requests the core refuses land in `failed`."""
    for msg in msgs:
        if isinstance(msg, Shutdown):
            return False
        if isinstance(msg, AddRequests):
            for d in msg.requests:
                _add(core, d, added_at, failed)
        elif isinstance(msg, AbortRequests):
            core.abort_requests(msg.request_ids)
            for rid in msg.request_ids:
                added_at.pop(rid, None)
    return True


def _add(core: Any, d: dict[str, Any], added_at: dict[str, float], failed: dict[str, dict]) -> None:
    from deepserve.engine.core import EngineCoreRequest

    rid = str(d.get("request_id")) if isinstance(d, dict) else "?"
    try:
        req = EngineCoreRequest.from_dict(d)
        core.add_request(req)
    except Exception as e:  # one bad request must never take down everyone else's
        logger.warning("refused request %s: %s: %s", rid, type(e).__name__, e)
        failed[rid] = {"error": str(e) or type(e).__name__, "invalid": isinstance(e, ValueError)}
        return
    added_at[req.request_id] = time.monotonic()


class _Sender:
    """Frames to the API server from a thread of their own, in order (DEEPSERVE_CORE_SEND_THREAD=1). The API
    server reads on its event loop; while that loop is busy (a full garbage collection, a burst of streams)
    the socket's buffer (~200 KB: 5-6 steps of 256 outputs) fills, and a sendall on the step loop would stop
    the engine until the loop reads again. Here the step loop only queues a frame; a full queue (a reader
    stopped for longer than max_frames steps) blocks it as the socket did, but never past a failed send,
    which is raised on the step loop (the thread then discards what is queued, so nothing waits on it)."""

    def __init__(self, sock: socket.socket, max_frames: int = SEND_QUEUE_FRAMES) -> None:
        self.sock = sock
        self.frames: queue.Queue = queue.Queue(maxsize=max_frames)
        self.error: OSError | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="engine-sender")
        self.thread.start()

    def send(self, frame: bytes) -> None:
        while True:
            if self.error is not None:
                raise self.error
            try:
                self.frames.put(frame, timeout=0.2)
                return
            except queue.Full:
                continue

    def close(self, flush: bool, timeout: float) -> None:
        """Stop the thread: after the queued frames (flush, up to `timeout`), or dropping them."""
        while not flush:
            try:
                self.frames.get_nowait()
            except queue.Empty:
                break
        with contextlib.suppress(queue.Full):
            self.frames.put(None, timeout=timeout)
        self.thread.join(timeout)

    def _run(self) -> None:
        while (frame := self.frames.get()) is not None:
            if self.error is None:
                try:
                    self.sock.sendall(frame)
                except OSError as e:
                    self.error = e


def serve_core(core: Any, sock: socket.socket, inbox: queue.Queue) -> int:
    """Serve until the API server says Shutdown or goes away (0), or the core fails (1, after telling the API
    server: EngineFailed, behind every frame sent before it)."""
    sender = _Sender(sock) if envs.DEEPSERVE_CORE_SEND_THREAD else None
    send = sock.sendall if sender is None else sender.send
    failed = False
    try:
        return _serve(core, send, inbox)
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the API server went away (a unix socket closed with unread data resets)
    except Exception as e:
        failed = True
        return _report_failure(e, send)
    finally:
        if sender is not None:  # a Shutdown or a vanished reader: what is queued has nobody to read it
            sender.close(flush=failed, timeout=10.0 if failed else 2.0)


def _report_failure(e: Exception, send: Callable[[bytes], None]) -> int:
    """Log the core's failure and tell the API server (unless it is gone); the process's exit code. A
    ConfigRefused (input that was checked) is logged as its message alone; anything else, ValueErrors
    included, may be a bug and is logged with its traceback."""
    if isinstance(e, ConfigRefused):
        logger.error("engine core refused to start: %s", e)
    else:
        logger.exception("engine core failed")
    with contextlib.suppress(OSError):
        send(encode(EngineFailed(f"{type(e).__name__}: {e}")))
    return 1


def _serve(core: Any, send: Callable[[bytes], None], inbox: queue.Queue) -> int:
    added_at: dict[str, float] = {}  # request id → when it reached us, until its first output
    last_sent = 0.0
    while True:
        msgs = _drain(inbox, block=not core.has_unfinished_requests())
        failed: dict[str, dict] = {}
        if not _handle(core, msgs, added_at, failed):
            return 0
        start = time.monotonic()
        outputs = core.step() if core.has_unfinished_requests() else []
        queue_times = {o.request_id: start - added_at.pop(o.request_id) for o in outputs
                       if o.request_id in added_at and (o.new_token_ids or o.finish_reason)}
        now = time.monotonic()
        if outputs or msgs or now - last_sent > _SEND_EVERY:
            stats = dict(vars(core.stats()))
            send(encode(StepOutputs([o.to_dict() for o in outputs], stats, queue_times, failed)))
            last_sent = now


def _remove_socket_path(address: str) -> None:
    # Connected, the path is no longer needed (the server's listener and our connection live on): removed
    # here too, so a server killed before it cleaned up leaves no socket or private folder behind.
    with contextlib.suppress(OSError):
        os.unlink(address)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(address))  # only when empty: the folder the server made for it


def build_engine_core(engine_args: dict[str, Any]) -> EngineCore:
    """The engine core of a process of its own: it builds and warms its own grammar compiler, since it shares
    none with the API server's front end (EngineCore.from_config)."""
    from deepserve.config import EngineArgs
    from deepserve.engine.core import EngineCore

    return EngineCore.from_engine_args(EngineArgs(**engine_args), warm_grammars=True)


def run_core_process(address: str, engine_args: dict[str, Any], exit_if_orphaned: bool = False) -> int:
    """Connect, build the engine, say Ready, serve. With `exit_if_orphaned` (the real child process) the
    process exits at once when the API server goes away while the engine is still loading: the server
    spawns us before its own start-up work, so a server that fails there must not leave us loading a
    model (and holding GPU memory) for nobody."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
    except OSError as e:  # the server stopped before we started: its socket is gone
        logger.warning("the API server went away before the engine connected (%s); exiting", e)
        return 0
    _remove_socket_path(address)
    serving = threading.Event()

    def orphaned_while_loading() -> None:
        if exit_if_orphaned and not serving.is_set():
            logger.warning("the API server went away while the engine was loading; exiting")
            os._exit(0)

    # The server sends nothing before Ready, so reading from the start only watches for its end.
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(sock, inbox, orphaned_while_loading), daemon=True,
                     name="engine-reader").start()
    try:
        core = build_engine_core(engine_args)
        freeze_startup_heap("engine core")
        serving.set()
        sock.sendall(encode(Ready(core.num_blocks, core.config.model.max_model_len)))
        return serve_core(core, sock, inbox)
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the API server went away first
    except Exception as e:  # building the engine failed (serve_core reports its own failures)
        return _report_failure(e, sock.sendall)


# ---------------------------------------------------------------- the client, in the API server


@dataclass
class SpawnedCore:
    """An engine core process started but not yet connected to: it loads while its server starts up."""

    proc: subprocess.Popen
    listener: socket.socket
    tmpdir: str

    def close_listener(self) -> None:
        self.listener.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def kill(self) -> None:
        """For a server that fails before it connects: the child would otherwise load for nobody."""
        self.close_listener()  # the child sees its connection end and exits (exit_if_orphaned)
        self.proc.kill()
        self.proc.wait()


def spawn_core_process(engine_args: dict[str, Any], log_level: int | None = None) -> SpawnedCore:
    """The engine core process, logging at `log_level` (default: this process's level, see parent_log_level)."""
    tmpdir = tempfile.mkdtemp(prefix="deepserve-engine-")  # 0700: only our user can connect
    path = os.path.join(tmpdir, "core.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(1)
        listener.setblocking(False)
        cmd = [sys.executable, "-m", "deepserve.engine.core_process", "--address", path,
               "--engine-args", json.dumps(engine_args), "--log-level",
               str(parent_log_level() if log_level is None else log_level)]  # a number: custom levels have no name
        return SpawnedCore(subprocess.Popen(cmd, env=_child_env()), listener, tmpdir)
    except BaseException:
        listener.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise


class EngineCoreClient:
    """Talks to a spawned engine core process from the API server's event loop.

    `add` and `abort` never await: they are safe in `finally` blocks of cancelled tasks, which is
    where a client disconnect is noticed."""

    def __init__(self, spawned: SpawnedCore, on_outputs: Callable[[StepOutputs], None],
                 on_dead: Callable[[str], None]) -> None:
        self.spawned = spawned
        self.on_outputs = on_outputs
        self.on_dead = on_dead
        self.ready: Ready | None = None
        self.last_message = time.monotonic()
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task | None = None
        self._closing = False

    @property
    def proc(self) -> subprocess.Popen:
        return self.spawned.proc

    async def start(self) -> Ready:
        """Accept the spawned child's connection and wait for its Ready (the whole engine load)."""
        try:
            conn = await self._accept(self.spawned.listener)
        finally:
            self.spawned.close_listener()
        try:
            reader, self._writer = await asyncio.open_unix_connection(sock=conn)
        except BaseException:  # cancelled in between: the child must see its server gone
            conn.close()
            raise
        first = await _read_async(reader)
        if not isinstance(first, Ready):
            why = first.error if isinstance(first, EngineFailed) else "it exited during startup"
            await self.shutdown(timeout=5)
            raise RuntimeError(f"the engine core process failed to start: {why}")
        self.ready = first
        self._task = asyncio.create_task(self._read_loop(reader), name="engine-core-reader")
        return first

    async def _accept(self, listener: socket.socket) -> socket.socket:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await asyncio.wait_for(loop.sock_accept(listener), timeout=0.5)
            except TimeoutError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the engine core process exited with code {self.proc.returncode} "
                                       "before connecting; see its log above") from None
                continue
            if _peer_pid(conn) in (None, self.proc.pid):
                conn.setblocking(False)
                return conn
            conn.close()  # someone else raced to our socket

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        reason = "the engine core process closed its socket"
        try:
            while True:
                msg = await _read_async(reader)
                self.last_message = time.monotonic()
                if isinstance(msg, StepOutputs):
                    self.on_outputs(msg)
                elif isinstance(msg, EngineFailed):
                    reason = f"the engine core failed: {msg.error}"
                elif msg is None:
                    break
        except (OSError, ValueError, asyncio.IncompleteReadError) as e:
            reason = f"lost the engine core process: {e}"
        except Exception:  # a bug in on_outputs must not leave clients hanging
            logger.exception("engine output handling failed")
            reason = "engine output handling failed (see the log)"
        if not self._closing:
            code = self.proc.poll()
            self.on_dead(reason if code is None else f"{reason} (exit code {code})")

    def _send(self, msg: Any) -> None:
        if self._writer is None or self._writer.is_closing():
            return
        self._writer.write(encode(msg))

    def add(self, requests: list[Any]) -> None:
        self._send(AddRequests([r.to_dict() for r in requests]))

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(AbortRequests(list(request_ids)))

    def kill_if_unconnected(self) -> None:
        """For a server that stops before its lifespan connected to the child (uvicorn failing to start)."""
        if self._writer is None and self.proc.poll() is None:
            self.spawned.kill()

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._closing = True
        self._send(Shutdown())
        if self._writer is not None:
            self._writer.close()
        # Never connected (the server stopped while the child loaded): closing the listener ends the
        # child's pending connection, which it takes as the server gone (exit_if_orphaned).
        self.spawned.close_listener()
        try:
            await asyncio.to_thread(self.proc.wait, timeout)
        except subprocess.TimeoutExpired:
            logger.warning("engine core did not exit within %.0fs; killing it", timeout)
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)
        if self._task is not None:
            self._task.cancel()


async def _read_async(reader: asyncio.StreamReader) -> Any | None:
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError:
        return None
    return decode(await reader.readexactly(_body_size(header)))


def parent_log_level() -> int:
    """The level this process logs at, for the engine process (and uvicorn) to log at too: the CLI's
    --log-level sets the root logger's; a child process inherits no logging setup, and the engine once logged
    INFO whatever the flag said. A process that set no logging up (the API used from a script) keeps the
    engine's INFO start-up report, as before."""
    root = logging.getLogger()
    return root.getEffectiveLevel() if root.handlers else logging.INFO


def _child_env() -> dict[str, str]:
    # The child must import the same deepserve as we did, installed or not.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _peer_pid(conn: socket.socket) -> int | None:
    if not hasattr(socket, "SO_PEERCRED"):
        return None  # not Linux: the 0700 directory is the only guard
    pid, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid


def main() -> None:
    parser = argparse.ArgumentParser(description="deepserve engine core process (started by the server)")
    parser.add_argument("--address", required=True)
    parser.add_argument("--engine-args", required=True, help="EngineArgs fields as JSON")
    parser.add_argument("--log-level", default="INFO",
                        help="the server's level, a name or a number (spawn_core_process passes its number)")
    args = parser.parse_args()
    # The API server decides when we stop (Shutdown, or its socket closing): a SIGTERM sent to the
    # whole process group (systemd, Ctrl+C) must not kill the engine under a draining server.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    level = int(args.log_level) if args.log_level.isdigit() else args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s engine %(levelname)s %(message)s")
    sys.exit(run_core_process(args.address, json.loads(args.engine_args), exit_if_orphaned=True))


if __name__ == "__main__":
    main()
