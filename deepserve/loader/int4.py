"""AWQ and GPTQ int4 (GPTQ also int8) checkpoints: their config, and their tensors turned into our layout.

A quantized linear `<module>` ships `<module>.qweight`, `.qzeros`, `.scales` (and for GPTQ `.g_idx`);
kernels/int4_ref.py says how each format packs them and what our one in-memory layout is. A layer
built int4 (layers/quantization.py) receives the checkpoint tensors through its weight_loader and asks
`checkpoint_slice` for its rows or columns in our layout: the slice is cut in the checkpoint's own
coordinates first (a LazyTensor reads only that window), then unpacked and repacked. Layers that stay in
the model dtype (MLA's wkv_b, everything under --quantization none) get the weight dequantized here
(`dequantize_int4_weights`). Modules the checkpoint ships unquantized (modules_to_not_convert) arrive
as plain `<module>.weight`; the layer then drops its int4 storage (LinearBase.unquantize).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from deepserve.errors import ConfigRefused
from deepserve.kernels import int4_ref
from deepserve.layers.quantization import Int4Config
from deepserve.loader.checkpoint import materialize

INT4_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
METHODS = ("awq", "gptq")
GPTQ_FORMATS = ("gptq", "gptq_v2")


def _quant_dict(hf_config: Any) -> dict | None:
    quant = getattr(hf_config, "quantization_config", None)
    if not quant:
        return None
    return quant if isinstance(quant, dict) else quant.to_dict()


def checkpoint_method(hf_config: Any) -> str | None:
    """The checkpoint's quantization_config.quant_method ("fp8", "awq", "gptq"), None if unquantized;
    anything else is refused naming the supported ones."""
    quant = _quant_dict(hf_config)
    if quant is None:
        return None
    method = str(quant.get("quant_method", "")).lower()
    if method not in ("fp8", *METHODS):
        raise ConfigRefused(f"config.json quantization_config.quant_method {quant.get('quant_method')!r} is not "
                         "supported; supported: fp8 (DeepSeek's block-scaled format), awq (AutoAWQ GEMM), "
                         "gptq, or an unquantized checkpoint")
    return method


def _refuse(field: str, value: object, supported: str) -> None:
    raise ConfigRefused(f"config.json quantization_config.{field} {value!r} is not supported; supported: {supported}")


def int4_config(hf_config: Any, method: str) -> Int4Config:
    """The checkpoint's format for `method`, validated; without a matching quantization_config (dummy
    weights, the planner) AutoAWQ's / AutoGPTQ's defaults: 4 bits, groups of 128."""
    quant = _quant_dict(hf_config)
    if quant is None or str(quant.get("quant_method", "")).lower() != method:
        return Int4Config(method=method, bits=4, group_size=128, desc_act=False, zero_offset=method == "gptq")
    bits = int(quant.get("bits", quant.get("w_bit", 4)))
    group = int(quant.get("group_size", quant.get("q_group_size", 128)))
    if bits not in ((4,) if method == "awq" else int4_ref.SUPPORTED_BITS):
        _refuse("bits", bits, "4 (awq)" if method == "awq" else "4, 8 (gptq)")
    if group != -1 and (group <= 0 or group % int4_ref.pack_factor(bits)):
        _refuse("group_size", group, "a positive multiple of 32 / bits, or -1 (GPTQ: one group per row)")
    if method == "awq":
        return _awq_config(quant, bits, group)
    return _gptq_config(quant, bits, group)


def _awq_config(quant: dict, bits: int, group: int) -> Int4Config:
    if group == -1:
        _refuse("group_size", group, "a positive group size (awq)")
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        _refuse("version", quant.get("version"), "gemm (AutoAWQ's GEMM export)")
    if not quant.get("zero_point", True):
        _refuse("zero_point", quant.get("zero_point"), "true (awq with zero points)")
    return Int4Config(method="awq", bits=4, group_size=group, desc_act=False, zero_offset=False)


def _gptq_config(quant: dict, bits: int, group: int) -> Int4Config:
    fmt = str(quant.get("checkpoint_format") or "gptq").lower()
    if fmt not in GPTQ_FORMATS or quant.get("is_marlin_format"):
        _refuse("checkpoint_format", quant.get("checkpoint_format"), ", ".join(GPTQ_FORMATS))
    dynamic = quant.get("dynamic") or {}
    if any(not str(rule).startswith("-:") for rule in dynamic):  # "-:" rules only skip modules
        _refuse("dynamic", dynamic, "rules that skip modules (-:regex); per-module bits or group sizes are not")
    return Int4Config(method="gptq", bits=bits, group_size=group, desc_act=bool(quant.get("desc_act", False)),
                      zero_offset=fmt == "gptq")


def _narrow(t: torch.Tensor, dim: int, span: tuple[int, int] | None, unit: int, what: str) -> torch.Tensor:
    """t narrowed along dim to span (in elements) counted in `unit`s; a span that cuts a unit is refused."""
    if span is None:
        return t
    start, size = span
    if start == 0 and -(-size // unit) == t.shape[dim]:  # all of it (a partial last group included)
        return t
    if start % unit or size % unit:
        raise ValueError(f"{what}: a tensor-parallel shard [{start}, {start + size}) cuts a packed or grouped "
                         f"unit of {unit}; choose a tensor_parallel_size that keeps whole units")
    return t.narrow(dim, start // unit, size // unit)


def packed_shape(kind: str, cfg: Int4Config, out_features: int, in_features: int) -> tuple[int, ...]:
    """The on-disk shape of `<module>.<kind>` for a whole [out_features, in_features] weight: AWQ qweight
    [K, N/pack], GPTQ qweight [K/pack, N], qzeros [groups, N/pack], scales [groups, N], g_idx [K]."""
    pack, n, k = int4_ref.pack_factor(cfg.bits), out_features, in_features
    groups = cfg.num_groups(k)
    shapes = {"qweight": (k, -(-n // pack)) if cfg.method == "awq" else (-(-k // pack), n),
              "qzeros": (groups, -(-n // pack)), "scales": (groups, n), "g_idx": (k,)}
    if kind not in shapes:
        raise ValueError(f"unknown int4 tensor kind {kind!r}")
    return shapes[kind]


def checkpoint_slice(kind: str, loaded: torch.Tensor, cfg: Int4Config, rows: tuple[int, int] | None = None,
                     cols: tuple[int, int] | None = None, whole_groups: bool = True,
                     full: tuple[int, int] | None = None) -> torch.Tensor:
    """A checkpoint tensor `<module>.<kind>` -> output rows `rows` x input columns `cols` (element spans,
    None: all) in our layout (kernels/int4_ref.py). whole_groups False: keep every group's scales and
    zeros whatever `cols` is (act order, or one group spanning the shards). full (out_features,
    in_features): the whole weight the config gives, which the tensor must pack exactly; a shard cut from
    a larger tensor would load a part of it without a word (a config that does not match the weights)."""
    pack, group, awq = int4_ref.pack_factor(cfg.bits), cfg.group_size, cfg.method == "awq"
    what = f"{cfg.method} {kind}"
    if full is not None and tuple(loaded.shape) != packed_shape(kind, cfg, *full):
        raise ValueError(f"shape {tuple(loaded.shape)}, but the config gives {packed_shape(kind, cfg, *full)} "
                         f"({what} of a [{full[0]}, {full[1]}] weight): config.json (or --hf-overrides) does not "
                         "match the weights")
    gcols = cols if whole_groups and group != -1 else None
    if kind == "qweight":  # AWQ [K, N/8], GPTQ [K/pack, N]
        t = materialize(_narrow(_narrow(loaded, 1, rows, pack if awq else 1, what), 0, cols, 1 if awq else pack,
                                what))
        if awq:  # unpack the interleaved output columns, repack along the inputs
            return int4_ref.pack_rows(int4_ref.awq_unpack(t).T.contiguous(), 4)
        return t.T.contiguous()  # GPTQ's int32 already holds `pack` consecutive inputs of one output
    if kind == "qzeros":  # [K/g, N/pack] packed along the output dim
        t = materialize(_narrow(_narrow(loaded, 1, rows, pack, what), 0, gcols, group, what))
        zeros = int4_ref.awq_unpack(t) if awq else int4_ref.unpack_rows(t, cfg.bits) + int(cfg.zero_offset)
        return zeros.T.to(torch.float16).contiguous()
    if kind == "scales":  # [K/g, N]
        t = materialize(_narrow(_narrow(loaded, 1, rows, 1, what), 0, gcols, group, what))
        return t.T.to(torch.float16).contiguous()
    if kind == "g_idx":  # [K]
        return materialize(_narrow(loaded, 0, cols, 1, what)).to(torch.int32)
    raise ValueError(f"unknown int4 tensor kind {kind!r}")


def split_name(name: str) -> tuple[str, str | None]:
    """`<module>.qweight` -> (`<module>`, "qweight"); a name of another kind -> (name, None)."""
    prefix, _, kind = name.rpartition(".")
    return (prefix, kind) if kind in INT4_SUFFIXES else (name, None)


def dequantize_int4_weights(weights: Iterable[tuple[str, torch.Tensor]], cfg: Int4Config,
                            keep: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """Passes through the int4 tensors of every `<module>` with keep(module) (built int4); gathers the
    others' and yields `<module>.weight` dequantized to float32 [N, K] (the parameter's loader casts it).
    GPTQ's g_idx is dropped where desc_act is false (it is then k // group_size)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    needed = {"qweight", "qzeros", "scales"} | ({"g_idx"} if cfg.desc_act else set())
    for name, tensor in weights:
        prefix, kind = split_name(name)
        if kind is None:
            yield name, tensor
        elif kind == "g_idx" and not cfg.desc_act:
            continue
        elif keep(prefix):
            yield name, tensor
        else:
            parts = pending.setdefault(prefix, {})
            parts[kind] = tensor
            if needed <= parts.keys():
                yield f"{prefix}.weight", _dequantize(pending.pop(prefix), cfg)
    if pending:
        shown = ", ".join(sorted(pending)[:4])
        raise ValueError(f"{cfg.method} checkpoint: {len(pending)} module(s) lack one of "
                         f"{', '.join(sorted(needed))}: {shown}")


def _dequantize(parts: dict[str, torch.Tensor], cfg: Int4Config) -> torch.Tensor:
    ours = {kind: checkpoint_slice(kind, t, cfg, whole_groups=False) for kind, t in parts.items()}
    k = ours["qweight"].shape[1] * int4_ref.pack_factor(cfg.bits)
    return int4_ref.dequantize(ours["qweight"], ours["scales"], ours["qzeros"], cfg.bits,
                               cfg.group_for(k), ours.get("g_idx"))
