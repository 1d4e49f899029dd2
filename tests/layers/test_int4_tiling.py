"""When an int4 linear layer takes the tensor-core GEMV's tiled layout after loading (layers/int4.py), and
what the layer then holds and passes to the kernels. The layout itself and the kernels reading it:
tests/kernels/test_int4_tiled.py."""

from __future__ import annotations

import pytest
import torch

from deepserve.kernels import int4_mma_gemv
from deepserve.layers import int4 as int4_layers
from deepserve.layers import linear as linear_module
from deepserve.layers.linear import ReplicatedLinear
from deepserve.layers.quantization import Int4Config

CUDA = torch.device("cuda", 0)


@pytest.fixture
def on_hopper(monkeypatch):
    monkeypatch.setattr(int4_mma_gemv, "_is_hopper", lambda device: True)
    monkeypatch.delenv("DEEPSERVE_INT4_TILED", raising=False)
    monkeypatch.delenv("DEEPSERVE_INT4_MMA_GEMV_MAX_M", raising=False)
    return monkeypatch


def test_tiling_needs_a_hopper_gpu_both_switches_and_a_shape_the_gemv_takes(on_hopper):
    def applies(device=CUDA, dtype=torch.bfloat16, bits=4, group=128, g_idx=None, n=4096, k=4096):
        return int4_layers.tiles_for_mma_gemv(device, dtype, bits, group, g_idx, n, k)

    assert applies() and applies(dtype=torch.float16)
    assert not applies(device=torch.device("cpu"))
    assert not applies(dtype=torch.float32)  # fp32 activations: the GEMV does not take them
    assert not applies(n=4104)  # a partial 16-row tile
    assert not applies(group=32)  # groups smaller than the GEMV's 128-input block
    assert not applies(group=256, k=384)  # a partial group
    assert not applies(group=4096, k=2048)  # group_size -1 on a row-parallel shard: one group wider than K
    assert not applies(g_idx=torch.zeros(4096, dtype=torch.int32))  # act order
    on_hopper.setenv("DEEPSERVE_INT4_TILED", "0")
    assert not applies()
    on_hopper.setenv("DEEPSERVE_INT4_TILED", "1")
    on_hopper.setenv("DEEPSERVE_INT4_MMA_GEMV_MAX_M", "0")  # the GEMV off: nothing reads the layout faster
    assert not applies()
    on_hopper.setattr(int4_mma_gemv, "_is_hopper", lambda device: False)
    on_hopper.setenv("DEEPSERVE_INT4_MMA_GEMV_MAX_M", "8")
    assert not applies()


def _awq_layer(out_features: int = 32, in_features: int = 256) -> ReplicatedLinear:
    cfg = Int4Config(method="awq", bits=4, group_size=128, desc_act=False, zero_offset=False)
    layer = ReplicatedLinear(in_features, out_features, bias=False, quant=cfg)
    gen = torch.Generator().manual_seed(0)
    layer.qweight.data = torch.randint(-2**31, 2**31 - 1, layer.qweight.shape, generator=gen, dtype=torch.int64).int()
    layer.scales.data = (torch.rand(layer.scales.shape, generator=gen) * 0.01).half()
    layer.qzeros.data = torch.randint(0, 16, layer.qzeros.shape, generator=gen).half()
    return layer


def test_a_layer_on_the_cpu_keeps_the_row_layout():
    layer = _awq_layer()
    before = layer.qweight.data.clone()
    layer.quantize_loaded_weights()
    assert not layer.int4_tiled and torch.equal(layer.qweight.data, before) and layer.qzeros is not None


def test_a_tiled_layer_holds_the_tiled_tensors_and_says_so_to_the_kernels(monkeypatch):
    # the device check stubbed (no GPU here): the layer swaps in what tiled_for_mma_gemv made
    layer = _awq_layer()
    q, s, z = layer.qweight.data.clone(), layer.scales.data.clone(), layer.qzeros.data.clone()
    monkeypatch.setattr(int4_layers, "tiles_for_mma_gemv", lambda *args: True)
    layer.quantize_loaded_weights()
    assert layer.int4_tiled and layer.qzeros is None
    assert torch.equal(layer.qweight.data, int4_mma_gemv.tile_words(q))
    assert torch.equal(layer.scales.data, int4_mma_gemv.tile_scales(s, z))
    layer.quantize_loaded_weights()  # a second pass leaves it alone
    assert torch.equal(layer.qweight.data, int4_mma_gemv.tile_words(q))
    with pytest.raises(RuntimeError, match="cannot be loaded again"):  # a row-layout tensor into it: refused
        layer.qweight.weight_loader(layer.qweight, q)
    seen = {}
    monkeypatch.setattr(linear_module, "int4_linear",
                        lambda x, qw, sc, zs, bits, group, g_idx, bias, tiled: seen.update(zeros=zs, tiled=tiled) or x)
    layer.matmul(torch.randn(1, 256), None)
    assert seen == {"zeros": None, "tiled": True}
