"""The host tier's batched copies (runner/kv_swap.py) against the per-block definition, for both cache
layouts (key/value planes and MLA's latent, also mixed in one tier) and the float32, bfloat16 and FP8
dtypes, through staging chunks and host-memory chunks smaller than a step; the order rules of a step's
copies; and the host memory's background allocation (runner/host_memory.py). The CUDA side-stream path
is checked against the same definition on a GPU (and by bench/check_kv_tier.py with its hazards live)."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from deepserve.engine.request import Request, ScheduledRequest, SchedulerOutput
from deepserve.layers.kv_cache_spec import KVCacheSpec
from deepserve.runner import kv_swap
from deepserve.runner.host_memory import HostBlocks
from deepserve.runner.kv_swap import (
    HostTier,
    blocks_written,
    copy_blocks_reference,
    last_writer_wins,
    layer_slots,
    split_swap_outs,
)
from deepserve.sampling_params import SamplingParams

ON_GPU = torch.cuda.is_available()
SPECS = {"mha": KVCacheSpec((2, 8), 2, torch.float32), "mla": KVCacheSpec((24,), 1, torch.float32)}
DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn]
NUM_GPU, NUM_HOST, BLOCK = 10, 12, 4
# Runs of consecutive host blocks, single blocks, a reversed order and one host block written twice.
OUTS = [(3, 4), (7, 5), (0, 6), (9, 0), (2, 11), (5, 9), (1, 4)]
INS = [(4, 8), (5, 2), (6, 3), (11, 0), (0, 9), (9, 5)]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """Random bytes viewed as `dtype` (an FP8 cache is only ever copied here, never computed on)."""
    nbytes = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * nbytes), dtype=torch.uint8, device=device)
    return raw.view(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).cpu()


def make_tier(specs: list[KVCacheSpec], device: str = "cpu", **kw) -> tuple[HostTier, list[torch.Tensor]]:
    """A tier over random caches, its host blocks random too (one chunk: every layer_view(l) is the whole tier)."""
    tier = HostTier(specs, NUM_HOST, BLOCK, torch.device(device), **kw)
    for chunk in range(len(tier.host.chunks)):
        tier.host.chunk(chunk).copy_(random_tensor(tier.host.chunk(chunk).shape, torch.uint8))
    caches = [random_tensor(spec.shape(NUM_GPU, BLOCK), spec.dtype, device) for spec in specs]
    return tier, caches


def host_layers(tier: HostTier) -> list[torch.Tensor]:
    """Each layer's host blocks [host blocks, planes, ...] over all chunks (copies)."""
    return [torch.cat([tier.layer_view(layer, c) for c in range(len(tier.host.chunks))])
            for layer in range(len(tier.slots))]


