"""Tensor-parallel linear layers. Each owns its shard and its one collective (DESIGN.md principle 7).

Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that copies its slice
of a full checkpoint tensor, so the checkpoint loader never needs to know about parallelism. The
tensor may be a `loader.checkpoint.LazyTensor`: the loaders only `narrow` / slice it before the copy,
so a rank reads just its slice from the file; a real tensor works the same.
Weights are stored as [out_features, in_features], like nn.Linear and the checkpoints.

FP8 (layers/quantization.py): with a block-scaled config the weight is float8_e4m3fn and a float32
`weight_scale_inv` [ceil(out/bn), ceil(in/bk)] sits beside it, sharded in whole blocks (a shard boundary
inside a block is refused); a merged projection keeps each member's scale rows apart, so members that are
not whole blocks still load as shipped (and then multiply one member at a time). With a per-channel
config the weight loads in the model dtype and `quantize_loaded_weights` turns it into fp8 plus
`weight_scale` [out]. The matmul is the Triton/`_scaled_mm` kernel on CUDA, the torch reference elsewhere.

Int4 (W4A16, AWQ / GPTQ checkpoints): `qweight`, `scales`, `qzeros` (and `g_idx` under act order) in
layers/int4.py's layout instead of `weight`; rows are output features as for `weight`, so column
parallelism and merged members slice rows the same way; row parallelism slices the inputs in whole
groups (every group stays on every rank where a group spans the shards).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepserve.distributed.parallel_state import get_tp_rank, get_tp_world_size, tp_all_reduce
from deepserve.kernels import fp8_ref, int4_ref
from deepserve.layers.int4 import int4_linear, int4_parameters, keeps_all_groups, tiled_for_mma_gemv
from deepserve.layers.quantization import Fp8Config, Int4Config, QuantConfig


def _divide(n: int, world: int, what: str) -> int:
    if n % world:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({world})")
    return n // world



def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def check_extent(loaded: torch.Tensor, dim: int, expected: int) -> None:
    """A checkpoint tensor spans the whole dimension a rank's shard is cut from: narrowing a larger one
    would load a part of it without a word (a config.json or --hf-overrides that does not match the weights)."""
    if loaded.shape[dim] != expected:
        raise ValueError(f"shape {tuple(loaded.shape)}, but the config gives {expected} along dimension {dim}: "
                         "config.json (or --hf-overrides) does not match the weights")


def _whole_blocks(start: int, size: int, block: int, what: str) -> tuple[int, int]:
    """A shard [start, start + size) of rows or columns in scale-block units; the shard must begin on a
    block boundary (its end may be the tensor's partial last block)."""
    if start % block:
        raise ValueError(f"{what}: a tensor-parallel shard starting at {start} cuts an FP8 block of {block}; "
                         "choose a tensor_parallel_size that splits it into multiples of the block")
    return start // block, fp8_ref.cdiv(size, block)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N]: the Triton kernel on CUDA, the reference (dequantizing per call) elsewhere."""
    if x.is_cuda:
        from deepserve.kernels.fp8 import block_fp8_linear

        return block_fp8_linear(x, weight, scale_inv, block, bias)
    return fp8_ref.block_fp8_linear_ref(x, weight, scale_inv, block, bias)


def fp8_channel_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.is_cuda:
        from deepserve.kernels.fp8 import channel_fp8_linear

        return channel_fp8_linear(x, weight, scale, bias)
    return fp8_ref.channel_fp8_linear_ref(x, weight, scale, bias)


def parameter_like(data: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    """A new parameter holding `data` (made after loading, e.g. by a fusion) with the attributes the loader and
    the planner read on the one it replaces: its weight_loader and an int4 tensor's quant_bits."""
    param = nn.Parameter(data, requires_grad=False)
    for attribute in ("weight_loader", "quant_bits"):
        if hasattr(like, attribute):
            setattr(param, attribute, getattr(like, attribute))
    return param


def _no_loading_after_tiling(param: nn.Parameter, loaded: torch.Tensor, *args, **kwargs) -> None:
    # a checkpoint tensor has the row layout: copied into a tiled parameter it would give wrong products
    raise RuntimeError("this int4 layer took the tensor-core GEMV's tiled layout after loading "
                       "(DEEPSERVE_INT4_TILED); its weights cannot be loaded again: build the model anew, or set "
                       "DEEPSERVE_INT4_TILED=0")


class LinearBase(nn.Module):
    """The weight (and its FP8 scales) of one linear layer and the matmul that reads them.

    Subclasses say how a checkpoint tensor maps onto this rank's rows (`_copy_rows`) or columns."""

    INT4_PARAMS = ("qweight", "scales", "qzeros", "g_idx")

    def __init__(self, in_features: int, out_features: int, bias: bool, quant: QuantConfig | None,
                 member_rows: list[int] | None = None, in_shards: int = 1) -> None:
        super().__init__()
        self.quant = quant
        self.int4 = quant if isinstance(quant, Int4Config) else None
        self.block = quant.weight_block if isinstance(quant, Fp8Config) else None
        self.dtype = torch.get_default_dtype()  # the model dtype, for unquantize
        # Output rows per member of a merged projection (one member otherwise), for the scale layout.
        self.member_rows = member_rows or [out_features]
        self.weight = self.qweight = self.scales = self.qzeros = self.g_idx = None
        self.int4_tiled = False  # qweight / scales in the mma GEMV's tiled layout, qzeros None: quantize_loaded_weights
        if self.int4 is not None:
            self._make_int4(in_features, out_features, in_shards)
        else:
            dtype = fp8_ref.FP8 if self.block else None
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
            self.weight.weight_loader = self.weight_loader
        self.weight_scale_inv = None  # block-scaled FP8
        self.weight_scale = None  # per-channel FP8, made by quantize_loaded_weights
        # Members that are not whole blocks share no scale row: they multiply one at a time.
        self.split_members = bool(self.block) and len(self.member_rows) > 1 and any(
            n % self.block[0] for n in self.member_rows)
        if self.block:
            bn, bk = self.block
            rows = sum(fp8_ref.cdiv(n, bn) for n in self.member_rows)
            scale = torch.empty(rows, fp8_ref.cdiv(in_features, bk), dtype=torch.float32)
            self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
            self.weight_scale_inv.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def _make_int4(self, in_features: int, out_features: int, in_shards: int) -> None:
        full_in = self.int4_full_in = in_features * in_shards
        # All groups on every rank where a group spans the shards; else this rank's whole groups.
        self.int4_all_groups = keeps_all_groups(self.int4, full_in, in_shards)
        self.int4_group = self.int4.group_for(full_in)
        groups = self.int4.num_groups(full_in) if self.int4_all_groups else fp8_ref.cdiv(in_features, self.int4_group)
        self._g_idx_members: set[int] = set()
        for name, param in int4_parameters(self.int4, (), out_features, in_features, groups).items():
            param.weight_loader = self.weight_loader
            setattr(self, name, param)

    def _is_int4(self, param: nn.Parameter) -> bool:
        return self.int4 is not None and any(param is getattr(self, n) for n in self.INT4_PARAMS)

    def _load_int4(self, param: nn.Parameter, loaded: torch.Tensor, rows: tuple[int, int] | None = None,
                   cols: tuple[int, int] | None = None, member: int = 0, full_rows: int | None = None) -> None:
        """A checkpoint int4 tensor's output rows `rows` x inputs `cols` into `member`'s rows (layers/int4.py);
        the tensor packs a [full_rows (default: this layer's rows), whole input] weight."""
        from deepserve.loader.int4 import checkpoint_slice

        kind = next(n for n in self.INT4_PARAMS if param is getattr(self, n))
        full = (full_rows or sum(self.member_rows), self.int4_full_in)
        ours = checkpoint_slice(kind, loaded, self.int4, rows, cols, whole_groups=not self.int4_all_groups, full=full)
        if kind == "g_idx":  # one per input, shared by the members: they must agree
            if self._g_idx_members and not torch.equal(param.data.cpu(), ours):
                raise ValueError(f"{type(self).__name__}: the merged projections' g_idx differ (act order); "
                                 "this layout needs one input order per merged layer")
            self._g_idx_members.add(member)
            default_weight_loader(param, ours)
            return
        dst = sum(self.member_rows[:member])
        default_weight_loader(param.data.narrow(0, dst, ours.shape[0]), ours)

    def unquantize(self) -> None:
        """The checkpoint ships this module unquantized (modules_to_not_convert): a plain weight in the model
        dtype replaces the int4 storage before it loads."""
        if self.int4 is None:
            return
        out_features, in_features = self.qweight.shape[0], self.qweight.shape[1] * int4_ref.pack_factor(self.int4.bits)
        device = self.qweight.device
        for name in self.INT4_PARAMS:
            setattr(self, name, None)
        self.int4 = self.quant = None
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=self.dtype, device=device),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.int4 is not None:
            return int4_linear(x, self.qweight, self.scales, self.qzeros, self.int4.bits, self.int4_group,
                               self.g_idx, bias, self.int4_tiled)
        if self.weight_scale_inv is not None:
            if not self.split_members:
                return fp8_block_linear(x, self.weight, self.weight_scale_inv, self.block, bias)
            return self._per_member(x, bias)
        if self.weight_scale is not None:
            return fp8_channel_linear(x, self.weight, self.weight_scale, bias)
        return F.linear(x, self.weight, bias)

    def _per_member(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        outs, row, scale_row = [], 0, 0
        for n in self.member_rows:
            rows = fp8_ref.cdiv(n, self.block[0])
            b = bias[row : row + n] if bias is not None else None
            scale = self.weight_scale_inv[scale_row : scale_row + rows]
            outs.append(fp8_block_linear(x, self.weight[row : row + n], scale, self.block, b))
            row, scale_row = row + n, scale_row + rows
        return torch.cat(outs, dim=-1)

    def quantize_loaded_weights(self) -> None:
        """After loading (quantize_after_loading): per-channel FP8, or int4 weights into the tiled layout of the
        tensor-core GEMV where it applies (layers/int4.tiled_for_mma_gemv); nothing for other configs."""
        if self.int4 is not None and not self.int4_tiled:
            tiled = tiled_for_mma_gemv(self.qweight.data, self.scales.data, self.qzeros.data, self.int4.bits,
                                       self.int4_group, self.g_idx, self.dtype)
            if tiled is not None:
                self.qweight = nn.Parameter(tiled[0], requires_grad=False)
                self.scales = nn.Parameter(tiled[1], requires_grad=False)
                self.qweight.weight_loader = self.scales.weight_loader = _no_loading_after_tiling
                self.qzeros, self.int4_tiled = None, True
            return
        if not isinstance(self.quant, Fp8Config) or not self.quant.quantize_at_load or self.weight_scale is not None:
            return
        w_q, scale = fp8_ref.quantize_weight_per_channel(self.weight.data)
        self.weight = nn.Parameter(w_q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)

    def _is_scale(self, param: nn.Parameter) -> bool:
        return param is self.weight_scale_inv

    def _copy_rows(self, param: nn.Parameter, loaded: torch.Tensor, src: int, size: int, member: int = 0,
                   shards: int = 1) -> None:
        """Copy rows [src, src + size) of a checkpoint tensor (weight, bias or block scale) into `member`'s
        rows of `param` (a scale's rows in block units); the tensor holds `shards` such shares."""
        if self._is_int4(param):
            self._load_int4(param, loaded, rows=(src, size), member=member, full_rows=size * shards)
            return
        dst, full = sum(self.member_rows[:member]), size * shards
        if self._is_scale(param):
            bn = self.block[0]
            dst, full = sum(fp8_ref.cdiv(n, bn) for n in self.member_rows[:member]), fp8_ref.cdiv(full, bn)
            src, size = _whole_blocks(src, size, bn, f"{type(self).__name__} output rows")
        check_extent(loaded, 0, full)
        default_weight_loader(param.data.narrow(0, dst, size), loaded.narrow(0, src, size))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, quant: QuantConfig | None = None
                 ) -> None:
        super().__init__(in_features, out_features, bias, quant)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if self._is_int4(param):
            self._load_int4(param, loaded)
            return
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Splits the output features across ranks; the output stays sharded (no collective)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quant: QuantConfig | None = None,
                 member_sizes: list[int] | None = None) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.out_per_rank = _divide(out_features, self.tp_size, "output features")
        per_rank = [_divide(n, self.tp_size, "output features") for n in member_sizes] if member_sizes else None
        super().__init__(in_features, self.out_per_rank, bias, quant, per_rank)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        self._copy_rows(param, loaded, self.tp_rank * self.out_per_rank, self.out_per_rank, shards=self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (gate_up_proj).

    Each rank holds its slice of every member, members side by side."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 quant: QuantConfig | None = None) -> None:
        super().__init__(in_features, sum(output_sizes), bias, quant, member_sizes=output_sizes)
        self.member_sizes = self.member_rows

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            raise ValueError("a merged projection loads one member at a time (shard_id)")
        self._load_member(param, loaded, shard_id, self.tp_rank, self.tp_size)

    def _load_member(self, param: nn.Parameter, loaded: torch.Tensor, member: int, rank: int, shards: int) -> None:
        size = self.member_sizes[member]
        self._copy_rows(param, loaded, rank * size, size, member, shards)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections in one matmul; heads are split across ranks (kv heads replicated
    when there are fewer kv heads than ranks)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 quant: QuantConfig | None = None) -> None:
        tp = get_tp_world_size()
        self.num_kv_heads_per_rank = max(1, num_kv_heads // tp)
        kv_total = self.num_kv_heads_per_rank * tp * head_dim
        super().__init__(hidden_size, [num_heads * head_dim, kv_total, kv_total], bias, quant)
        self.kv_replicas = max(1, tp // num_kv_heads)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        index = {"q": 0, "k": 1, "v": 2}[shard_id]
        rank = self.tp_rank if index == 0 else self.tp_rank // self.kv_replicas
        shards = self.tp_size if index == 0 else self.tp_size // self.kv_replicas  # kv heads replicated
        self._load_member(param, loaded, index, rank, shards)


class RowParallelLinear(LinearBase):
    """Splits the input features across ranks and all-reduces the partial outputs. reduce_results=False
    (vLLM's name) returns this rank's partial output instead, for a caller that adds other partial
    sums first and reduces them all at once (bias not allowed then: it must be added once, after)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce_results: bool = True,
                 quant: QuantConfig | None = None) -> None:
        if bias and not reduce_results:
            raise ValueError("a RowParallelLinear with a bias must reduce its results")
        self.reduce_results = reduce_results
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.in_per_rank = _divide(in_features, self.tp_size, "input features")
        super().__init__(self.in_per_rank, out_features, bias, quant, in_shards=self.tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param is self.bias:  # the whole bias on every rank: added once, after the sum
            default_weight_loader(param, loaded)
            return
        start, size = self.tp_rank * self.in_per_rank, self.in_per_rank
        if self._is_int4(param):
            self._load_int4(param, loaded, cols=(start, size))
            return
        full = size * self.tp_size
        if self._is_scale(param):
            full = fp8_ref.cdiv(full, self.block[1])
            start, size = _whole_blocks(start, size, self.block[1], f"{type(self).__name__} input columns")
        check_extent(loaded, 1, full)
        default_weight_loader(param, loaded.narrow(1, start, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, None)
        if not self.reduce_results:
            return out
        out = tp_all_reduce(out)
        # The bias is added once, after the sum, not once per rank.
        return out + self.bias if self.bias is not None else out


def stacked_rows(first: LinearBase, second: LinearBase) -> ReplicatedLinear | str:
    """One linear computing [first(x), second(x)] from the two loaded ones (after loading, before any re-layout
    or quantization at load), its rows the first's then the second's, or why the two cannot be stacked. Both
    must read the whole input x (replicated, or column-parallel at tensor parallelism 1: the caller says) and
    hold the same storage: bf16, FP8 blocks (the first's rows whole blocks, so the scale rows stack too), or
    int4 words, scales and zeros of the same groups (no act order)."""
    why = _stack_problem(first, second)
    if why is not None:
        return why
    names = LinearBase.INT4_PARAMS[:3] if first.int4 is not None else ("weight", "weight_scale_inv")
    rows = [getattr(m, names[0]).shape[0] for m in (first, second)]
    in_features = first.int4_full_in if first.int4 is not None else first.weight.shape[1]
    with torch.device("meta"):
        merged = ReplicatedLinear(in_features, sum(rows), first.bias is not None, first.quant)
    merged.dtype = first.dtype
    for name in (*names, "bias"):
        a, b = getattr(first, name), getattr(second, name)
        setattr(merged, name, None if a is None else parameter_like(torch.cat([a.data, b.data]), a))
    return merged


def _stack_problem(first: LinearBase, second: LinearBase) -> str | None:
    if type(first.quant) is not type(second.quant) or first.block != second.block or (first.int4 is None) != (
            second.int4 is None) or (first.bias is None) != (second.bias is None):
        return "the two projections are stored differently"
    if first.weight_scale is not None or second.weight_scale is not None:
        return "the projections are already quantized per channel"
    if first.int4 is not None:
        if first.int4_tiled or second.int4_tiled or first.g_idx is not None or second.g_idx is not None:
            return "act order (g_idx)"
        if (first.int4_group, first.int4.bits, first.int4_full_in) != (second.int4_group, second.int4.bits,
                                                                          second.int4_full_in):
            return "the two projections' int4 groups differ"
        return None
    if first.weight.shape[1] != second.weight.shape[1] or first.weight.dtype != second.weight.dtype:
        return "the two projections' inputs or dtypes differ"
    if first.block and (first.split_members or second.split_members or first.weight.shape[0] % first.block[0]):
        return f"the first projection's rows are not whole FP8 blocks of {first.block[0]}"
    return None
