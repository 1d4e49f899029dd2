"""DeepSeekMoE: shared experts every token passes through, plus K routed experts per token out of X.

The gate scores every routed expert, picks K by `topk_method`, and weighs their outputs:
  greedy                the K best scores (DeepSeek-V2-Lite)
  group_limited_greedy  experts form n_group groups; a token picks only inside the topk_group groups
                        whose best score is highest (DeepSeek-V2, V2.5)
  noaux_tc              sigmoid scores plus e_score_correction_bias choose the experts (the bias balances
                        load without an auxiliary loss); groups rank by the sum of their two best biased
                        scores; the weights are the unbiased scores (DeepSeek-V3, R1)
then the K weights are renormalized (norm_topk_prob) and multiplied by routed_scaling_factor.

Shapes: T tokens, E hidden size, X routed experts, K experts per token, I expert intermediate size
(this rank's share), G groups.

Expert parallelism (--enable-expert-parallel) places the routed experts instead of splitting them: the
tensor-parallel ranks each hold X / tp whole experts, rank r experts [r X/tp, (r+1) X/tp). The hidden
states are replicated on every rank and every rank routes identically, so each rank computes what its own
experts add for every token (assignments to other ranks' experts are dropped) and the same one all-reduce
as under tensor parallelism sums the ranks' partial outputs. Shared experts stay tensor-parallel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepserve import envs
from deepserve.distributed.parallel_state import get_tp_rank, get_tp_world_size, tp_all_reduce
from deepserve.kernels import fp8_ref
from deepserve.layers.activation import SiluAndMul
from deepserve.layers.int4 import int4_linear, int4_parameters, keeps_all_groups
from deepserve.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    check_extent,
    default_weight_loader,
    parameter_like,
)
from deepserve.layers.quantization import PER_CHANNEL_EXPERT_BLOCK, Fp8Config, Int4Config, QuantConfig, warn_once

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class RoutingConfig:
    num_experts: int
    top_k: int
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    # Not routing but placement: split the experts across the tensor-parallel ranks rather than each
    # expert's intermediate size. Carried here because it is what DeepseekMoE receives.
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(
                f"config.json topk_method {self.topk_method!r} is not supported; supported: {', '.join(TOPK_METHODS)}"
            )
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"config.json scoring_func {self.scoring_func!r} is not supported; "
                f"supported: {', '.join(SCORING_FUNCS)}"
            )
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"config.json num_experts_per_tok ({self.top_k}) must be in [1, n_routed_experts]")
        if self.topk_method == "greedy":
            return
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(
                f"config.json n_routed_experts ({self.num_experts}) must be divisible by n_group ({self.n_group})"
            )
        if not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"config.json topk_group ({self.topk_group}) must be in [1, n_group ({self.n_group})]")
        # With fewer experts than K in the kept groups a masked-out expert would be picked.
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(
                f"config.json num_experts_per_tok ({self.top_k}) is more than the experts in topk_group "
                f"({self.topk_group}) groups of {self.num_experts // self.n_group}"
            )

    @classmethod
    def from_hf(cls, hf_config: Any, expert_parallel: bool = False) -> RoutingConfig:
        # Defaults are what each generation shipped with when the config leaves a field out.
        v3 = getattr(hf_config, "model_type", "") == "deepseek_v3"
        return cls(
            num_experts=hf_config.n_routed_experts,
            top_k=hf_config.num_experts_per_tok,
            topk_method=getattr(hf_config, "topk_method", None) or ("noaux_tc" if v3 else "greedy"),
            scoring_func=getattr(hf_config, "scoring_func", None) or ("sigmoid" if v3 else "softmax"),
            n_group=getattr(hf_config, "n_group", None) or 1,
            topk_group=getattr(hf_config, "topk_group", None) or 1,
            norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
            routed_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", None) or 1.0),
            expert_parallel=expert_parallel,
        )


def route(logits: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None = None, shared: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, X] (float32) -> (weights [T, K + shared] float32, expert ids [T, K + shared] int64):
    the K picks, then `shared` fused shared experts (ids X .. X + shared - 1, weight 1; DeepseekMoE)."""
    scores = logits.softmax(dim=-1) if cfg.scoring_func == "softmax" else logits.sigmoid()  # [T, X]
    choice = scores + bias if cfg.topk_method == "noaux_tc" else scores  # the bias picks, never weighs
    if cfg.topk_method != "greedy" and cfg.n_group > 1:
        choice = _keep_best_groups(choice, cfg)
    ids = choice.topk(cfg.top_k, dim=-1).indices  # [T, K]
    weights = scores.gather(1, ids)  # [T, K]
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * cfg.routed_scaling_factor
    if shared:
        t = logits.shape[0]
        ids = torch.cat([ids, torch.arange(cfg.num_experts, cfg.num_experts + shared, device=ids.device).expand(t, -1)],
                        dim=1)
        weights = torch.cat([weights, weights.new_ones(t, shared)], dim=1)
    return weights, ids


