"""AWQ / GPTQ tensors into our layout, against the formats as published (tests/loader/int4_pack.py packs
them independently of our unpacking), and the config checks."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from deepserve.kernels import int4_ref
from deepserve.layers.quantization import Int4Config, resolve_quantization
from deepserve.loader.int4 import checkpoint_slice, dequantize_int4_weights, int4_config
from tests.loader.int4_pack import (
    awq_pack_columns,
    awq_tensors,
    dequantize,
    gptq_tensors,
    group_index,
    pack_in_order,
    quantize_groups,
)


def test_packed_words_follow_the_published_bit_orders():
    # Output columns 0..7 holding the values 0..7: AWQ's word puts column ORDER[i] at bits 4i
    # (0 2 4 6 1 3 5 7), GPTQ's the columns in order.
    values = torch.arange(8).view(1, 8)  # one row, output columns 0..7
    assert int(awq_pack_columns(values)) == 0x75316420
    assert int(pack_in_order(values, 4, dim=1)) == 0x76543210
    assert int4_ref.awq_unpack(torch.tensor([[0x75316420]], dtype=torch.int32)).tolist() == [list(range(8))]
    assert int4_ref.unpack_rows(torch.tensor([[0x76543210]], dtype=torch.int32), 4).tolist() == [list(range(8))]
    high = torch.tensor([[15] * 8])  # every bit set: the signed word -1 must unpack to 15s
    assert int4_ref.awq_unpack(int4_ref.awq_pack(high)).tolist() == high.tolist()


def _random_layer(n: int, k: int, bits: int, group: int, desc_act: bool, sym: bool = False):
    torch.manual_seed(n * k + bits)
    w = torch.randn(n, k)
    g_idx = group_index(k, group, desc_act, seed=3)
    codes, scales, zeros = quantize_groups(w, bits, group, sym, g_idx, min_zero=1)
    return g_idx, codes, scales, zeros


CASES = [("awq", 4, 16, False), ("gptq", 4, 16, False), ("gptq", 4, 16, True), ("gptq", 8, 8, True),
         ("gptq", 8, 32, False)]


@pytest.mark.parametrize("method,bits,group,desc_act", CASES)
def test_checkpoint_tensors_become_our_layout(method, bits, group, desc_act):
    n, k = 48, 64
    g_idx, codes, scales, zeros = _random_layer(n, k, bits, group, desc_act)
    packed = awq_tensors(codes, scales, zeros) if method == "awq" else gptq_tensors(codes, scales, zeros, bits, g_idx)
    cfg = Int4Config(method, bits, group, desc_act, zero_offset=method == "gptq")
    want = dequantize(codes, scales, zeros, g_idx)
    ours = {kind: checkpoint_slice(kind, t, cfg) for kind, t in packed.items()}
    got = int4_ref.dequantize(ours["qweight"], ours["scales"], ours["qzeros"], bits, group,
                              ours["g_idx"] if desc_act else None)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # A tensor-parallel slice: output rows 16..31 (column parallel), inputs 32..63 (row parallel).
    rows = {kind: checkpoint_slice(kind, t, cfg, rows=(16, 16)) for kind, t in packed.items()}
    got = int4_ref.dequantize(rows["qweight"], rows["scales"], rows["qzeros"], bits, group,
                              rows["g_idx"] if desc_act else None)
    torch.testing.assert_close(got, want[16:32], rtol=0, atol=0)
    cols = {kind: checkpoint_slice(kind, t, cfg, cols=(32, 32), whole_groups=not desc_act)
            for kind, t in packed.items()}
    got = int4_ref.dequantize(cols["qweight"], cols["scales"], cols["qzeros"], bits, group,
                              cols["g_idx"] if desc_act else None)
    torch.testing.assert_close(got, want[:, 32:], rtol=0, atol=0)


def test_a_shard_that_cuts_a_group_is_refused():
    g_idx, codes, scales, zeros = _random_layer(16, 64, 4, 32, False)
    packed = awq_tensors(codes, scales, zeros)
    cfg = Int4Config("awq", 4, 32, False, zero_offset=False)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        checkpoint_slice("scales", packed["scales"], cfg, cols=(16, 16))


def test_layers_kept_in_the_model_dtype_get_dequantized_weights():
    g_idx, codes, scales, zeros = _random_layer(16, 32, 4, 8, True)
    packed = gptq_tensors(codes, scales, zeros, 4, g_idx)
    cfg = Int4Config("gptq", 4, 8, True, zero_offset=True)
    stream = [(f"a.{k}", v) for k, v in packed.items()]
    stream += [("b.qweight", packed["qweight"]), ("n.weight", torch.ones(2))]
    out = dict(dequantize_int4_weights(stream, cfg, keep=lambda m: m == "b"))
    assert set(out) == {"a.weight", "b.qweight", "n.weight"}
    torch.testing.assert_close(out["a.weight"], dequantize(codes, scales, zeros, g_idx), rtol=0, atol=0)
    with pytest.raises(ValueError, match="lack one of"):
        list(dequantize_int4_weights([("a.qweight", packed["qweight"])], cfg, keep=lambda m: False))


def _config(**quant) -> LlamaConfig:
    return LlamaConfig(quantization_config=quant)


@pytest.mark.parametrize("quant,field", [
    (dict(quant_method="awq", bits=3, group_size=128, version="gemm"), "bits"),
    (dict(quant_method="awq", bits=4, group_size=128, version="gemv"), "version"),
    (dict(quant_method="awq", bits=4, group_size=128, version="gemm", zero_point=False), "zero_point"),
    (dict(quant_method="awq", bits=4, group_size=100, version="gemm"), "group_size"),
    (dict(quant_method="gptq", bits=3, group_size=128), "bits"),
    (dict(quant_method="gptq", bits=4, group_size=128, checkpoint_format="marlin"), "checkpoint_format"),
    (dict(quant_method="gptq", bits=4, group_size=128, dynamic={r"+:.*down": {"bits": 8}}), "dynamic"),
])
def test_unsupported_formats_are_refused_naming_the_field(quant, field):
    with pytest.raises(ValueError, match=f"quantization_config.{field} .* is not supported"):
        int4_config(_config(**quant), quant["quant_method"])


def test_quantization_follows_the_checkpoint_and_a_mismatch_is_refused():
    awq = _config(quant_method="awq", bits=4, group_size=128, version="gemm", zero_point=True)
    gptq = _config(quant_method="gptq", bits=8, group_size=-1, desc_act=True, sym=True)
    assert resolve_quantization(awq, None, "cpu") == "awq"
    assert resolve_quantization(awq, "awq", "cpu") == "awq"
    assert resolve_quantization(awq, "none", "cpu") is None
    assert resolve_quantization(gptq, "", "cpu") == "gptq"
    with pytest.raises(ValueError, match="--quantization gptq does not match.*'awq'.*or pass awq"):
        resolve_quantization(awq, "gptq", "cpu")
    with pytest.raises(ValueError, match="--quantization fp8 does not match"):
        resolve_quantization(awq, "fp8", "cpu")
    with pytest.raises(ValueError, match="--quantization awq does not match.*unquantized"):
        resolve_quantization(LlamaConfig(), "awq", "cpu")
    assert resolve_quantization(LlamaConfig(), "awq", "cpu", without_checkpoint=True) == "awq"  # dummy weights
    assert int4_config(gptq, "gptq") == Int4Config("gptq", 8, -1, True, zero_offset=True)
    assert int4_config(LlamaConfig(), "awq") == Int4Config("awq", 4, 128, False, zero_offset=False)
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported"):
        resolve_quantization(_config(quant_method="bitsandbytes"), None, "cpu")


def test_gptq_v2_stores_the_zero_point_as_is():
    g_idx, codes, scales, zeros = _random_layer(16, 64, 4, 16, False)
    packed = gptq_tensors(codes, scales, zeros, 4, g_idx, v1=False)
    quant = dict(quant_method="gptq", bits=4, group_size=16, checkpoint_format="gptq_v2")
    cfg = int4_config(_config(**quant), "gptq")
    assert not cfg.zero_offset
    ours = {kind: checkpoint_slice(kind, t, cfg) for kind, t in packed.items()}
    got = int4_ref.dequantize(ours["qweight"], ours["scales"], ours["qzeros"], 4, 16)
    torch.testing.assert_close(got, dequantize(codes, scales, zeros, g_idx), rtol=0, atol=0)
