"""The host tier's batched copies (runner/kv_swap.py) against the per-block definition, for both cache
layouts (key/value planes and MLA's latent) and the float32, bfloat16 and FP8 dtypes; and the order rules
of a step's copies. The CUDA side-stream path is checked against the same definition on a GPU."""

from __future__ import annotations

import pytest
import torch

from deepserve.engine.request import Request, ScheduledRequest, SchedulerOutput
from deepserve.layers.kv_cache_spec import KVCacheSpec
from deepserve.runner.kv_swap import (
    HostTier,
    blocks_written,
    copy_blocks_reference,
    copy_in,
    copy_out,
    host_runs,
    last_writer_wins,
    plan_copies,
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


def make_pair(name: str, dtype: torch.dtype, device: str = "cpu") -> tuple[KVCacheSpec, torch.Tensor, torch.Tensor]:
    spec = KVCacheSpec(SPECS[name].entry_shape, SPECS[name].planes, dtype)
    cache = random_tensor(spec.shape(NUM_GPU, BLOCK), dtype, device)
    host = random_tensor((NUM_HOST, spec.planes, BLOCK, *spec.entry_shape), dtype)
    return spec, cache, host


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).cpu()


def batched(cache: torch.Tensor, host: torch.Tensor, pairs, planes: int, to_host: bool, by_runs: bool) -> None:
    plan = plan_copies(pairs, NUM_GPU, planes, cache.device, gpu_first=to_host, by_runs=by_runs)
    if to_host:
        copy_out(cache, host, plan)
    else:
        copy_in(host, cache, plan)


# by_runs: the CUDA path's arithmetic (gather into staging, one copy per run of host blocks, scatter),
# here on CPU tensors; otherwise the CPU path (row indices).
@pytest.mark.parametrize("by_runs", [False, True], ids=["rows", "runs"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", sorted(SPECS))
def test_batched_copies_equal_the_per_block_definition(layout, dtype, by_runs):
    torch.manual_seed(0)
    spec, cache, host = make_pair(layout, dtype)
    want_cache, want_host = cache.clone(), host.clone()
    copy_blocks_reference(want_cache, want_host, OUTS, spec.planes, to_host=True)  # in order: last write wins
    batched(cache, host, last_writer_wins(OUTS), spec.planes, True, by_runs)
    assert torch.equal(as_bytes(host), as_bytes(want_host))
    copy_blocks_reference(want_cache, want_host, INS, spec.planes, to_host=False)
    batched(cache, host, sorted(INS), spec.planes, False, by_runs)
    assert torch.equal(as_bytes(cache), as_bytes(want_cache))
    assert not torch.equal(as_bytes(cache), as_bytes(make_pair(layout, dtype)[1]))  # something moved


def test_runs_and_last_writer():
    assert host_runs([0, 1, 2, 5, 6, 4]) == [(0, 0, 3), (5, 3, 2), (4, 5, 1)]
    assert host_runs([]) == []
    assert last_writer_wins([(3, 4), (7, 2), (1, 4)]) == [(7, 2), (1, 4)]


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
    spec, cache, host = make_pair(layout, torch.float32)
    tier = HostTier([spec], NUM_HOST, BLOCK, torch.device("cpu"))
    tier.host_caches[0].copy_(host)
    gpu_before = as_bytes(cache if spec.planes > 1 else cache.unsqueeze(0)).clone()  # [planes, blocks, ...]
    tier.run(SchedulerOutput(blocks_to_swap_out=[(2, 1)], blocks_to_swap_in=[(1, 6), (3, 2)]), [cache])
    gpu = as_bytes(cache if spec.planes > 1 else cache.unsqueeze(0))
    host_after = as_bytes(tier.host_caches[0])
    for p in range(spec.planes):
        assert torch.equal(host_after[1, p], gpu_before[p, 2])  # read before block 2 was refilled
        assert torch.equal(gpu[p, 6], gpu_before[p, 2])  # host block 1 read after it was written
        assert torch.equal(gpu[p, 2], as_bytes(host)[3, p])


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
    spec, cache, host = make_pair(layout, torch.bfloat16)
    tier = HostTier([spec], NUM_HOST, BLOCK, torch.device("cpu"))
    tier.host_caches[0].copy_(host)
    want_cache, want_host = cache.clone(), host.clone()
    copy_blocks_reference(want_cache, want_host, outs, spec.planes, to_host=True)
    copy_blocks_reference(want_cache, want_host, INS, spec.planes, to_host=False)
    writer = Request("w", [0] * 8, SamplingParams())
    writer.block_ids = [6, 1]  # its new tokens 6 and 7 land in block 1
    step = SchedulerOutput([ScheduledRequest(writer, 2, 6)], blocks_to_swap_out=outs, blocks_to_swap_in=INS)
    assert split_swap_outs(last_writer_wins(outs), INS, blocks_written(step, BLOCK))[1] == [(4, 1), (6, 2)]
    tier.run(step, [cache])
    assert torch.equal(as_bytes(cache), as_bytes(want_cache))
    assert torch.equal(as_bytes(tier.host_caches[0]), as_bytes(want_host))


@pytest.mark.skipif(not ON_GPU, reason="the side stream needs CUDA")
@pytest.mark.parametrize("layout", sorted(SPECS))
def test_side_stream_copies_on_cuda_equal_the_definition(layout):
    torch.manual_seed(0)
    spec, cache, host = make_pair(layout, torch.bfloat16, "cuda")
    tier = HostTier([spec], NUM_HOST, BLOCK, torch.device("cuda"))
    tier.host_caches[0].copy_(host)
    want_cache, want_host = cache.cpu(), host.clone()
    copy_blocks_reference(want_cache, want_host, OUTS, spec.planes, to_host=True)
    copy_blocks_reference(want_cache, want_host, INS, spec.planes, to_host=False)
    tier.run(SchedulerOutput(blocks_to_swap_out=OUTS, blocks_to_swap_in=INS), [cache])
    torch.cuda.synchronize()
    assert torch.equal(as_bytes(cache), as_bytes(want_cache))
    assert torch.equal(as_bytes(tier.host_caches[0]), as_bytes(want_host))
