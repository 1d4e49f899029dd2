"""The latent attention front of multi-head latent attention (DeepSeek-V2/V3): the second cache layout.

The model computes per token the normalized compressed kv c (C values) and the shared key k_pe (Dr
values), which this front rotates by position (on GPUs in the store's launch); it stores exactly those in
the paged cache — (C + Dr) values per token and layer, no head axis — and owns wkv_b = [W_UK; W_UV] per
head, which turns c into keys and values.

Two equal ways to attend (DeepSeek-V2 §2.1.3):
  expanded  k = [W_UK c ; k_pe], v = W_UV c per head, then ordinary causal attention. Cheaper when
            many queries share the keys (compute-bound, Dk 192 < C + Dr 576 per score), and on the
            GPU it runs on flash attention. Fresh prompts take it over this step's latents, and prompt
            chunks of at least EXPAND_MIN_NEW_TOKENS over a cache (chunked prefill) over their gathered
            history, one sequence at a time (transient memory: one history, ~1.3 KB per token and head).
  absorbed  q·k = (W_UKᵀ q_nope)·c + q_pe·k_pe, so the query is folded into latent space and attends
            straight over the cached entries; W_UV is applied to the attention-weighted latents after.
            Never expands the cache, so decode uses it (the Triton kernel on the GPU), and so do fewer
            new tokens over a cache (prefix-cache hits with a short suffix): expanding costs ~120
            queries' worth of absorbed attention per history token. Its 576-wide heads fit only SDPA's
            math path (fp32 scores [H, n, L]), which is why many new tokens do not take it.
A step may mix the kinds of sequences; they are split and each part takes its form.

FP8 cache (--kv-cache-dtype fp8): each entry is stored as entry / k_scale in float8_e4m3fn, one float32
scale per layer for c and k_pe together (vLLM's MLA uses the layer's k_scale; a checkpoint's v_scale is
ignored); the absorbed forms read fp8 * k_scale, the expanded form over a cache dequantizes the
gathered history. Fresh prompts attend over this step's unquantized latents.

Shapes: T new tokens, H heads (this rank), C kv_lora_rank, Dn qk_nope_head_dim, Dr qk_rope_head_dim,
Dv v_head_dim.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from deepserve import envs
from deepserve.distributed.parallel_state import get_tp_world_size
from deepserve.forward_context import AttentionMetadata, get_forward_context
from deepserve.kernels.mla_attention import (
    gather_latent,
    mla_attention_ref,
    mla_prefill_ref,
    mla_sequence_attention,
    store_latent_ref,
)
from deepserve.kernels.paged_attention import dequantize_kv
from deepserve.layers.attention import FUSED_ROPE_KV_STORE, uses_gpu_kernels
from deepserve.layers.kv_cache_spec import KVCacheSpec
from deepserve.layers.linear import ColumnParallelLinear
from deepserve.layers.rotary import RotaryEmbedding

HEAD_MATMUL = envs.DEEPSERVE_HEAD_MATMUL  # read once, at import (kernels/head_matmul.py where it fits: _per_head)


class MLAAttention(nn.Module):
    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads // get_tp_world_size()
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.scale = scale
        # [H * (Dn + Dv), C]: per head, Dn rows of W_UK then Dv rows of W_UV
        self.wkv_b = ColumnParallelLinear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim))
        self.kv_cache: torch.Tensor | None = None  # [num_blocks, block_size, C + Dr], bound by the runner
        # An FP8 cache's scale of whole entries (float32; a buffer, so checkpoints without it are complete).
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32), persistent=False)

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec:
        # No head axis: every head (and every tensor-parallel rank) reads the same latent entry.
        return KVCacheSpec(entry_shape=(self.kv_lora_rank + self.qk_rope_head_dim,), planes=1, dtype=dtype)

    def load_kv_scale(self, which: str, value: float) -> None:
        """A checkpoint's k_scale ("k") scales the whole latent entry; its v_scale ("v") has nothing to
        scale here (the values are the entry's first C columns), as in vLLM."""
        if which == "k":
            self.k_scale.fill_(value)

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                rope: tuple[torch.Tensor, RotaryEmbedding] | None = None) -> torch.Tensor:
        # q_nope: [T, H, Dn], q_pe: [T, H, Dr], kv_c: [T, C] (normalized), k_pe: [T, Dr]. rope (positions,
        # rotary): q_pe and k_pe not yet rotated; rotated here, on the GPU path with DEEPSERVE_FUSED_ROPE_KV_STORE
        # in the latent store's launch (kernels/rope_kv_store.mla_rope_and_store). None: both already rotated.
        meta = get_forward_context()
        gpu = uses_gpu_kernels(q_nope)
        # the fused launch rotates the whole of q_pe / k_pe: a rotary over part of them takes the unfused path
        fusable = gpu and FUSED_ROPE_KV_STORE and rope is not None and rope[1].rotary_dim == q_pe.shape[-1]
        if rope is not None and not fusable:
            positions, rotary = rope
            q_pe, k_pe = rotary(positions, q_pe, k_pe.unsqueeze(1))
            k_pe, rope = k_pe.squeeze(1), None
        if gpu:
            return self._forward_cuda(q_nope, q_pe, kv_c, k_pe, meta, rope).flatten(1)
        store_latent_ref(kv_c, k_pe, self.kv_cache, meta.slot_mapping, self.k_scale)
        return self._split_forms(q_nope, q_pe, kv_c, k_pe, meta).flatten(1)

    def _forward_cuda(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                      meta: AttentionMetadata, rope: tuple[torch.Tensor, RotaryEmbedding] | None = None
                      ) -> torch.Tensor:
        """Decoding sequences take the Triton latent-decode kernel (CUDA-graph safe); fresh prompts the
        expanded form in one flash varlen call; chunks over a cached prefix the forms below. rope: q_pe and
        k_pe still to rotate, in the latent store's launch."""
        if rope is not None:
            from deepserve.kernels.rope_kv_store import mla_rope_and_store

            positions, rotary = rope
            q_pe, k_pe = mla_rope_and_store(positions, q_pe, k_pe, kv_c, rotary.cos_sin, rotary.interleaved,
                                            self.kv_cache, meta.slot_mapping, self.k_scale)
        else:
            from deepserve.kernels.triton_paged_attention import store_mla_cache

            store_mla_cache(torch.cat([kv_c, k_pe], dim=-1), self.kv_cache, meta.slot_mapping, self.k_scale)
        if meta.decode_only:
            return self._absorbed_decode(q_nope, q_pe, meta.block_tables, meta.seq_lens, meta.max_seq_len)
        if meta.prefill_seqs_cpu is None:  # metadata without the decode/prefill split: all per sequence
            return self._split_forms(q_nope, q_pe, kv_c, k_pe, meta)
        out = q_nope.new_empty(*q_nope.shape[:2], self.v_head_dim)  # [T, H, Dv]
        if meta.decode_token_idx is not None and meta.decode_token_idx.numel():
            rows, seqs = meta.decode_token_idx, meta.decode_seq_idx
            out[rows] = self._absorbed_decode(q_nope[rows], q_pe[rows], meta.block_tables[seqs], meta.seq_lens[seqs],
                                              meta.max_seq_len)
        if meta.prefill_fresh is not None:  # one flash varlen call over every fresh prompt of the step
            g = meta.prefill_fresh  # fresh prompts: cu_k == cu_q
            out[g.rows] = self._expanded(q_nope[g.rows], q_pe[g.rows], kv_c[g.rows], k_pe[g.rows], g.cu_q, g.cu_q_cpu)
        if meta.prefill_cached:  # chunks over a cached prefix: each in its form
            rows, sub = select_sequences(meta, [b for g in meta.prefill_cached for b in g.seqs])
            out[rows] = self._split_forms(q_nope[rows], q_pe[rows], kv_c[rows], k_pe[rows], sub)
        return out

    def _absorbed_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        from deepserve.kernels.triton_paged_attention import paged_mla_decode_attention

        w_uk, w_uv = self._w_uk_uv()
        q_latent = _per_head(q_nope, w_uk.transpose(1, 2))  # [B, H, Dn] x [H, Dn, C] -> [B, H, C]
        o_latent = paged_mla_decode_attention(q_latent.contiguous(), q_pe.contiguous(), self.kv_cache, block_tables,
                                              seq_lens, self.scale, max_seq_len=max_seq_len,
                                              kv_scale=self.k_scale)  # [B, H, C]
        return _per_head(o_latent, w_uv)  # [B, H, Dv]

    def _split_forms(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                     meta: AttentionMetadata) -> torch.Tensor:
        """Each of meta's sequences in its form (`_forms`)."""
        groups = _forms(meta)
        if len(groups) == 1:
            return self._attend(next(iter(groups)), q_nope, q_pe, kv_c, k_pe, meta)
        out = q_nope.new_empty(*q_nope.shape[:2], self.v_head_dim)
        for form, members in groups.items():
            rows, sub = select_sequences(meta, members)
            out[rows] = self._attend(form, q_nope[rows], q_pe[rows], kv_c[rows], k_pe[rows], sub)
        return out  # [T, H, Dv]

    def _attend(self, form: str, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if form == FRESH:
            return self._expanded(q_nope, q_pe, kv_c, k_pe, meta.query_start_loc, meta.query_start_loc_cpu)
        if form == OVER_CACHE:
            return self._expanded_over_cache(q_nope, q_pe, meta)
        return self._absorbed(q_nope, q_pe, meta)  # ABSORBED

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.wkv_b.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)  # [H, Dn, C], [H, Dv, C]

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        w_uk, w_uv = self._w_uk_uv()
        q_latent = torch.einsum("thd,hdc->thc", q_nope, w_uk)  # [T, H, C]
        o_latent = mla_attention_ref(q_latent, q_pe, self.kv_cache, meta.paged, self.scale, self.k_scale)  # [T, H, C]
        return torch.einsum("thc,hdc->thd", o_latent, w_uv)  # [T, H, Dv]

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                  cu: torch.Tensor, cu_cpu: list[int]) -> torch.Tensor:
        """Fresh prompts (sequence b owns rows cu[b]:cu[b+1], nothing cached before) in one varlen call."""
        k, v = self._expand_kv(kv_c, k_pe)
        q = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, Dn + Dr]
        return mla_prefill_ref(q, k, v, cu, cu_cpu, self.scale)  # [T, H, Dv]

    def _expanded_over_cache(self, q_nope: torch.Tensor, q_pe: torch.Tensor, meta: AttentionMetadata
                             ) -> torch.Tensor:
        """Prompt chunks over a cached prefix: each sequence's whole latent history (this step's entries
        are already stored) is gathered and expanded, one sequence at a time so the transient memory is
        one history's, not the step's."""
        out = q_nope.new_empty(*q_nope.shape[:2], self.v_head_dim)  # [T, H, Dv]
        offsets = _sequence_offsets(meta)  # [B, 4]
        for b in range(meta.num_seqs):
            start, end = meta.query_start_loc_cpu[b], meta.query_start_loc_cpu[b + 1]
            seq_len = meta.seq_lens_cpu[b]
            latents = dequantize_kv(gather_latent(self.kv_cache, meta.block_tables[b], seq_len, meta.block_size),
                                    self.k_scale, q_nope.dtype)  # [L, C + Dr]
            kv_c, k_pe = latents.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)  # [L, C], [L, Dr]
            k, v = self._expand_kv(kv_c, k_pe)
            q = torch.cat([q_nope[start:end], q_pe[start:end]], dim=-1)  # [n, H, Dn + Dr]
            out[start:end] = mla_sequence_attention(q, k, v, self.scale, offsets[b])
        return out

    def _expand_kv(self, kv_c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [N, H, Dn + Dr] and values [N, H, Dv] of N latents kv_c [N, C] and roped k_pe [N, Dr]."""
        kv = self.wkv_b(kv_c).view(-1, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)  # [N, H, Dn + Dv]
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)  # [N, H, Dn], [N, H, Dv]
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, self.num_heads, -1)], dim=-1)  # [N, H, Dn + Dr]
        return k, v


FRESH, OVER_CACHE, ABSORBED = "fresh", "over cache", "absorbed"
# New tokens over a cache from which the expanded form pays: per history token it costs one wkv_b row
# (2 C H (Dn + Dv) FLOPs), as much as ~120 queries of absorbed attention (2 H (2 C + Dr) FLOPs each).
EXPAND_MIN_NEW_TOKENS = 128


def _form(meta: AttentionMetadata, b: int) -> str:
    """FRESH: nothing cached before this step (expanded, this step's latents); OVER_CACHE: at least
    EXPAND_MIN_NEW_TOKENS after a cached prefix (expanded, gathered history); ABSORBED: fewer new tokens
    after a cached prefix (decode, short suffixes)."""
    num_new = _num_new(meta, b)
    if meta.seq_lens_cpu[b] == num_new:
        return FRESH
    return OVER_CACHE if num_new >= EXPAND_MIN_NEW_TOKENS else ABSORBED


def _per_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, H, K] -> [B, H, N], head h through w[h] ([H, N, K], any strides): kernels/head_matmul.py where
    head_matmul_fits says it is faster (one token, small weights, on the GPU; DEEPSERVE_HEAD_MATMUL), torch.bmm
    otherwise."""
    kernel = _head_matmul() if HEAD_MATMUL else None
    if kernel is not None and kernel[1](x, w):
        return kernel[0](x, w)
    return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)


@functools.cache
def _head_matmul():
    """(head_matmul, head_matmul_fits), imported once (Triton); None without Triton."""
    try:
        from deepserve.kernels.head_matmul import head_matmul, head_matmul_fits
    except ImportError:
        return None
    return head_matmul, head_matmul_fits


def _forms(meta: AttentionMetadata) -> dict[str, list[int]]:
    """meta's sequences by form; built by the first layer that asks and kept in meta.cache."""
    if "forms" not in meta.cache:
        groups: dict[str, list[int]] = {}
        for b in range(meta.num_seqs):
            groups.setdefault(_form(meta, b), []).append(b)
        meta.cache["forms"] = groups
    return meta.cache["forms"]


def _sequence_offsets(meta: AttentionMetadata) -> torch.Tensor:
    """[B, 4] int32 on the device: [0, new tokens, 0, seq_len] of each of meta's sequences, the
    one-sequence varlen offsets of the over-cache form; one copy per step, kept in meta.cache."""
    if "sequence_offsets" not in meta.cache:
        rows = [[0, _num_new(meta, b), 0, meta.seq_lens_cpu[b]] for b in range(meta.num_seqs)]
        device = meta.slot_mapping.device
        meta.cache["sequence_offsets"] = torch.tensor(rows, dtype=torch.int32).to(device, non_blocking=True)
    return meta.cache["sequence_offsets"]


def _num_new(meta: AttentionMetadata, b: int) -> int:
    return meta.query_start_loc_cpu[b + 1] - meta.query_start_loc_cpu[b]


def select_sequences(meta: AttentionMetadata, seqs: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
    """The token rows of sequences `seqs` and the metadata of just those sequences. Built by the first
    layer that asks and kept in meta.cache for the others: every layer splits the step the same way."""
    key = ("select_sequences", tuple(seqs))
    if key not in meta.cache:
        meta.cache[key] = _select_sequences(meta, seqs)
    return meta.cache[key]


def _select_sequences(meta: AttentionMetadata, seqs: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
    starts = meta.query_start_loc_cpu
    rows = [t for b in seqs for t in range(starts[b], starts[b + 1])]
    query_start_loc = [0]
    for b in seqs:
        query_start_loc.append(query_start_loc[-1] + _num_new(meta, b))
    device = meta.slot_mapping.device
    # Copied without blocking (torch.tensor(..., device=) would wait for the queued steps).
    rows_t = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
    seq_ids = torch.tensor(seqs, dtype=torch.int64).to(device, non_blocking=True)
    seq_lens = [meta.seq_lens_cpu[b] for b in seqs]
    sub = AttentionMetadata(
        slot_mapping=meta.slot_mapping[rows_t],
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32).to(device, non_blocking=True),
        seq_lens=meta.seq_lens[seq_ids],
        block_tables=meta.block_tables[seq_ids],
        block_size=meta.block_size,
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    return rows_t, sub
