"""Fused MoE routing: router logits -> (weights, expert ids) in one Triton kernel.

Computes exactly what layers/moe.py `route` computes (its docstring and the module's describe the
methods), for every RoutingConfig:
  1. scores = softmax or sigmoid of the logits (fp32, whatever the logits' dtype);
  2. choice = scores, plus e_score_correction_bias under noaux_tc (the bias picks, never weighs);
  3. with groups (not greedy, n_group > 1, topk_group < n_group): group score = the best choice in the
     group (group_limited_greedy) or the sum of its two best (noaux_tc); every expert outside the
     topk_group best groups is dropped;
  4. ids = the top_k choices; weights = their unbiased scores, renormalized (norm_topk_prob), times
     routed_scaling_factor.
In torch that is about twenty small kernels per layer (topk alone is several); here one launch, no
host sync, fixed-size outputs: CUDA-graph safe.

Layout. A program routes BLOCK_T tokens; each token's experts sit in a row of BLOCK_G * BLOCK_S slots,
slot g * BLOCK_S + j holding expert g * GROUP_SIZE + j of group g (BLOCK_G, BLOCK_S: the group count
and group size rounded up to powers of two). Padding slots hold -inf, so a group is a contiguous run of
slots and reshaping a row to [BLOCK_G, BLOCK_S] gives one group per line. Without groups the row is
one group of X experts.

Selection is iterative: K times, take the row's argmax and set it to -inf (topk_group times over the
group scores likewise). Ties go to the lowest slot, which is the lowest expert id (and the lowest group
id for group scores); torch.topk leaves tie order unspecified, so on exact ties the kernel and `route`
may pick different, equally good experts. The ids come out in selection order: best first.

The weights are the scores of the picked experts, recomputed from their logits (one gathered load of
K values) with the same formula as the full row, so no per-pick reduction is spent extracting them.

Shared experts fused as experts (layers/moe.py, DEEPSERVE_SHARED_EXPERTS_FUSION): with `shared` S > 0 each token's
row gets S more columns after its K picks, ids X .. X + S - 1 with weight 1.0 (not renormalized, not scaled: a shared
expert's output is added as it is).

Shapes: T tokens, X routed experts, K experts per token, S shared experts fused, G groups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from deepserve import envs
from deepserve.kernels import pdl

# Triton decides at decoration, when the module is imported; a launch must not reread the environment.
INTERPRET = envs.TRITON_INTERPRET

if TYPE_CHECKING:  # attributes only: the kernel does not depend on the layers at run time
    from deepserve.layers.moe import RoutingConfig

MAX_EXPERTS = 512  # one row of a token's experts (padded) lives in registers
MAX_TOP_K = 16  # the selection loop is unrolled K times
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fits(cfg: RoutingConfig, shared: int = 0) -> bool:
    """Whether the kernel takes this config, with `shared` fused shared experts (otherwise callers use the torch
    `route`)."""
    return cfg.num_experts <= MAX_EXPERTS and cfg.top_k + shared <= MAX_TOP_K


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, stride_t, scale,
                  X: tl.constexpr, K: tl.constexpr, GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                  TOPK_GROUP: tl.constexpr, SOFTMAX: tl.constexpr, BIAS: tl.constexpr, TOP2_GROUPS: tl.constexpr,
                  NORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
                  BLOCK_K: tl.constexpr, SHARED: tl.constexpr = 0, PDL: tl.constexpr = False):
    # GROUPS == 1 means no group limit (the wrapper folds every such config into it).
    pdl.trigger(PDL)  # a small kernel: the next one may start now (kernels/pdl.py)
    pdl.wait(PDL)
    BLOCK_X: tl.constexpr = BLOCK_G * BLOCK_S
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    row_ok = rows < num_tokens
    row_ptr = logits_ptr + rows.to(tl.int64) * stride_t  # [BLOCK_T]
    slot = tl.arange(0, BLOCK_X)  # [BLOCK_X]
    expert = (slot // BLOCK_S) * GROUP_SIZE + slot % BLOCK_S  # [BLOCK_X], only meaningful where valid
    valid = (slot // BLOCK_S < GROUPS) & (slot % BLOCK_S < GROUP_SIZE)
    # Rows past T load 0 (finite, so nothing below turns NaN there); padding slots are -inf.
    logit = tl.load(row_ptr[:, None] + expert[None, :], mask=row_ok[:, None] & valid[None, :], other=0.0)
    logit = tl.where(valid[None, :], logit.to(tl.float32), float("-inf"))  # [BLOCK_T, BLOCK_X]
    if SOFTMAX:
        row_max = tl.max(logit, axis=1)  # [BLOCK_T]
        denom = tl.sum(tl.exp(logit - row_max[:, None]), axis=1)  # [BLOCK_T]; padding adds exp(-inf) = 0
    else:
        row_max = tl.zeros([BLOCK_T], dtype=tl.float32)  # unused by sigmoid
        denom = tl.zeros([BLOCK_T], dtype=tl.float32)
    choice = _score(logit, row_max, denom, SOFTMAX)
    if BIAS:
        choice += tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(valid[None, :], choice, float("-inf"))  # padding is never picked
    if GROUPS > 1:
        choice = _keep_best_groups(choice, TOPK_GROUP, TOP2_GROUPS, BLOCK_T, BLOCK_G, BLOCK_S)
    picked = _top_slots(choice, K, BLOCK_T, BLOCK_X, BLOCK_K)  # [BLOCK_T, BLOCK_K]
    # Slot -> expert id. Only non-finite logits could make a padding slot win; the clamp keeps even
    # that id inside [0, X), since the expert kernels index weights with it unchecked.
    ids = tl.minimum((picked // BLOCK_S) * GROUP_SIZE + picked % BLOCK_S, X - 1)
    kk = tl.arange(0, BLOCK_K)  # BLOCK_K >= K + SHARED
    routed = kk[None, :] < K
    picked_logit = tl.load(row_ptr[:, None] + ids, mask=row_ok[:, None] & routed, other=0.0).to(tl.float32)
    weights = tl.where(routed, _score(picked_logit, row_max, denom, SOFTMAX), 0.0)
    if NORM:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    weights = weights * scale
    if SHARED > 0:  # columns K .. K + SHARED - 1: the fused shared experts X .. X + SHARED - 1, weight 1
        weights = tl.where(routed, weights, 1.0)
        ids = tl.where(routed, ids, X + kk[None, :] - K)
    out_ok = row_ok[:, None] & (kk[None, :] < K + SHARED)
    out = rows.to(tl.int64)[:, None] * (K + SHARED) + kk[None, :]  # [BLOCK_T, BLOCK_K] offsets into [T, K + S]
    tl.store(weights_ptr + out, weights, mask=out_ok)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=out_ok)


@triton.jit
def _score(logit, row_max, denom, SOFTMAX: tl.constexpr):
    # softmax over the row (given its max and exp-sum) or sigmoid, elementwise: the full row and the
    # picked logits go through this one formula, so a picked expert's weight is its score.
    if SOFTMAX:
        s = tl.exp(logit - row_max[:, None]) / denom[:, None]
    else:
        s = tl.sigmoid(logit)
    return s


@triton.jit
def _keep_best_groups(choice, TOPK_GROUP: tl.constexpr, TOP2_GROUPS: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr):
    # choice [BLOCK_T, BLOCK_G * BLOCK_S] with every slot outside the TOPK_GROUP best groups set to -inf.
    # Padding groups are all -inf, so they score -inf and real groups (finite) always beat them.
    grouped = tl.reshape(choice, [BLOCK_T, BLOCK_G, BLOCK_S])
    best, best_at = tl.max(grouped, axis=2, return_indices=True)  # [BLOCK_T, BLOCK_G]
    if TOP2_GROUPS:  # noaux_tc: best + second best, as topk(2).values.sum() adds them
        others = tl.where(tl.arange(0, BLOCK_S)[None, None, :] == best_at[:, :, None], float("-inf"), grouped)
        group_score = best + tl.max(others, axis=2)
    else:
        group_score = best
    g = tl.arange(0, BLOCK_G)[None, :]  # [1, BLOCK_G]
    keep = tl.zeros([BLOCK_T, BLOCK_G], dtype=tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        hit = g == tl.argmax(group_score, axis=1, tie_break_left=True)[:, None]  # [BLOCK_T, BLOCK_G]
        keep = keep | hit
        group_score = tl.where(hit, float("-inf"), group_score)
    kept = tl.where(keep[:, :, None], grouped, float("-inf"))
    return tl.reshape(kept, [BLOCK_T, BLOCK_G * BLOCK_S])


@triton.jit
def _top_slots(choice, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_K: tl.constexpr):
    # [BLOCK_T, BLOCK_K] int32: each row's K best slots, best first (ties: lowest slot); unused columns 0.
    slot = tl.arange(0, BLOCK_X)[None, :]
    kk = tl.arange(0, BLOCK_K)[None, :]
    picked = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for i in tl.static_range(K):
        top = tl.argmax(choice, axis=1, tie_break_left=True)[:, None]  # [BLOCK_T, 1]
        picked = tl.where(kk == i, top, picked)
        choice = tl.where(slot == top, float("-inf"), choice)  # picked once only
    return picked


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"fused_route: {message}")


def _check_inputs(logits: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None) -> None:
    _require(cfg.num_experts <= MAX_EXPERTS, f"{cfg.num_experts} experts is more than {MAX_EXPERTS}")
    _require(cfg.top_k <= MAX_TOP_K, f"top_k {cfg.top_k} is more than {MAX_TOP_K}")
    _require(logits.dim() == 2 and logits.shape[1] == cfg.num_experts,
             f"logits must be [T, {cfg.num_experts}], got {tuple(logits.shape)}")
    _require(logits.dtype in LOGIT_DTYPES, f"logits dtype {logits.dtype} is not one of {LOGIT_DTYPES}")
    _require(logits.stride(1) == 1 or logits.shape[1] == 1, "the logits' last dimension must be contiguous")
    _require(logits.is_cuda or INTERPRET,
             f"logits on {logits.device}: the kernel runs on CUDA (or CPU under TRITON_INTERPRET=1)")
    if cfg.topk_method != "noaux_tc":
        return  # `route` ignores the bias there too
    _require(bias is not None, "noaux_tc needs e_score_correction_bias")
    _require(bias.shape == (cfg.num_experts,) and bias.is_contiguous(),
             f"bias must be contiguous [{cfg.num_experts}], got {tuple(bias.shape)}")
    _require(bias.is_floating_point(), f"bias dtype {bias.dtype} is not floating point")
    _require(bias.device == logits.device, f"bias on {bias.device}, logits on {logits.device}")


def default_block_t(num_tokens: int) -> int:
    """Tokens per program. On the GPU one: a decode batch then spreads over as many SMs as it has tokens
    and each program is one warp of short reductions (latency, not throughput, is what counts at
    T <= 256). The interpreter runs programs one after another, so there it routes 16 at a time."""
    if INTERPRET:
        return min(16, triton.next_power_of_2(max(num_tokens, 1)))
    return 1


def fused_route(logits: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None = None,
                block_t: int | None = None, shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, X] (fp32, bf16 or fp16; rows may be strided) -> (weights [T, K + shared] float32,
    expert ids [T, K + shared] int64), both contiguous: what `route(logits.float(), cfg, bias, shared)` returns,
    ids in selection order (best first), then the shared experts'. `bias` [X] is read only under noaux_tc, as
    by `route`. block_t: tokens per program (a power of two), by default `default_block_t`."""
    _check_inputs(logits, cfg, bias)
    _require(0 <= shared and cfg.top_k + shared <= MAX_TOP_K,
             f"top_k {cfg.top_k} + {shared} shared experts is more than {MAX_TOP_K} columns")
    t, k = logits.shape[0], cfg.top_k
    weights = torch.empty(t, k + shared, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k + shared, dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    block_t = block_t or default_block_t(t)
    _require(block_t & (block_t - 1) == 0, f"block_t {block_t} is not a power of two")
    # No group limit when greedy, one group, or every group kept: all fold into one group of X.
    grouped = cfg.topk_method != "greedy" and cfg.topk_group < cfg.n_group
    groups = cfg.n_group if grouped else 1
    group_size = cfg.num_experts // groups
    noaux = cfg.topk_method == "noaux_tc"
    block_g, block_s = triton.next_power_of_2(groups), triton.next_power_of_2(group_size)
    on = pdl.wanted(logits, t, mla_moe=True)
    _route_kernel[(triton.cdiv(t, block_t),)](
        logits, bias if noaux else logits, weights, ids, t, logits.stride(0), float(cfg.routed_scaling_factor),
        X=cfg.num_experts, K=k, GROUPS=groups, GROUP_SIZE=group_size, TOPK_GROUP=cfg.topk_group,
        SOFTMAX=cfg.scoring_func == "softmax", BIAS=noaux, TOP2_GROUPS=noaux and group_size > 1,
        NORM=cfg.norm_topk_prob, BLOCK_T=block_t, BLOCK_G=block_g, BLOCK_S=block_s,
        BLOCK_K=triton.next_power_of_2(k + shared), SHARED=shared,
        # One warp up to 256 slots per program: every reduction stays inside the warp (shuffles, no
        # shared memory round trips), which is what the K + topk_group serial argmaxes are bound by.
        num_warps=max(1, min(4, block_t * block_g * block_s // 256)), PDL=on, **pdl.launch_options(on),
    )
    return weights, ids


# Decode batches up to this many tokens take router_logits; larger ones (prefill) cuBLAS's GEMM.
ROUTER_GEMV_MAX_TOKENS = 16


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H] (fp32 / bf16 / fp16, contiguous rows) @ weight [X, H]^T (float32) -> logits [T, X] float32, x
    widened to fp32 in the kernel: what `F.linear(x.float(), weight)` computes (sums in another order), in one
    launch where that is a cast and cuBLAS's GEMV (two kernels; on the H200 ~6 µs a V2-Lite layer at one token,
    bench/RESULTS.md, 2026-12-04 call 1). Program x computes expert x's logit for every token (T <= 16)."""
    _require(x.dim() == 2 and x.stride(1) == 1 and weight.dim() == 2 and weight.shape[1] == x.shape[1]
             and weight.dtype == torch.float32 and weight.is_contiguous(),
             f"router_logits: x [T, H] and a contiguous float32 weight [X, H], got {tuple(x.shape)} and "
             f"{tuple(weight.shape)} {weight.dtype}")
    (t, h), experts = x.shape, weight.shape[0]
    out = torch.empty(t, experts, dtype=torch.float32, device=x.device)
    if t and experts:
        on = pdl.wanted(x, t, mla_moe=True)
        _router_logits_kernel[(experts,)](x, weight, out, t, h, x.stride(0), experts,
                                          BLOCK_H=min(2048, triton.next_power_of_2(h)), PDL=on, num_warps=4,
                                          **pdl.launch_options(on))
    return out


@triton.jit(do_not_specialize=["T"])
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, T, H, stride_x, X, BLOCK_H: tl.constexpr,
                          PDL: tl.constexpr = False):
    pdl.trigger(PDL)  # a small kernel: the next one may start now (kernels/pdl.py)
    pdl.wait(PDL)
    e = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    for t in range(T):
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            ok = h0 + offs < H
            w = tl.load(w_ptr + e * H + h0 + offs, mask=ok, other=0.0)
            acc += w * tl.load(x_ptr + t * stride_x + h0 + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * X + e, tl.sum(acc, axis=0))