def _keep_best_groups(choice: torch.Tensor, cfg: RoutingConfig) -> torch.Tensor:
    """-inf on every expert outside the token's topk_group best groups."""
    grouped = choice.view(choice.shape[0], cfg.n_group, -1)  # [T, G, X/G]
    if cfg.topk_method == "noaux_tc":
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # [T, G]
    else:
        group_scores = grouped.amax(dim=-1)  # [T, G]
    kept = group_scores.topk(cfg.topk_group, dim=-1).indices  # [T, topk_group]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # [T, G]
    return grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view_as(choice)


class MoEGate(nn.Module):
    def __init__(self, hidden_size: int, cfg: RoutingConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # float32 whatever the model dtype, as transformers keeps it: routing is a discrete choice
        # that bf16 rounding of the scores would flip.
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.e_score_correction_bias = None
        if cfg.topk_method == "noaux_tc":
            bias = torch.zeros(cfg.num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
            self.e_score_correction_bias.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor, shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """On CUDA the Triton routing kernel (kernels/moe_routing.py: one launch, CUDA-graph safe;
        DEEPSERVE_FUSED_ROUTING=0 turns it off), elsewhere `route`; both return (weights [T, K + shared]
        float32, ids [T, K + shared] int64), `shared` fused shared experts last. The logits stay fp32: bf16
        logits change about 1-2% of the tokens' experts."""
        logits = _router_logits(x, self.weight)  # [T, E] -> [T, X]
        fused = _fused_router(self.cfg, shared) if logits.is_cuda else None
        if fused is not None:
            return fused(logits, self.cfg, self.e_score_correction_bias, shared=shared)
        return route(logits, self.cfg, self.e_score_correction_bias, shared)


class MLP(nn.Module):
    """SwiGLU FFN of the dense layers and the shared experts: w2(silu(w1 x) * w3 x), w1 and w3 merged."""

    def __init__(self, hidden_size: int, intermediate_size: int, reduce_results: bool = True,
                 quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.w13 = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, quant=quant)
        self.w2 = RowParallelLinear(intermediate_size, hidden_size, reduce_results=reduce_results, quant=quant)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w13(x)))  # [T, E] -> [T, 2I] -> [T, I] -> [T, E]


def expert_shard_blocks(start: int, size: int, block: int) -> tuple[int, int]:
    """(start, size) in scale blocks of `block` of a rank's share [start, start + size) of an FP8 expert's
    intermediate size; the share must start on a block boundary. The loaders call it, and the planner with
    rank 1's start (deepserve plan refuses what serve would, in the same words)."""
    if start % block:
        raise ValueError(f"moe_intermediate_size shard of {size} per rank cuts FP8 blocks of {block}; "
                         "choose a tensor_parallel_size (or --enable-expert-parallel) that keeps whole blocks")
    return start // block, fp8_ref.cdiv(size, block)


