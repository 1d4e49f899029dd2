"""layers/linear.py `stacked_rows`: two loaded linears that read the same input as one (DEEPSERVE_FUSED_QKV_A's
q_a / kv_a projections), for each storage: the stacked layer's output is the two outputs side by side, computed
by the layer's own CPU path (which dequantizes as the GPU kernels do), and storage that cannot stack is refused
with the reason."""

from __future__ import annotations

import pytest
import torch

from deepserve.kernels import fp8_ref
from deepserve.layers.linear import ColumnParallelLinear, ReplicatedLinear, stacked_rows
from deepserve.layers.quantization import Fp8Config, Int4Config


def filled(layer, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for name, p in layer.named_parameters():
        if p.dtype == torch.int32 and name == "qweight":
            p.data.copy_(torch.randint(-2**31, 2**31 - 1, p.shape, generator=gen, dtype=torch.int64).to(torch.int32))
        elif name == "qzeros":
            p.data.copy_(torch.randint(0, 16, p.shape, generator=gen).to(p.dtype))
        elif name == "scales":
            p.data.copy_((torch.rand(p.shape, generator=gen) * 0.02 + 0.001).to(p.dtype))
        elif p.dtype == torch.float8_e4m3fn:
            p.data.copy_((torch.randn(p.shape, generator=gen) * 50).to(torch.float8_e4m3fn))
        else:
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return layer


def check_stacks(first, second) -> None:
    merged = stacked_rows(first, second)
    assert isinstance(merged, ReplicatedLinear), merged
    x = torch.randn(5, 256)
    want = torch.cat([first(x), second(x)], dim=-1)
    torch.testing.assert_close(merged(x), want, rtol=1e-5, atol=1e-5)


def test_plain_weights_and_biases_stack():
    check_stacks(filled(ColumnParallelLinear(256, 192, bias=True), 0), filled(ReplicatedLinear(256, 40, bias=True), 1))


def test_fp8_blocks_stack_when_the_first_rows_are_whole_blocks():
    # the second's last block is partial (72 rows): it ends the stacked weight, so its scale row still lines up
    quant = Fp8Config(weight_block=(128, 128))
    first, second = ReplicatedLinear(256, 256, quant=quant), ReplicatedLinear(256, 72, quant=quant)
    for layer, seed in ((first, 0), (second, 1)):
        w_q, scale = fp8_ref.quantize_weight_block(torch.randn(layer.weight.shape, generator=torch.Generator()
                                                               .manual_seed(seed)), (128, 128))
        layer.weight.data.copy_(w_q)
        layer.weight_scale_inv.data.copy_(scale)
    check_stacks(first, second)
    assert stacked_rows(second, first) == "the first projection's rows are not whole FP8 blocks of 128"


def test_int4_groups_stack():
    quant = Int4Config("awq", 4, 64, False, False)
    check_stacks(filled(ReplicatedLinear(256, 96, quant=quant), 0), filled(ReplicatedLinear(256, 48, quant=quant), 1))


AWQ = Int4Config("awq", 4, 64, False, False)


@pytest.mark.parametrize("first, second, reason", [
    (AWQ, Int4Config("awq", 4, 128, False, False), "int4 groups differ"),
    (Int4Config("gptq", 4, 64, True, False), Int4Config("gptq", 4, 64, True, False), "act order"),
    (AWQ, None, "stored differently"),
    (Fp8Config(weight_block=(128, 128)), None, "stored differently"),
])
def test_storage_that_cannot_stack_is_refused_with_the_reason(first, second, reason):
    assert reason in stacked_rows(ReplicatedLinear(256, 128, quant=first), ReplicatedLinear(256, 48, quant=second))
