"""Fused mixture-of-experts: routed SwiGLU experts as two Triton grouped GEMMs over expert-sorted tokens.

Weights (the layout layers/moe.py RoutedExperts loads): w13 [E, 2I, H], per expert the I gate (w1) rows
then the I up (w3) rows; w2 [E, H, I]. Every expert's last dimension is contiguous.

    out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(w1[e] @ x[t]) * (w3[e] @ x[t])),  e = topk_ids[t, k]

1. `moe_align` sorts the T*K (token, slot) assignments by expert and pads each expert's run to a multiple
   of block_m with the sentinel T*K, so every block of block_m sorted assignments belongs to one expert.
   Assignment a is token a // K, slot a % K. Output sizes are worst cases known from shapes alone, and the
   padded total stays on the device: no host sync, so the whole call can be captured in a CUDA graph.
2. Gate-up GEMM, one program per (block, tile of I): gathers the block's x rows, multiplies by the gate and
   the up tile of the block's expert (two accumulators over one x tile), writes silu(gate) * up to
   act [T*K, I] at the assignment's row.
3. Down GEMM, one program per (block, tile of H): act rows times w2[e], times the routing weight, written
   to y [T*K, H] at the assignment's row.
4. out = y.view(T, K, H).sum(1): a fixed-order reduction, so the result is deterministic (no atomics).

Expert parallelism: an id equal to E (one past this rank's last expert) marks an assignment to an expert
on another rank. `moe_align` leaves it out, so no GEMM touches it, and its y row stays zero (`skips=True`
zero-fills y). Routing another rank's assignments to a real expert with weight 0 instead would make that
expert compute all of them; selecting only this rank's assignments would need their count on the host.

Every assignment appears exactly once in the sorted order and each program writes all its valid rows, so
act and y are torch.empty (y zeroed with skips): sentinel rows are masked and never stored.

Shapes: T tokens, H hidden size, E experts (this rank's copy), I intermediate size (this rank's share),
K experts per token, N = T*K assignments, P padded assignment count (a multiple of block_m).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepserve import envs

# Triton decides at decoration, when the module is imported; a launch must not reread the environment.
INTERPRET = envs.TRITON_INTERPRET


@dataclass(frozen=True)
class MoEConfig:
    """Tiles of both grouped GEMMs. block_n is the output tile: gate-up programs compute block_n gate and
    block_n up columns (two accumulators), down programs block_n hidden columns."""

    block_m: int  # sorted assignments per program: one expert per block, so the alignment unit too
    block_n: int
    block_k: int
    group_m: int  # consecutive blocks that walk the same weight tiles (L2 reuse when an expert has many)
    num_warps: int
    num_stages: int


def default_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> MoEConfig:
    """Guessed for the H200, to be tuned with bench/check_fused_moe.py.

    What decides the tile is the mean number of assignments per expert, T*K/E: decode (V2-Lite T <= 256:
    <= 24 per expert) is a weight stream, so the smallest tl.dot row tile (16) wastes the least padding
    and many narrow N tiles keep every SM loading; prefill (thousands of tokens: hundreds per expert) is
    compute-bound, so larger M tiles reuse each weight tile over more rows."""
    if dtype == torch.float32:  # tests only: fp32 tiles are twice the bytes
        return MoEConfig(block_m=16, block_n=32, block_k=32, group_m=8, num_warps=4, num_stages=2)
    per_expert = num_tokens * top_k / num_experts
    if per_expert <= 16:
        return MoEConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3)
    if per_expert <= 64:
        return MoEConfig(block_m=32, block_n=64, block_k=64, group_m=4, num_warps=4, num_stages=4)
    if per_expert <= 256:
        return MoEConfig(block_m=64, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4)
    return MoEConfig(block_m=128, block_n=64, block_k=64, group_m=8, num_warps=8, num_stages=3)


def padded_size(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Worst-case P: only experts that get an assignment pad (at most min(E, N) of them, each by at
    most block_m - 1), rounded up to whole blocks so the kernels read sorted ids without a mask."""
    worst = num_assignments + min(num_experts, num_assignments) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] (ids in [0, num_experts], num_experts = skip; unchecked: checking would sync) ->
    sorted_token_ids [P] int32: assignment ids grouped by expert (ascending expert, ascending id inside
        one), each expert's run padded with the sentinel T*K to a multiple of block_m; the tail past the
        real total is sentinel too;
    expert_ids [P / block_m] int32: the expert of each block, -1 for blocks past the real total;
    num_padded [1] int32: the real padded total (a multiple of block_m), on the device.
    Up to ALIGN_KERNEL_MAX assignments (decode) one Triton program does it all: one launch instead of
    about twenty small torch ops, which would cost more than the experts' weight stream at T = 1.
    Skipped assignments (id num_experts) appear nowhere in sorted_token_ids."""
    n = topk_ids.numel()
    size = padded_size(n, num_experts, block_m)
    if n > ALIGN_KERNEL_MAX:
        return _moe_align_torch(topk_ids, num_experts, block_m, size)
    ids = topk_ids.reshape(-1)  # [N], a view when contiguous
    block_n = max(triton.next_power_of_2(n), 16)
    max_size = padded_size(block_n, num_experts, block_m)  # any N of this bucket
    sorted_ids = torch.empty(size, dtype=torch.int32, device=ids.device)
    expert_ids = torch.empty(size // block_m, dtype=torch.int32, device=ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    _moe_align_kernel[(1,)](
        ids, sorted_ids, expert_ids, num_padded, n, size, num_experts,
        BLOCK_N=block_n, BLOCK_E=max(triton.next_power_of_2(num_experts), 16), BLOCK_M=block_m,
        # Loop trip counts are constexpr bounds for any N of this power-of-two bucket, not functions of
        # the runtime size: one compile per bucket (and Triton 3.6's interpreter cannot range over a
        # runtime int, triton-lang/triton#9171).
        SLOT_TILES=triton.cdiv(max_size, block_n), BLOCK_TILES=triton.cdiv(max_size // block_m, block_n),
        num_warps=8 if n > 1024 else 4,
    )
    return sorted_ids, expert_ids, num_padded


ALIGN_KERNEL_MAX = 4096  # one program sorts at most this many assignments in registers


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_assign, size, num_experts,
                      BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                      SLOT_TILES: tl.constexpr, BLOCK_TILES: tl.constexpr):
    # One program; phases that write a slot another thread wrote or reads are separated by barriers
    # (a barrier also orders the block's global memory accesses).
    offs = tl.arange(0, BLOCK_N)
    num_blocks = size // BLOCK_M
    for tile in range(SLOT_TILES):  # SLOT_TILES * BLOCK_N >= size
        tl.store(sorted_ids_ptr + tile * BLOCK_N + offs, num_assign, mask=tile * BLOCK_N + offs < size)
    for tile in range(BLOCK_TILES):  # BLOCK_TILES * BLOCK_N >= num_blocks
        tl.store(expert_ids_ptr + tile * BLOCK_N + offs, -1, mask=tile * BLOCK_N + offs < num_blocks)
    ids = tl.load(ids_ptr + offs, mask=offs < num_assign, other=0).to(tl.int32)  # [BLOCK_N]
    valid = (offs < num_assign) & (ids < num_experts)  # id num_experts: another rank's expert, skipped
    counts = tl.histogram(ids, BLOCK_E, mask=valid)  # [BLOCK_E]
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_start = tl.cumsum(padded, 0) - padded  # [BLOCK_E]
    total = tl.sum(padded, 0)
    tl.store(num_padded_ptr, total)
    tl.debug_barrier()
    # Each expert with assignments marks its first block; a running max then carries the mark over the
    # rest of its run (runs are in expert order, so the latest mark is the largest).
    experts = tl.arange(0, BLOCK_E)
    tl.store(expert_ids_ptr + padded_start // BLOCK_M, experts, mask=counts > 0)
    # Sort (expert, assignment) keys; the i-th sorted assignment is the (i - first[e])-th of expert e.
    keys = tl.sort(tl.where(valid, ids * BLOCK_N + offs, BLOCK_E * BLOCK_N))  # [BLOCK_N], invalid last
    expert = tl.minimum(keys // BLOCK_N, BLOCK_E - 1)
    first = tl.gather(tl.cumsum(counts, 0) - counts, expert, 0)  # [BLOCK_N]
    kept = keys < BLOCK_E * BLOCK_N  # in sorted order: the valid keys come first
    tl.store(sorted_ids_ptr + tl.gather(padded_start, expert, 0) + offs - first, keys % BLOCK_N, mask=kept)
    tl.debug_barrier()
    carry = -1
    for tile in range(BLOCK_TILES):
        block = tile * BLOCK_N + offs
        marks = tl.load(expert_ids_ptr + block, mask=block < num_blocks, other=-1)
        owner = tl.maximum(tl.associative_scan(marks, 0, _max_combine), carry)
        carry = tl.max(owner, 0)
        tl.store(expert_ids_ptr + block, tl.where(block * BLOCK_M < total, owner, -1), mask=block < num_blocks)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


def _moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int, size: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # moe_align's contract from device-side torch ops, for prefill sizes (no bincount: on CUDA it reads
    # the max id on the host). Skipped assignments count as a last expert E whose run is not padded and
    # whose slots all go to one spare position past the end, cut off.
    flat = topk_ids.flatten().long()  # [N]
    n, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E + 1]: integer adds, so order-independent
    padded = (counts + block_m - 1) // block_m * block_m  # [E + 1]
    padded[num_experts] = 0
    padded_end = padded.cumsum(0)  # [E + 1]: one past each expert's padded run
    order = flat.argsort(stable=True)  # [N]: assignment ids by expert
    sorted_expert = flat[order]  # [N]
    first = counts.cumsum(0) - counts  # [E + 1]: each expert's first position in `order`
    rank = torch.arange(n, device=device) - first[sorted_expert]  # [N]: position inside the expert's run
    dest = (padded_end - padded)[sorted_expert] + rank  # [N]: slot in the padded order
    dest = torch.where(sorted_expert < num_experts, dest, size)
    sorted_ids = torch.full((size + 1,), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, size, block_m, device=device)  # [P / block_m]
    # The run holding a block start is the first expert whose end lies beyond it; empty runs never match.
    ends = padded_end[:num_experts]  # [E]
    expert_ids = torch.searchsorted(ends, block_start, right=True)  # [P / block_m], E past the end
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids[:size], expert_ids, ends[-1:].to(torch.int32)


@triton.jit
def _fused_moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    num_valid, rows_per_a, num_m_blocks, stride_am, stride_be, stride_bn, stride_cm,
    N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    # c[r] = f(a[r // rows_per_a] @ b[e].T) for the block's valid assignments r, e its expert.
    # Gate-up: a = x [T, H], rows_per_a = K, b = w13 [E, 2N, H], f = silu(gate) * up over b's row halves.
    # Down: a = act [N_assign, I], rows_per_a = 1, b = w2 [E, N, I], f = routing weight * product.
    # Last dimensions of a, b, c are contiguous (the wrapper checks).
    pid_m, pid_n = _tile_ids(num_m_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):  # past the real total: the worst-case grid's spare blocks
        return
    assign = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_ok = assign < num_valid  # sentinel padding is never loaded nor stored
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)  # int64: E * 2I * H passes 2^31 for V3
    a_rows = a_ptr + (assign // rows_per_a).to(tl.int64) * stride_am  # [BLOCK_M] pointers
    # Columns wrap modulo N so every weight load is in bounds; the store masks the wrapped ones.
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    b_cols = b_ptr + expert * stride_be + offs_n.to(tl.int64) * stride_bn  # [BLOCK_N] pointers
    acc = _expert_tile(a_rows, b_cols, row_ok, N * stride_bn, K, BLOCK_M, BLOCK_N, BLOCK_K, GATED,
                       DOT_PRECISION, DOT_UPCAST)  # [BLOCK_M, BLOCK_N] fp32
    if MUL_WEIGHT:
        acc *= tl.load(topk_weights_ptr + assign, mask=row_ok, other=0.0)[:, None]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + assign.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < N))


@triton.jit
def _tile_ids(num_m_blocks, num_n_tiles, GROUP_M: tl.constexpr):
    # Grouped order: GROUP_M consecutive blocks take each N tile in turn, so when an expert owns several
    # blocks (prefill) its weight tile is read from L2 by all of them. Spare blocks come last.
    pid = tl.program_id(0)
    per_group = GROUP_M * num_n_tiles
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_size, (pid % per_group) // group_size


@triton.jit
def _expert_tile(a_rows, b_cols, row_ok, up_offset, K: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    # sum over K of a[BLOCK_M rows] x b[BLOCK_N rows]^T in fp32; GATED: silu(that) * (same with the rows
    # up_offset further on), sharing each a tile between the two products.
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    EVEN_K: tl.constexpr = K % BLOCK_K == 0  # every real shape: no K mask, so loads stay vectorized
    for k in range(0, K, BLOCK_K):  # K is constexpr: the trip count is known at compile time
        k_ok = offs_k < K - k
        a = _load_a(a_rows[:, None] + (k + offs_k)[None, :], row_ok, k_ok, EVEN_K)  # [BLOCK_M, BLOCK_K]
        b_ptrs = b_cols[None, :] + (k + offs_k)[:, None]  # [BLOCK_K, BLOCK_N]
        acc = _mma(a, _load_b(b_ptrs, k_ok, EVEN_K), acc, DOT_PRECISION, DOT_UPCAST)
        if GATED:
            acc_up = _mma(a, _load_b(b_ptrs + up_offset, k_ok, EVEN_K), acc_up, DOT_PRECISION, DOT_UPCAST)
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    return acc


@triton.jit
def _load_a(ptrs, row_ok, k_ok, EVEN_K: tl.constexpr):
    # The row mask is constant along the contiguous K axis, so it does not stop vector loads; a K mask would.
    if EVEN_K:
        a = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        a = tl.load(ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    return a


@triton.jit
def _load_b(ptrs, k_ok, EVEN_K: tl.constexpr):
    if EVEN_K:
        b = tl.load(ptrs)
    else:
        b = tl.load(ptrs, mask=k_ok[:, None], other=0.0)
    return b


@triton.jit
def _mma(a, b, acc, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    if DOT_UPCAST:  # the interpreter multiplies 16-bit floats as raw integers: do it in fp32 there
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"fused_moe: {message}")


def _check_inputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> None:
    _require(x.dim() == 2 and w13.dim() == 3 and w2.dim() == 3, "x [T, H], w13 [E, 2I, H], w2 [E, H, I]")
    (t, h), (e, two_i, _) = x.shape, w13.shape
    _require(w13.shape[2] == h and two_i % 2 == 0 and tuple(w2.shape) == (e, h, two_i // 2),
             f"weights {tuple(w13.shape)} / {tuple(w2.shape)} do not match x {tuple(x.shape)}")
    _require(x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"unsupported dtype {x.dtype}")
    _require(w13.dtype == x.dtype and w2.dtype == x.dtype, "x, w13 and w2 must share one dtype")
    _require(x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1,
             "the last dimension of x, w13 and w2 must be contiguous")
    _require(topk_ids.dim() == 2 and topk_ids.shape[0] == t and topk_weights.shape == topk_ids.shape,
             "topk_weights and topk_ids must both be [T, K]")
    _require(topk_weights.dtype == torch.float32 and topk_weights.is_contiguous(),
             "topk_weights must be contiguous float32")
    _require(not topk_ids.is_floating_point(), "topk_ids must be integers")
    _require(len({x.device, w13.device, w2.device, topk_weights.device, topk_ids.device}) == 1,
             "all inputs must be on one device")


def _dot_options(dtype: torch.dtype) -> dict[str, object]:
    # fp32 inputs: "ieee", not the tf32 default, so fp32 matches the reference to 1e-5.
    return dict(DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                DOT_UPCAST=dtype != torch.float32 and INTERPRET)


def _launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor,
            align: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rows_per_a: int, gated: bool,
            cfg: MoEConfig) -> None:
    # c [N_assign, n] gets the block products; n = b's rows (halved when gated), k = b's columns.
    sorted_ids, expert_ids, num_padded = align
    n, k = c.shape[1], b.shape[2]
    num_m_blocks = expert_ids.numel()
    grid = (num_m_blocks * triton.cdiv(n, cfg.block_n),)
    _fused_moe_gemm_kernel[grid](
        a, b, c, topk_weights, sorted_ids, expert_ids, num_padded,
        c.shape[0], rows_per_a, num_m_blocks, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        N=n, K=k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        GATED=gated, MUL_WEIGHT=not gated, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_dot_options(a.dtype),
    )


def _workspace(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    # Uninitialized: every row is written (module docstring). Tests replace this with a NaN fill.
    return torch.empty(rows, cols, dtype=like.dtype, device=like.device)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: MoEConfig | None = None, skips: bool = False) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], topk_weights [T, K] float32,
    topk_ids [T, K] -> [T, H] in x's dtype: the routed experts' weighted sum (module docstring).
    skips: topk_ids may hold E, an assignment to leave out (expert parallelism: another rank's expert).
    fp32 accumulation; no host sync (CUDA-graph safe); deterministic."""
    _check_inputs(x, w13, w2, topk_weights, topk_ids)
    (t, h), (e, two_i, _), k = x.shape, w13.shape, topk_ids.shape[1]
    if t == 0:
        return x.new_empty(0, h)
    cfg = config or default_config(t, k, e, x.dtype)
    align = moe_align(topk_ids, e, cfg.block_m)
    act = _workspace(t * k, two_i // 2, x)  # [N, I]
    _launch(x, w13, act, topk_weights, align, rows_per_a=k, gated=True, cfg=cfg)
    y = torch.zeros(t * k, h, dtype=x.dtype, device=x.device) if skips else _workspace(t * k, h, x)  # [N, H]
    _launch(act, w2, y, topk_weights, align, rows_per_a=1, gated=False, cfg=cfg)
    return y.view(t, k, h).sum(dim=1) if k > 1 else y  # fixed-order sum over the K slots


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """What fused_moe must equal: expert by expert, in fp32, cast to x's dtype at the end; ids past the
    last expert (skips) contribute nothing."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    for e in [e for e in topk_ids.unique().tolist() if e < w13.shape[0]]:
        rows, slots = (topk_ids == e).nonzero(as_tuple=True)  # [n] each
        xe, w13e = x[rows].float(), w13[e].float()  # [n, H], [2I, H]
        act = torch.nn.functional.silu(xe @ w13e[:inter].T) * (xe @ w13e[inter:].T)  # [n, I]
        out.index_add_(0, rows, (act @ w2[e].float().T) * topk_weights[rows, slots, None])  # [n, H]
    return out.to(x.dtype)