class RoutedExperts(nn.Module):
    """Every routed expert's SwiGLU weights stacked: w13 [X, 2I, E] (w1 rows, then w3 rows), w2 [X, E, I].

    Tensor parallelism splits I, so each rank computes a partial sum that one all-reduce completes.
    Expert parallelism (expert_parallel with tp > 1) keeps I whole and gives each rank X / tp experts,
    [expert_start, expert_start + X / tp): the stacked parameters hold only those, indexed by local id,
    and each rank's partial sum covers only the assignments to its experts; the same all-reduce completes it.

    FP8 (block-scaled, as DeepSeek-V3 ships its experts): w13 and w2 are float8_e4m3fn with float32
    w13_scale_inv [X, 2 ceil(I/bn), ceil(E/bk)] (the w1 member's scale rows, then w3's) and w2_scale_inv
    [X, ceil(E/bn), ceil(I/bk)]; a tensor-parallel shard of I must start on a block boundary. A per-channel
    config (`--quantization fp8`) loads the model dtype and quantize_loaded_weights makes 128 x 128 blocks.

    Int4 (AWQ / GPTQ experts): w13_qweight [X, 2I, E/pack], w13_scales / w13_qzeros [X, 2I, groups of E],
    w2_qweight [X, E, I/pack], w2_scales / w2_qzeros [X, E, groups of I] (and w13_g_idx [X, E], w2_g_idx
    [X, I] under act order) in layers/int4.py's layout; a tensor-parallel shard of I keeps whole groups."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, expert_parallel: bool = False,
                 tp_rank: int | None = None, tp_size: int | None = None, quant: QuantConfig | None = None) -> None:
        super().__init__()
        # tp_rank / tp_size: this rank's place, by default the tensor-parallel group's (explicit for tests)
        self.tp_rank = get_tp_rank() if tp_rank is None else tp_rank
        self.tp_size = get_tp_world_size() if tp_size is None else tp_size
        self.num_experts = num_experts  # X, the whole model's
        self.expert_parallel = expert_parallel and self.tp_size > 1
        if self.expert_parallel:
            if num_experts % self.tp_size:
                raise ValueError(f"n_routed_experts ({num_experts}) is not divisible by tensor_parallel_size "
                                 f"({self.tp_size}) under --enable-expert-parallel")
            self.num_local = num_experts // self.tp_size
            self.expert_start = self.tp_rank * self.num_local
            self.inter_rank, self.inter_ranks = 0, 1  # I is not split
        else:
            if intermediate_size % self.tp_size:
                raise ValueError(
                    f"moe_intermediate_size ({intermediate_size}) is not divisible by tensor_parallel_size")
            self.num_local, self.expert_start = num_experts, 0
            self.inter_rank, self.inter_ranks = self.tp_rank, self.tp_size
        self.inter = intermediate_size // self.inter_ranks
        self.num_shared_fused = 0  # shared experts appended after the routed ones (absorb_shared)
        self.hidden = hidden_size
        self.quant = quant
        self.dtype = torch.get_default_dtype()  # the model dtype, for unquantize
        self.int4 = quant if isinstance(quant, Int4Config) else None
        self.block = quant.weight_block if isinstance(quant, Fp8Config) else None
        self.w13_scale_inv = self.w2_scale_inv = None
        if self.int4 is not None:
            self._make_int4(hidden_size, intermediate_size)
            return
        dtype = fp8_ref.FP8 if self.block else None
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * self.inter, hidden_size, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden_size, self.inter, dtype=dtype), requires_grad=False)
        self.w13.weight_loader = self._load_w13
        self.w2.weight_loader = self._load_w2
        if self.block:
            bn, bk = self.block
            shape13 = (self.num_local, 2 * fp8_ref.cdiv(self.inter, bn), fp8_ref.cdiv(hidden_size, bk))
            shape2 = (self.num_local, fp8_ref.cdiv(hidden_size, bn), fp8_ref.cdiv(self.inter, bk))
            self.w13_scale_inv = nn.Parameter(torch.empty(shape13, dtype=torch.float32), requires_grad=False)
            self.w2_scale_inv = nn.Parameter(torch.empty(shape2, dtype=torch.float32), requires_grad=False)
            self.w13_scale_inv.weight_loader = self._load_w13
            self.w2_scale_inv.weight_loader = self._load_w2

    def _make_int4(self, hidden_size: int, intermediate_size: int) -> None:
        cfg = self.int4
        self.w2_all_groups = keeps_all_groups(cfg, intermediate_size, self.inter_ranks)
        self.group13, self.group2 = cfg.group_for(hidden_size), cfg.group_for(intermediate_size)
        groups2 = cfg.num_groups(intermediate_size) if self.w2_all_groups else fp8_ref.cdiv(self.inter, self.group2)
        for prefix, params, loader in (
            ("w13", int4_parameters(cfg, (self.num_local,), 2 * self.inter, hidden_size,
                                    cfg.num_groups(hidden_size)), self._load_w13),
            ("w2", int4_parameters(cfg, (self.num_local,), hidden_size, self.inter, groups2), self._load_w2),
        ):
            for kind, param in params.items():
                param.weight_loader = loader
                setattr(self, f"{prefix}_{kind}", param)

    def unquantize(self) -> None:
        """The checkpoint ships the routed experts unquantized (modules_to_not_convert): plain w13 / w2 in
        the model dtype replace the int4 storage before they load."""
        if self.int4 is None:
            return
        hidden, device = self.w2_qweight.shape[1], self.w2_qweight.device
        for prefix in ("w13", "w2"):
            for kind in ("qweight", "scales", "qzeros", "g_idx"):
                if hasattr(self, f"{prefix}_{kind}"):
                    delattr(self, f"{prefix}_{kind}")
        self.int4 = self.quant = None
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * self.inter, hidden, dtype=self.dtype, device=device),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden, self.inter, dtype=self.dtype, device=device),
                               requires_grad=False)
        self.w13.weight_loader, self.w2.weight_loader = self._load_w13, self._load_w2

    def _int4_kind(self, param: nn.Parameter, prefix: str) -> str | None:
        if self.int4 is None:
            return None
        kinds = ("qweight", "scales", "qzeros", "g_idx")
        return next((k for k in kinds if param is getattr(self, f"{prefix}_{k}", None)), None)

    def _local(self, expert: int) -> int | None:
        """The local index of global expert `expert`, None when another rank holds it."""
        local = expert - self.expert_start
        return local if 0 <= local < self.num_local else None

    def _inter_shard(self, block: int | None) -> tuple[int, int]:
        """(start, size) of this rank's share of I in a checkpoint tensor: in elements, or in scale
        blocks of `block` (the shard must start on a block boundary)."""
        start, size = self.inter_rank * self.inter, self.inter
        if block is None:
            return start, size
        return expert_shard_blocks(start, size, block)

    def _inter_extent(self, block: int | None) -> int:
        """The whole I of a checkpoint expert tensor, in elements or in scale blocks of `block`."""
        full = self.inter * self.inter_ranks
        return full if block is None else fp8_ref.cdiv(full, block)

    def _load_w13(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int] | None = None) -> None:
        # shard_id (expert, 0 for w1 / 1 for w3) with loaded [I, E] (or its block scales); None:
        # transformers' fused [X, 2I, E]
        is_scale = param is self.w13_scale_inv
        kind = self._int4_kind(param, "w13")
        if kind is not None:
            self._load_int4_w13(param, loaded, kind, shard_id)
            return
        if shard_id is None:
            if is_scale:
                raise ValueError("FP8 scales of transformers' fused expert layout are not supported; "
                                 "expected per-expert gate_proj/up_proj/down_proj tensors")
            n, r = self.inter, self.inter_rank
            check_extent(loaded, 0, self.num_experts)
            check_extent(loaded, 1, 2 * n * self.inter_ranks)
            loaded = loaded.narrow(0, self.expert_start, self.num_local)  # this rank's experts (all without EP)
            for member in (0, 1):
                part = loaded.narrow(1, member * n * self.inter_ranks + r * n, n)
                default_weight_loader(param.data.narrow(1, member * n, n), part)
            return
        expert, member = shard_id
        local = self._local(expert)
        if local is None:  # another rank's expert is never read
            return
        start, size = self._inter_shard(self.block[0] if is_scale else None)
        check_extent(loaded, 0, self._inter_extent(self.block[0] if is_scale else None))
        default_weight_loader(param.data[local].narrow(0, member * size, size), loaded.narrow(0, start, size))

    def _load_w2(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        # shard_id: expert with loaded [E, I] (or its block scales); None: transformers' fused [X, E, I]
        is_scale = param is self.w2_scale_inv
        kind = self._int4_kind(param, "w2")
        if kind is not None:
            self._load_int4_w2(param, loaded, kind, shard_id)
            return
        if shard_id is None:
            if is_scale:
                raise ValueError("FP8 scales of transformers' fused expert layout are not supported; "
                                 "expected per-expert gate_proj/up_proj/down_proj tensors")
            check_extent(loaded, 0, self.num_experts)
            check_extent(loaded, 2, self.inter * self.inter_ranks)
            loaded = loaded.narrow(0, self.expert_start, self.num_local)
            default_weight_loader(param, loaded.narrow(2, self.inter_rank * self.inter, self.inter))
            return
        local = self._local(shard_id)
        if local is not None:
            start, size = self._inter_shard(self.block[1] if is_scale else None)
            check_extent(loaded, 1, self._inter_extent(self.block[1] if is_scale else None))
            default_weight_loader(param.data[local], loaded.narrow(1, start, size))

    def _load_int4_w13(self, param: nn.Parameter, loaded: torch.Tensor, kind: str,
                       shard_id: tuple[int, int] | None) -> None:
        from deepserve.loader.int4 import checkpoint_slice

        if shard_id is None:
            raise ValueError(f"{self.int4.method} experts load per expert (experts.<e>.gate_proj.qweight ...)")
        expert, member = shard_id
        local = self._local(expert)
        if local is None:  # another rank's expert is never read
            return
        start, size = self.inter_rank * self.inter, self.inter
        full = (self._inter_extent(None), self.hidden)
        ours = checkpoint_slice(kind, loaded, self.int4, rows=(start, size), full=full)
        target = param.data[local] if kind == "g_idx" else param.data[local].narrow(0, member * size, size)
        default_weight_loader(target, ours)

    def _load_int4_w2(self, param: nn.Parameter, loaded: torch.Tensor, kind: str, shard_id: int | None) -> None:
        from deepserve.loader.int4 import checkpoint_slice

        if shard_id is None:
            raise ValueError(f"{self.int4.method} experts load per expert (experts.<e>.down_proj.qweight ...)")
        local = self._local(shard_id)
        if local is not None:
            cols = (self.inter_rank * self.inter, self.inter)
            full = (self.hidden, self._inter_extent(None))
            default_weight_loader(param.data[local], checkpoint_slice(kind, loaded, self.int4, cols=cols,
                                                                      whole_groups=not self.w2_all_groups, full=full))

    def quantize_loaded_weights(self) -> None:
        """`--quantization fp8` on an unquantized checkpoint: each expert's w1, w3 and w2 into 128 x 128
        FP8 blocks (the fused kernel's format); nothing for other configs."""
        if not isinstance(self.quant, Fp8Config) or not self.quant.quantize_at_load or self.w13_scale_inv is not None:
            return
        block = PER_CHANNEL_EXPERT_BLOCK
        w13, scale13, w2, scale2 = [], [], [], []
        for e in range(self.num_local):
            members = [fp8_ref.quantize_weight_block(m, block) for m in self.w13.data[e].split(self.inter)]
            w13.append(torch.cat([q for q, _ in members]))
            scale13.append(torch.cat([s for _, s in members]))
            q, s = fp8_ref.quantize_weight_block(self.w2.data[e], block)
            w2.append(q)
            scale2.append(s)
        self.block = block
        self.w13 = nn.Parameter(torch.stack(w13), requires_grad=False)
        self.w2 = nn.Parameter(torch.stack(w2), requires_grad=False)
        self.w13_scale_inv = nn.Parameter(torch.stack(scale13), requires_grad=False)
        self.w2_scale_inv = nn.Parameter(torch.stack(scale2), requires_grad=False)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert e (the global id without expert parallelism)."""
        if self.int4 is not None:
            return self._expert_int4(e, x)
        if self.w13_scale_inv is not None:
            return self._expert_fp8(e, x)
        h = F.silu(F.linear(x, self.w13[e, : self.inter])) * F.linear(x, self.w13[e, self.inter :])  # [n, I]
        return F.linear(h, self.w2[e])  # [n, E]

    def _expert_fp8(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e in FP8 as the fused kernel computes it: activations quantized per token and group,
        the weights dequantized per call, silu(gate) * up rounded to x's dtype before its quantization."""
        block, rows = self.block, self.w13_scale_inv.shape[1] // 2
        scale13 = self.w13_scale_inv[e]
        x32 = x.float()  # gate and up stay float32 until silu(gate) * up, as in the kernel's epilogue
        gate = fp8_ref.block_fp8_linear_ref(x32, self.w13[e, : self.inter], scale13[:rows], block)
        up = fp8_ref.block_fp8_linear_ref(x32, self.w13[e, self.inter :], scale13[rows:], block)
        h = (F.silu(gate) * up).to(x.dtype)  # [n, I]
        return fp8_ref.block_fp8_linear_ref(h, self.w2[e], self.w2_scale_inv[e], block)  # [n, E]

    def int4_weights(self, prefix: str, e: int) -> tuple[torch.Tensor, ...]:
        """Expert e's (qweight, scales, qzeros, g_idx or None) of w13 or w2."""
        return tuple(getattr(self, f"{prefix}_{k}")[e] if getattr(self, f"{prefix}_{k}", None) is not None else None
                     for k in ("qweight", "scales", "qzeros", "g_idx"))

    def _expert_int4(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e with int4 weights (W4A16): each weight dequantized and rounded to x's dtype, as the
        model on the dequantized weights computes it."""
        qw, scales, zeros, g_idx = self.int4_weights("w13", e)
        bits = self.int4.bits
        gate_up = int4_linear(x, qw, scales, zeros, bits, self.group13, g_idx)  # [n, 2I]
        h = F.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter :]  # [n, I]
        return int4_linear(h, *self.int4_weights("w2", e)[:3], bits, self.group2, self.int4_weights("w2", e)[3])

    def absorb_shared(self, mlp: MLP, count: int) -> str | None:
        """Append the shared experts' MLP as `count` more experts, ids X .. X + count - 1 (after loading, before
        any re-layout or quantization at load). An MLP of intermediate size count x I is the sum of `count`
        MLPs of size I: chunk j is gate and up rows [jI, (j+1)I) and down columns [jI, (j+1)I) (this rank's
        I under tensor parallelism: any split of the intermediate units sums to the same output). Returns None
        once absorbed, else why it cannot be (nothing changed): another storage, group or block layout."""
        chunks = _shared_chunks(self, mlp, count)
        if isinstance(chunks, str):
            return chunks
        for name, extra in chunks.items():
            old = getattr(self, name)
            if extra.shape[1:] != old.shape[1:] or extra.dtype != old.dtype:
                return (f"the shared experts' {name} chunks are {tuple(extra.shape[1:])} {extra.dtype}, the routed "
                        f"experts' {tuple(old.shape[1:])} {old.dtype}")
        for name, extra in chunks.items():
            old = getattr(self, name)
            setattr(self, name, parameter_like(torch.cat([old.data, extra.to(old.device)]), old))
            # The replaced tensor's memory back to the driver before the next tensor is carved out of it:
            # w2's new tensor fits inside w13's old one, and on a V3 FP8 slice the pieces left over
            # (3.7 GB a layer, 17 GiB in all) were reserved, unusable for the KV cache and unseen by its
            # sizing, whose allocation then ran out of memory (bench/RESULTS.md, 2026-12-05 second session).
            del old
            if getattr(self, name).is_cuda:
                torch.cuda.empty_cache()
        self.num_local += count
        self.num_shared_fused = count
        return None

    def local_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global expert ids [T, K] -> (local ids [T, K], mine [T, K] bool); local ids of others' are garbage."""
        local = ids - self.expert_start
        return local, (local >= 0) & (local < self.num_local)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The sum over all ranks of `partial`."""
        return tp_all_reduce(self.partial(x, weights, ids))

    def partial(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum, not all-reduced: on CUDA with Triton the fused kernel (no host sync:
        CUDA-graph safe), elsewhere `partial_batched`."""
        fused = _fused_moe_kernel() if x.is_cuda else None
        if fused is not None:
            return self.forward_fused(fused, x, weights, ids)
        return self.partial_batched(x, weights, ids)

    def forward_fused(self, fused: Callable[..., torch.Tensor], x: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum (not all-reduced) through `fused` (kernels.fused_moe's signature)."""
        # w13 [X, 2I, E] (w1 rows, then w3) and w2 [X, E, I]: the kernel's layout (int4: their codes)
        w13, w2, scales = self._fused_operands()
        if not self.expert_parallel:
            return fused(x, w13, w2, weights, ids, **scales)
        # Other ranks' assignments get the id num_local, which the kernel skips: no host sync (CUDA
        # graphs, and eager ranks queue ahead of the GPU) and no expert computes them.
        local, mine = self.local_ids(ids)
        return fused(x, w13, w2, weights, torch.where(mine, local, self.num_local), skips=True, **scales)

    def _fused_operands(self) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(w13, w2, keyword arguments) for kernels.fused_moe.fused_moe."""
        if self.int4 is not None:
            from deepserve.kernels.fused_moe import Int4Experts

            int4 = Int4Experts(self.int4.bits, self.w13_scales, self.w13_qzeros, self.w2_scales, self.w2_qzeros,
                               self.group13, self.group2, getattr(self, "w13_g_idx", None),
                               getattr(self, "w2_g_idx", None))
            return self.w13_qweight, self.w2_qweight, dict(int4=int4)
        scales = {} if self.w13_scale_inv is None else dict(
            w13_scale=self.w13_scale_inv, w2_scale=self.w2_scale_inv, block=self.block)
        return self.w13, self.w2, scales

    def forward_batched(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Tokens grouped by expert: one sort, then one matmul pair per expert that has tokens."""
        return tp_all_reduce(self.partial_batched(x, weights, ids))

    def partial_batched(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`forward_batched` before the all-reduce: this rank's partial sum."""
        num_tokens, k = ids.shape
        local, mine = self.local_ids(ids)
        # Others' assignments get the id num_local: they sort last and the loop stops before them.
        flat = torch.where(mine, local, self.num_local).flatten()  # [T*K]
        order = flat.argsort(stable=True)  # [T*K]: assignments sorted by expert id
        tokens = order // k  # [T*K]: the token of each sorted assignment
        sorted_weights = weights.flatten()[order]  # [T*K]
        # the loop needs sizes on the host
        counts = torch.bincount(flat, minlength=self.num_local + 1)[: self.num_local].tolist()
        out = torch.zeros(num_tokens, x.shape[-1], dtype=torch.float32, device=x.device)  # [T, E]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start : start + n]  # [n]
            y = self.expert(e, x[rows]).float() * sorted_weights[start : start + n, None]  # [n, E]
            out.index_add_(0, rows, y)
            start += n
        return out.to(x.dtype)

    def forward_reference(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Token by token, expert by expert: what `forward` must equal."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, E]
        for t in range(ids.shape[0]):
            for j in range(ids.shape[1]):
                local = self._local(int(ids[t, j]))
                if local is not None:  # another rank's expert: its rank adds it
                    out[t] += weights[t, j] * self.expert(local, x[t : t + 1])[0].float()
        return tp_all_reduce(out.to(x.dtype))


def _shared_chunks(experts: RoutedExperts, mlp: MLP, count: int) -> dict[str, torch.Tensor] | str:
    """RoutedExperts.absorb_shared's chunks: for each expert parameter the shared MLP's `count` chunks stacked,
    [count, ...], or why the MLP cannot be cut so."""
    c, up, down = experts.inter, mlp.w13, mlp.w2
    if up.member_rows != [count * c] * 2:
        return (f"the shared experts' intermediate size on this rank ({up.member_rows[0]}) is not "
                f"n_shared_experts ({count}) x the routed experts' ({c})")
    # expert parameter -> (the MLP's tensor, "rows" of w13 / "cols" of w2, checkpoint units a tensor index holds)
    if experts.int4 is not None:
        if up.int4 is None or down.int4 is None or up.int4_tiled or down.int4_tiled:
            return "the shared experts are not in the routed experts' int4 storage"
        if up.g_idx is not None or down.g_idx is not None or getattr(experts, "w13_g_idx", None) is not None:
            return "act order (g_idx)"
        if (up.int4_group, down.int4_group) != (experts.group13, experts.group2) or down.int4_all_groups \
                or experts.w2_all_groups:
            return "the shared and routed experts' int4 groups differ"
        pack = 32 // experts.int4.bits
        parts = {"w13_qweight": (up.qweight, "rows", 1), "w13_scales": (up.scales, "rows", 1),
                 "w13_qzeros": (up.qzeros, "rows", 1), "w2_qweight": (down.qweight, "cols", pack),
                 "w2_scales": (down.scales, "cols", experts.group2), "w2_qzeros": (down.qzeros, "cols", experts.group2)}
    else:
        if up.weight is None or down.weight is None or up.weight_scale is not None or down.weight_scale is not None:
            return "the shared experts are not in the routed experts' storage"
        parts = {"w13": (up.weight, "rows", 1), "w2": (down.weight, "cols", 1)}
        if experts.w13_scale_inv is not None:
            if up.weight_scale_inv is None or down.weight_scale_inv is None or up.block != experts.block \
                    or down.block != experts.block:
                return "the shared experts' FP8 blocks differ from the routed experts'"
            bn, bk = experts.block
            parts |= {"w13_scale_inv": (up.weight_scale_inv, "rows", bn), "w2_scale_inv": (down.weight_scale_inv,
                                                                                          "cols", bk)}
        elif up.weight_scale_inv is not None or down.weight_scale_inv is not None:
            return "the shared experts are FP8, the routed experts are not"
    out = {}
    for name, (tensor, axis, unit) in parts.items():
        # One shared expert is the whole MLP, whatever its blocks; several must be cut on block / group boundaries.
        if count > 1 and c % unit:
            return f"the routed experts' intermediate size on this rank ({c}) is not a multiple of {unit} ({name})"
        n, up_start = -(-c // unit), -(-count * c // unit)  # a chunk's units; the up member's first unit
        if axis == "rows":  # gate rows of chunk j, then its up rows
            pieces = [torch.cat([tensor.narrow(0, j * n, n), tensor.narrow(0, up_start + j * n, n)])
                      for j in range(count)]
        else:
            pieces = [tensor.narrow(1, j * n, n) for j in range(count)]
        out[name] = torch.stack(pieces)
    return out


@functools.cache
def _fused_moe_kernel() -> Callable[..., torch.Tensor] | None:
    """kernels.fused_moe.fused_moe, or None where Triton is not installed (looked up once)."""
    try:
        from deepserve.kernels.fused_moe import fused_moe
    except ImportError:
        return None
    return fused_moe


def _router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x.float(), weight); on CUDA at decode sizes in one launch (kernels.moe_routing.router_logits)."""
    gemv = _router_gemv() if x.is_cuda and x.dim() == 2 and x.stride(1) == 1 else None
    if gemv is not None:
        kernel, max_tokens = gemv
        if x.shape[0] <= max_tokens:
            return kernel(x, weight)
    return F.linear(x.float(), weight)


@functools.cache
def _router_gemv() -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], int] | None:
    """(kernels.moe_routing.router_logits, the most tokens it takes), or None where Triton is not installed or
    DEEPSERVE_FUSED_ROUTING=0 (looked up once)."""
    if not envs.DEEPSERVE_FUSED_ROUTING:
        return None
    try:
        from deepserve.kernels.moe_routing import ROUTER_GEMV_MAX_TOKENS, router_logits
    except ImportError:
        return None
    return router_logits, ROUTER_GEMV_MAX_TOKENS


@functools.cache
def _fused_router(cfg: RoutingConfig, shared: int = 0) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """kernels.moe_routing.fused_route (`route`'s signature), or None where Triton is not installed,
    the config (with `shared` fused shared experts) is past the kernel's limits, or DEEPSERVE_FUSED_ROUTING=0
    (looked up once per config)."""
    if not envs.DEEPSERVE_FUSED_ROUTING:
        return None
    try:
        from deepserve.kernels.moe_routing import fits, fused_route
    except ImportError:
        return None
    return fused_route if fits(cfg, shared) else None


class DeepseekMoE(nn.Module):
    """Router, routed experts and shared experts of one layer.

    Shared experts fused (DEEPSERVE_SHARED_EXPERTS_FUSION, off by default: W1 -2 % where timed): after loading, the
    shared MLP becomes n_shared_experts more routed experts (RoutedExperts.absorb_shared) that every token picks
    with weight 1, so the fused MoE computes them in its own launches: at one token the shared MLP's GEMVs, its
    SiLU and the add (four launches a layer) go. Not under expert parallelism (the shared experts are split by
    tensor parallelism there, the routed ones are not); where the storage does not allow it (act order,
    differing groups or blocks) the layer keeps its MLP and says why in the log."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_shared: int, cfg: RoutingConfig,
                 quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.gate = MoEGate(hidden_size, cfg)  # the router stays float32 whatever the checkpoint
        self.experts = RoutedExperts(cfg.num_experts, hidden_size, intermediate_size, cfg.expert_parallel,
                                     quant=quant)
        # Unreduced: the routed and shared partial sums are added first and all-reduced once.
        self.shared_experts = (MLP(hidden_size, intermediate_size * num_shared, reduce_results=False, quant=quant)
                               if num_shared else None)
        self.num_shared = num_shared
        self.fuse_shared = bool(num_shared) and envs.DEEPSERVE_SHARED_EXPERTS_FUSION

    def fuse_loaded_weights(self) -> None:
        """After loading (layers/quantization.quantize_after_loading, before the re-layouts and quantization at
        load of this module's children): the shared experts into the routed ones, when fuse_shared. Tried once:
        a refusal is said once a process and not retried (a later pass would see re-laid-out weights)."""
        if not self.fuse_shared or self.shared_experts is None:
            return
        self.fuse_shared = False
        if self.experts.expert_parallel:
            warn_once("DEEPSERVE_SHARED_EXPERTS_FUSION: the shared experts stay an MLP under expert parallelism "
                      "(they are split by tensor parallelism there, the routed experts are not)")
            return
        why = self.experts.absorb_shared(self.shared_experts, self.num_shared)
        if why is not None:
            warn_once(f"DEEPSERVE_SHARED_EXPERTS_FUSION: the shared experts stay an MLP: {why}")
            return
        self.shared_experts = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, self.experts.num_shared_fused)  # [T, K (+ fused shared experts)] each
        out = self.experts.partial(x, weights, ids)  # [T, E]: this rank's part
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return tp_all_reduce(out)  # one all-reduce per MoE layer under tensor parallelism
