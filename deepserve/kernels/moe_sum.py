"""The last step of a fused MoE: each token's K slot outputs summed, in slot order, into one row.

    out[t] = sum over k = 0 .. K-1 of  (weights[t, k] *) y[t * K + k]       (in fp32, rounded once)

With weights and ids, a slot whose id is num_experts (an assignment left out under expert parallelism) is
selected away, never multiplied into the sum. One launch, a fixed order (deterministic, no atomics), no host
sync. Why a kernel: torch's `y.view(T, K, H).sum(1)` took 4.5 µs a call at one token on the H200 (V2-Lite:
26 calls a decode step; bench/RESULTS.md, 2026-12-04 call 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepserve import envs
from deepserve.kernels import pdl
from deepserve.kernels.elementwise import _cast

BLOCK = 1024  # features a program


def sum_slots(y: torch.Tensor, top_k: int, weights: torch.Tensor | None = None, ids: torch.Tensor | None = None,
              num_experts: int = 0, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y [T * K, H] (row t * K + k: token t's slot k) -> [T, H] in out_dtype (y's); with weights [T, K] and
    ids [T, K] (both or neither), each slot weighted and slots with id >= num_experts left out."""
    rows, h = y.shape
    if rows % top_k or (weights is None) != (ids is None) or y.stride(1) != 1:
        raise ValueError(f"sum_slots: y [T * K, H] with a contiguous last dim (got {tuple(y.shape)}, K {top_k}), "
                         "weights and ids together")
    t = rows // top_k
    out = torch.empty(t, h, dtype=out_dtype or y.dtype, device=y.device)
    if t == 0 or h == 0:
        return out
    weighted = weights is not None
    on = pdl.wanted(y, t, mla_moe=True)
    _sum_slots_kernel[(t, triton.cdiv(h, BLOCK))](
        y, weights.reshape(-1) if weighted else y, ids.reshape(-1) if weighted else y, out, h, y.stride(0),
        num_experts, TOP_K=top_k, WEIGHTED=weighted, BLOCK=BLOCK, INTERPRET=envs.TRITON_INTERPRET, PDL=on,
        num_warps=4, **pdl.launch_options(on))
    return out


@triton.jit
def _sum_slots_kernel(y_ptr, w_ptr, ids_ptr, out_ptr, H, stride_y, E, TOP_K: tl.constexpr, WEIGHTED: tl.constexpr,
                      BLOCK: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    pdl.trigger(PDL)  # a small kernel: the next one may start now (kernels/pdl.py)
    pdl.wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        slot = t * TOP_K + k
        part = tl.load(y_ptr + slot * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
        if WEIGHTED:
            part = tl.where(tl.load(ids_ptr + slot) < E, tl.load(w_ptr + slot) * part, 0.0)
        acc += part
    tl.store(out_ptr + t * H + cols, _cast(acc, out_ptr.dtype.element_ty, INTERPRET), mask=ok)
