"""The fused MoE's last step (kernels/moe_sum.py): each token's slots summed in order, weighted or not, skipped
assignments left out. On the GPU natively, elsewhere under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import DEVICE, MARKS, ON_GPU, import_kernels

moe_sum = import_kernels("deepserve.kernels.moe_sum")

pytestmark = MARKS


def exact_or_close(got: torch.Tensor, want: torch.Tensor) -> None:
    # The interpreter adds like the loop below; the GPU may fuse a multiply-add (an fp32 ulp can move a rounding)
    if ON_GPU:
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=8e-3, atol=1e-6)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("t, k, h, dtype", [(1, 6, 2048, torch.bfloat16), (3, 8, 1500, torch.float16),
                                            (5, 2, 7, torch.float32)])
def test_the_slots_sum_in_order(t, k, h, dtype):
    y = torch.randn(t * k, h, generator=torch.Generator().manual_seed(t)).to(dtype)
    got = moe_sum.sum_slots(y.to(DEVICE), k)
    want = torch.zeros(t, h)
    for s in range(k):
        want += y.view(t, k, h)[:, s].float()
    assert got.dtype == dtype and got.shape == (t, h)
    exact_or_close(got.cpu(), want.to(dtype))


def test_weighted_slots_drop_skipped_assignments():
    gen = torch.Generator().manual_seed(1)
    y = torch.randn(12, 1500, generator=gen)  # 4 tokens x 3 slots; H past one 1024-column block
    y[4] = float("nan")  # slot (1, 1), a skipped assignment's row: selected away, never multiplied into the sum
    ids = torch.tensor([[0, 1, 2], [3, 7, 4], [1, 1, 0], [6, 5, 2]])  # 7 = E: skipped
    weights = torch.rand(4, 3, generator=gen)
    got = moe_sum.sum_slots(y.to(DEVICE), 3, weights.to(DEVICE), ids.to(DEVICE), 7, out_dtype=torch.bfloat16)
    want = torch.zeros(4, 1500)
    for t in range(4):
        for k in range(3):
            if ids[t, k] < 7:
                want[t] += weights[t, k] * y[3 * t + k]
    exact_or_close(got.cpu(), want.to(torch.bfloat16))


def test_no_tokens_and_bad_inputs():
    assert moe_sum.sum_slots(torch.zeros(0, 64, device=DEVICE), 6).shape == (0, 64)
    with pytest.raises(ValueError, match="sum_slots"):
        moe_sum.sum_slots(torch.zeros(7, 64, device=DEVICE), 6)  # not whole tokens
    with pytest.raises(ValueError, match="weights and ids together"):
        moe_sum.sum_slots(torch.zeros(6, 64, device=DEVICE), 6, weights=torch.ones(1, 6, device=DEVICE))
