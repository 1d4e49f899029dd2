"""Writes AWQ (AutoAWQ GEMM) and GPTQ checkpoints from a float one, in the published on-disk formats,
with a reference checkpoint that holds exactly the dequantized weights (for transformers to run).

The packing here is written from the formats' description, independently of deepserve's unpacking
(kernels/int4_ref.py), so a wrong bit order on either side fails the tests:
  AWQ   qweight [K, N/8]: int32 j holds output columns 8j .. 8j+7, bits 4i holding column 8j + ORDER[i]
        with ORDER = 0 2 4 6 1 3 5 7; qzeros [K/g, N/8] likewise; scales [K/g, N] fp16.
  GPTQ  qweight [K/p, N]: int32 r holds inputs p r .. p r + p - 1 in order (p = 32 / bits); qzeros
        [K/g, N/p] packed in order along the outputs, storing zero - 1 ("gptq" v1); scales [K/g, N]
        fp16; g_idx [K] the group of each input.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib

import torch
from safetensors.torch import load_file, save_file

AWQ_COLUMN_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
# Linear layers AutoAWQ / GPTQ quantize in these families: every *_proj (attention, MLP, shared and
# routed experts); the MoE router (mlp.gate) and lm_head are not projections.
QUANTIZED = re.compile(r"(proj|proj_with_mqa)\.weight$")


def quantize_groups(w: torch.Tensor, bits: int, group: int, sym: bool, g_idx: torch.Tensor, min_zero: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (codes [N, K], scales [N, G] fp16, zeros [N, G] int) by round-to-nearest per output row
    and group g_idx[k]; the grid (q - zero) * scale covers the group's range. min_zero 1: GPTQ's v1 format
    stores zero - 1 and cannot hold a zero point of 0 (readers add 1 to the 4-bit field)."""
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    qmax = 2**bits - 1
    scales = torch.empty(n, groups, dtype=torch.float16)
    zeros = torch.empty(n, groups, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g].float()
        if sym:
            scale = (cols.abs().amax(dim=1) / (qmax // 2)).clamp(min=1e-6)
            zero = torch.full((n,), (qmax + 1) // 2, dtype=torch.int64)
        else:
            lo, hi = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
            scale = ((hi - lo) / qmax).clamp(min=1e-6)
            zero = (-lo / scale.half().float()).round().clamp(min_zero, qmax).long()
        scales[:, g], zeros[:, g] = scale.half(), zero
    s, z = scales.float()[:, g_idx], zeros[:, g_idx]
    codes = (w.float() / s).round().add(z).clamp(0, qmax).long()
    return codes, scales, zeros


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    return (codes - zeros[:, g_idx]).float() * scales.float()[:, g_idx]


def _word(fields: list[torch.Tensor], bits: int) -> torch.Tensor:
    """int32 from bit fields (field i at bits i * bits), the same 32 bits as a signed int."""
    acc = torch.zeros_like(fields[0], dtype=torch.int64)
    for i, f in enumerate(fields):
        acc |= (f.long() & (2**bits - 1)) << (i * bits)
    return torch.where(acc >= 2**31, acc - 2**32, acc).to(torch.int32)


def awq_pack_columns(values: torch.Tensor) -> torch.Tensor:
    """[R, C] 4-bit values -> [R, C/8] AWQ words (interleaved column order)."""
    words = []
    for j in range(values.shape[1] // 8):
        words.append(_word([values[:, 8 * j + AWQ_COLUMN_ORDER[i]] for i in range(8)], 4))
    return torch.stack(words, dim=1)


def pack_in_order(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack 32 / bits consecutive entries along `dim` into one int32, first entry in the low bits."""
    p = 32 // bits
    v = values.movedim(dim, 0)
    words = torch.stack([_word([v[r * p + i] for i in range(p)], bits) for r in range(v.shape[0] // p)])
    return words.movedim(0, dim).contiguous()


def awq_tensors(codes, scales, zeros) -> dict[str, torch.Tensor]:
    return {"qweight": awq_pack_columns(codes.T), "qzeros": awq_pack_columns(zeros.T),
            "scales": scales.T.contiguous()}


def gptq_tensors(codes, scales, zeros, bits: int, g_idx: torch.Tensor, v1: bool = True) -> dict[str, torch.Tensor]:
    return {"qweight": pack_in_order(codes.T, bits, dim=0), "qzeros": pack_in_order(zeros.T - int(v1), bits, dim=1),
            "scales": scales.T.contiguous(), "g_idx": g_idx.to(torch.int32)}


def group_index(k: int, group: int, act_order: bool, seed: int) -> torch.Tensor:
    """g_idx [K]: k // group, or under act order the group of each input's rank in a random order."""
    if not act_order:
        return torch.arange(k) // group
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    rank = torch.empty(k, dtype=torch.long)
    rank[order] = torch.arange(k)
    return rank // group


def write_int4_checkpoint(src: str, dst: str, ref_dir: str, method: str, bits: int = 4, group: int = 8,
                          sym: bool = False, desc_act: bool = False, skip: tuple[str, ...] = (),
                          config_extra: dict | None = None) -> None:
    """From the float checkpoint in `src`: `dst` in `method`'s format, every projection whose name holds
    none of `skip` quantized (modules_to_not_convert), and `ref_dir` with exactly the dequantized weights."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out, reference = {}, {}
    for name, t in sorted(tensors.items()):
        if not QUANTIZED.search(name) or any(s in name for s in skip):
            out[name] = reference[name] = t
            continue
        # Act order comes from the layer input's statistics: projections of one input (q, k, v; gate, up)
        # share it, so the seed is the parent module's.
        g_idx = group_index(t.shape[1], group, desc_act, seed=zlib.crc32(name.rsplit(".", 2)[0].encode()))
        codes, scales, zeros = quantize_groups(t, bits, group, sym, g_idx, min_zero=int(method == "gptq"))
        reference[name] = dequantize(codes, scales, zeros, g_idx).to(t.dtype)
        packed = (awq_tensors(codes, scales, zeros) if method == "awq"
                  else gptq_tensors(codes, scales, zeros, bits, g_idx))
        prefix = name.removesuffix(".weight")
        out.update({f"{prefix}.{kind}": v for kind, v in packed.items()})
    for folder, weights in ((dst, out), (ref_dir, reference)):
        shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(weights, os.path.join(folder, "model.safetensors"))
    quant = ({"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": list(skip) or None} if method == "awq" else
             {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": desc_act,
              "checkpoint_format": "gptq", "modules_to_not_convert": list(skip) or None})
    quant.update(config_extra or {})
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = quant
    with open(path, "w") as f:
        json.dump(config, f)