def expected(tier: HostTier, caches: list[torch.Tensor], outs, ins) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Caches and host layers after `outs` then `ins`, one block and plane at a time, in order."""
    want_caches, want_hosts = [c.cpu().clone() for c in caches], host_layers(tier)
    for cache, host, slot in zip(want_caches, want_hosts, tier.slots, strict=True):
        copy_blocks_reference(cache, host, outs, slot.planes, to_host=True)
        copy_blocks_reference(cache, host, ins, slot.planes, to_host=False)
    return want_caches, want_hosts


def assert_tier_equals(tier: HostTier, caches, want_caches, want_hosts) -> None:
    for cache, want in zip(caches, want_caches, strict=True):
        assert torch.equal(as_bytes(cache), as_bytes(want))
    for got, want in zip(host_layers(tier), want_hosts, strict=True):
        assert torch.equal(as_bytes(got), as_bytes(want))


# staging_blocks 3 and blocks_per_chunk 5: a step's copies go through several staging chunks, and runs of
# host blocks are split at the edges of the host memory's chunks.
@pytest.mark.parametrize("small", [False, True], ids=["one-chunk", "small-chunks"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layouts", [["mha"], ["mla"], ["mha", "mla", "mha"]], ids="+".join)
def test_batched_copies_equal_the_per_block_definition(layouts, dtype, small):
    torch.manual_seed(0)
    specs = [KVCacheSpec(SPECS[name].entry_shape, SPECS[name].planes, dtype) for name in layouts]
    kw = dict(staging_blocks=3, blocks_per_chunk=5) if small else {}
    tier, caches = make_tier(specs, **kw)
    before = [as_bytes(c).clone() for c in caches]
    want_caches, want_hosts = expected(tier, caches, OUTS, INS)
    tier.run(SchedulerOutput(blocks_to_swap_out=OUTS), caches)
    tier.run(SchedulerOutput(blocks_to_swap_in=INS), caches)
    assert_tier_equals(tier, caches, want_caches, want_hosts)
    assert any(not torch.equal(as_bytes(c), b) for c, b in zip(caches, before, strict=True))  # something moved


def test_layer_slots_pack_every_layer_of_a_block_one_after_another():
    slots, block_bytes = layer_slots([SPECS["mha"], KVCacheSpec((24,), 1, torch.bfloat16)], BLOCK)
    mha_row = BLOCK * 2 * 8 * 4  # one plane of one block: block_size x Hkv x D x float32
    assert [(s.offset, s.planes, s.row_bytes) for s in slots] == [(0, 2, mha_row), (2 * mha_row, 1, BLOCK * 24 * 2)]
    assert block_bytes == 2 * mha_row + BLOCK * 24 * 2


def test_runs_split_at_chunk_edges_and_last_writer():
    host = HostBlocks(12, 8, torch.device("cpu"), pin=False, blocks_per_chunk=4)
    assert host.runs([0, 1, 2, 5, 6, 4]) == [(0, 0, 3), (5, 3, 2), (4, 5, 1)]
    assert host.runs([2, 3, 4, 5, 8]) == [(2, 0, 2), (4, 2, 2), (8, 4, 1)]  # 4 and 8 start chunks
    assert host.runs([]) == []
    with pytest.raises(ValueError, match="chunk edge"):
        host.span(3, 2)
    assert last_writer_wins([(3, 4), (7, 2), (1, 4)]) == [(7, 2), (1, 4)]


def test_host_memory_grows_in_the_background_and_a_copy_waits_for_its_chunk():
    release = threading.Event()
    calls = []

    def allocate(num_bytes):
        calls.append(num_bytes)
        if len(calls) == 3:  # the third chunk is slow
            assert release.wait(10)
        return torch.zeros(num_bytes, dtype=torch.uint8), False

    host = HostBlocks(10, 8, torch.device("cpu"), pin=False, blocks_per_chunk=4, allocate=allocate)
    deadline = time.monotonic() + 10
    while host.num_ready_blocks < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert host.num_ready_blocks == 8  # chunks 0 and 1 ready, chunk 2 (blocks 8 and 9) not yet
    assert host.span(4, 4).shape == (4, 8)  # a ready chunk: no wait
    got = []
    waiter = threading.Thread(target=lambda: got.append(host.span(8, 2)))
    waiter.start()
    time.sleep(0.2)
    assert not got  # waiting for chunk 2
    release.set()
    waiter.join(10)
    assert got and got[0].shape == (2, 8) and host.num_ready_blocks == 10
    assert calls == [32, 32, 16]  # the last chunk holds the 2 remaining blocks
    host.close()


def test_a_failed_background_allocation_names_the_flag():
    def allocate(num_bytes):
        if allocate.calls:
            raise MemoryError("no memory")
        allocate.calls += 1
        return torch.zeros(num_bytes, dtype=torch.uint8), False

    allocate.calls = 0
    host = HostBlocks(8, 8, torch.device("cpu"), pin=False, blocks_per_chunk=4, allocate=allocate)
    host.thread.join(10)
    assert host.span(0, 4).shape == (4, 8) and host.num_ready_blocks == 4
    with pytest.raises(RuntimeError, match="--swap-space"):
        host.span(4, 1)


def test_blocks_written_are_the_blocks_under_each_requests_new_tokens():
    a = Request("a", list(range(10)), SamplingParams())
    a.block_ids = [7, 3, 9]
    b = Request("b", list(range(5)), SamplingParams())
    b.block_ids = [4, 6]
    out = SchedulerOutput([ScheduledRequest(a, 3, 6), ScheduledRequest(b, 1, 4)])
    assert blocks_written(out, BLOCK) == {3, 9, 6}  # a writes positions 6..8, b position 4


@pytest.mark.parametrize("layout", sorted(SPECS))
def test_a_step_makes_its_swap_outs_before_its_swap_ins(layout):
    # GPU block 2 is read by a swap-out and refilled by a swap-in of the same step; host block 1 is
    # written by a swap-out and read by a swap-in of the same step (the block manager's contract).
    tier, caches = make_tier([SPECS[layout]])
    planes = tier.slots[0].planes
    gpu_before = as_bytes(caches[0] if planes > 1 else caches[0].unsqueeze(0)).clone()  # [planes, blocks, ...]
    host_before = as_bytes(tier.layer_view(0)).clone()
    tier.run(SchedulerOutput(blocks_to_swap_out=[(2, 1)], blocks_to_swap_in=[(1, 6), (3, 2)]), caches)
    gpu = as_bytes(caches[0] if planes > 1 else caches[0].unsqueeze(0))
    host_after = as_bytes(tier.layer_view(0))
    for p in range(planes):
        assert torch.equal(host_after[1, p], gpu_before[p, 2])  # read before block 2 was refilled
        assert torch.equal(gpu[p, 6], gpu_before[p, 2])  # host block 1 read after it was written
        assert torch.equal(gpu[p, 2], host_before[3, p])


def test_swap_outs_split_into_those_before_the_swap_ins_and_forward_and_the_rest():
    # (2, 11): block 2 is refilled by a swap-in; (3, 12): host block 12 is read by a swap-in; (4, 13):
    # block 4 is written by the forward. (1, 10) conflicts with nothing and may run behind.
    first, behind = split_swap_outs([(1, 10), (2, 11), (3, 12), (4, 13)], [(12, 7), (20, 2)], written={4})
    assert first == [(2, 11), (3, 12), (4, 13)] and behind == [(1, 10)]
    assert split_swap_outs([], [(1, 2)], {3}) == ([], [])


@pytest.mark.parametrize("layout", sorted(SPECS))
def test_a_step_through_the_host_tier_equals_its_swap_outs_then_its_swap_ins(layout):
    # OUTS write host blocks INS read and (8, 3) reads GPU block 8, which INS refill: they go first; (4, 1)
    # and (6, 2) conflict with nothing and run behind the swap-ins. The result must be that of every
    # swap-out, in order, before every swap-in.
    outs = [*OUTS, (8, 3), (4, 1), (6, 2)]
    tier, caches = make_tier([KVCacheSpec(SPECS[layout].entry_shape, SPECS[layout].planes, torch.bfloat16)],
                             staging_blocks=2)
    want_caches, want_hosts = expected(tier, caches, outs, INS)
    writer = Request("w", [0] * 8, SamplingParams())
    writer.block_ids = [6, 1]  # its new tokens 6 and 7 land in block 1
    step = SchedulerOutput([ScheduledRequest(writer, 2, 6)], blocks_to_swap_out=outs, blocks_to_swap_in=INS)
    assert split_swap_outs(last_writer_wins(outs), INS, blocks_written(step, BLOCK))[1] == [(4, 1), (6, 2)]
    tier.run(step, caches)
    assert_tier_equals(tier, caches, want_caches, want_hosts)


class FakeEvent:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


class FakeStream:
    def __init__(self) -> None:
        self.waited: list[FakeEvent] = []
        self.waited_streams: list[FakeStream] = []

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append(event)

    def wait_stream(self, stream: FakeStream) -> None:
        self.waited_streams.append(stream)


def test_a_forward_waits_for_the_running_swap_outs_of_the_blocks_it_writes_and_no_other():
    # Rule 3 on CUDA, with the stream and events simulated: a step's behind swap-outs still running when a
    # later forward writes their GPU blocks make that forward wait; finished ones and disjoint ones do not,
    # and those it waited for are forgotten (every later forward is queued after this one).
    tier, _ = make_tier([SPECS["mla"]])
    reads_3, reads_5, finished = FakeEvent(False), FakeEvent(False), FakeEvent(True)
    tier.running_outs = [({1, 3}, reads_3), ({5}, reads_5), ({3}, finished)]
    forward = FakeStream()
    tier._wait_for_overwritten({3, 4}, forward)
    assert forward.waited == [reads_3]
    assert tier.running_outs == [({5}, reads_5)]
    tier._wait_for_overwritten({7}, forward)
    assert forward.waited == [reads_3] and tier.running_outs == [({5}, reads_5)]
    reads_5.done = True
    tier._wait_for_overwritten({5}, forward)
    assert forward.waited == [reads_3] and tier.running_outs == []


def simulated_cuda_step(monkeypatch, tier: HostTier, caches, step: SchedulerOutput) -> tuple[list, FakeStream]:
    """HostTier.run's CUDA branch with the streams and events simulated on the CPU: the copies really run
    (in program order), and the log lists, in issue order on the side stream, each chunk's gather (GPU
    blocks), host memcpys (host blocks), scatter (GPU blocks) and recorded event."""
    log: list = []
    forward, tier.stream = FakeStream(), FakeStream()

    def record():
        log.append(("event", FakeEvent(False)))
        return log[-1][1]

    def logged(name, fn, blocks_arg):
        def call(*args):
            log.append((name, args[blocks_arg].tolist()))
            return fn(*args)
        return call

    runs = tier.host.runs
    monkeypatch.setattr(tier.host, "runs", lambda hosts: (log.append(("memcpy", list(hosts))), runs(hosts))[1])
    monkeypatch.setattr(kv_swap, "gather", logged("gather", kv_swap.gather, 2))
    monkeypatch.setattr(kv_swap, "scatter", logged("scatter", kv_swap.scatter, 3))
    monkeypatch.setattr(kv_swap, "_record", record)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: forward)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    tier.run(step, caches)
    return log, forward


def test_simulated_cuda_order_lets_the_forward_wait_only_for_what_it_overwrites_or_reads(monkeypatch):
    # Step 1 has no swap-ins: the forward writes GPU block 3, so (3, 4) is a first swap-out; the forward
    # waits for its gather alone, and its memcpy, like the behind swap-outs, overlaps the forward.
    tier, caches = make_tier([SPECS["mha"], SPECS["mla"]], staging_blocks=2)
    want_caches, want_hosts = expected(tier, caches, [(3, 4), (7, 5), (0, 6), (9, 0)], [])
    writer = Request("w", [0] * 4, SamplingParams())
    writer.block_ids = [3]
    step = SchedulerOutput([ScheduledRequest(writer, 1, 3)], blocks_to_swap_out=[(3, 4), (7, 5), (0, 6), (9, 0)])
    log, forward = simulated_cuda_step(monkeypatch, tier, caches, step)
    ops = [(op, arg) if op != "event" else op for op, arg in log]
    assert ops == [("gather", [3]), "event", ("memcpy", [4]),  # the first swap-out, "ready" after its gather
                   ("gather", [9, 7]), ("memcpy", [0, 5]), ("gather", [0]), "event", ("memcpy", [6])]
    events = [arg for op, arg in log if op == "event"]
    assert forward.waited == [events[0]] and tier.stream.waited_streams == [forward]  # rules 2 and 1
    assert tier.running_outs == [({9, 7, 0}, events[1])]  # rule 3: the behind ones' last gather
    assert_tier_equals(tier, caches, want_caches, want_hosts)
    # Step 2 writes block 7 (read by a behind swap-out of step 1, still "running") and loads host block 5
    # into block 8: the forward waits for step 1's behind gather and for the scatter; nothing is behind.
    want_caches, want_hosts = expected(tier, caches, [], [(5, 8)])
    writer.block_ids = [7]
    log, forward = simulated_cuda_step(monkeypatch, tier, caches, SchedulerOutput(
        [ScheduledRequest(writer, 1, 3)], blocks_to_swap_in=[(5, 8)]))
    assert [(op, arg) for op, arg in log if op != "event"] == [("memcpy", [5]), ("scatter", [8])]
    assert log[-1][0] == "event" and forward.waited == [events[1], log[-1][1]]
    assert tier.running_outs == []
    assert_tier_equals(tier, caches, want_caches, want_hosts)


def test_simulated_cuda_order_holds_the_memcpys_the_swap_ins_do_not_need_until_after_them(monkeypatch):
    # The forward writes GPU blocks 3 and 7, a swap-in fills block 2 and reads host block 1: (9, 1) and
    # (2, 6) must precede the swap-ins; (3, 4) and (7, 5) only precede the forward, so they are held:
    # gathered before the swap-ins (into the staging's last 2 rows), copied to the host after "ready".
    tier, caches = make_tier([SPECS["mha"], SPECS["mla"]], staging_blocks=4)
    outs, ins = [(3, 4), (7, 5), (2, 6), (9, 1), (0, 10)], [(11, 8), (1, 2)]
    want_caches, want_hosts = expected(tier, caches, outs, ins)
    writer = Request("w", [0] * 8, SamplingParams())
    writer.block_ids = [3, 7]
    step = SchedulerOutput([ScheduledRequest(writer, 8, 0)], blocks_to_swap_out=outs, blocks_to_swap_in=ins)
    log, forward = simulated_cuda_step(monkeypatch, tier, caches, step)
    assert [(op, arg) if op != "event" else op for op, arg in log] == [
        ("gather", [9, 2]), "event", ("memcpy", [1, 6]),  # before the swap-ins
        ("gather", [3, 7]),  # held
        ("memcpy", [1, 11]), ("scatter", [2, 8]), "event",  # the swap-ins, "ready"
        ("memcpy", [4, 5]),  # the held ones' memcpy, behind the forward's wait
        ("gather", [0]), "event", ("memcpy", [10])]  # behind
    events = [arg for op, arg in log if op == "event"]
    assert forward.waited == [events[1]] and tier.running_outs == [({0}, events[2])]
    assert_tier_equals(tier, caches, want_caches, want_hosts)
    # As many as fit in half the staging are held; the rest stay first (the forward waits for their memcpy).
    tier, caches = make_tier([SPECS["mla"]], staging_blocks=3)
    want_caches, want_hosts = expected(tier, caches, outs, ins)
    log, _ = simulated_cuda_step(monkeypatch, tier, caches, step)
    assert [(op, arg) for op, arg in log if op != "event"][:4] == [
        ("gather", [9, 7, 2]), ("memcpy", [1, 5, 6]), ("gather", [3]), ("memcpy", [1, 11])]
    assert_tier_equals(tier, caches, want_caches, want_hosts)


@pytest.mark.skipif(not ON_GPU, reason="the side stream needs CUDA")
@pytest.mark.parametrize("layout", sorted(SPECS))
def test_side_stream_copies_on_cuda_equal_the_definition(layout):
    torch.manual_seed(0)
    tier, caches = make_tier([KVCacheSpec(SPECS[layout].entry_shape, SPECS[layout].planes, torch.bfloat16)],
                             device="cuda", staging_blocks=4)
    want_caches, want_hosts = expected(tier, caches, OUTS, INS)
    tier.run(SchedulerOutput(blocks_to_swap_out=OUTS, blocks_to_swap_in=INS), caches)
    torch.cuda.synchronize()
    assert_tier_equals(tier, caches, want_caches, want_hosts)
