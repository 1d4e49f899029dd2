"""DeepSeek-V2, V2-Lite, V2.5, V3, R1, V3.1: multi-head latent attention (MLA) and DeepSeekMoE.

One layer, as in the DeepSeek-V2 paper (§2) with the names of DeepSeek's reference inference code:
  attn  q = wq_b(q_norm(wq_a(x)))  — or wq(x) when q_lora_rank is None (V2-Lite) — per head q_nope | q_pe
        kv_c | k_pe = wkv_a(x), kv_c = kv_norm(kv_c): the latent and the one rope key all heads share
        rope on q_pe and k_pe; the latent front caches (kv_c, k_pe) and applies wkv_b = [W_UK; W_UV]
        (layers/mla.py); wo projects the heads' outputs back
  ffn   a dense SwiGLU for the first first_k_dense_replace layers, DeepSeekMoE (layers/moe.py) after

Shapes: T tokens in the step, E hidden_size, H heads (this rank), Cq q_lora_rank, C kv_lora_rank,
Dn qk_nope_head_dim, Dr qk_rope_head_dim, Dk = Dn + Dr, Dv v_head_dim, V vocab.

Checkpoint names (transformers / DeepSeek's Hugging Face releases) -> ours:
  self_attn.{q_proj, q_a_proj, q_a_layernorm, q_b_proj}         -> attn.{wq, wq_a, q_norm, wq_b}
  self_attn.{kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj} -> attn.{wkv_a, kv_norm, mla.wkv_b, wo}
  input_layernorm, post_attention_layernorm, mlp                  -> attn_norm, ffn_norm, ffn
  {gate_proj, up_proj, down_proj}                                 -> w1 and w3 (merged as w13), w2
  model.embed_tokens, model.norm, lm_head                         -> embed, norm, head
  model.layers.{N}.{enorm, hnorm, eh_proj, shared_head.norm}      -> mtp.{enorm, hnorm, eh_proj, head_norm}
  model.layers.{N}.<decoder layer>                                 -> mtp.block.<as above>
  (N = num_hidden_layers: DeepSeek-V3's multi-token-prediction module, loaded only for speculative decoding;
  its embed_tokens and shared_head.head are the main model's, shared as the V3 report's §2.2 says.)
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from deepserve import envs
from deepserve.distributed.parallel_state import get_tp_world_size, is_first_stage, is_last_stage, stage_layers
from deepserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from deepserve.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, stacked_rows
from deepserve.layers.mla import MLAAttention
from deepserve.layers.moe import MLP, DeepseekMoE, RoutingConfig
from deepserve.layers.norm import RMSNorm
from deepserve.layers.quantization import QuantConfig, fp8_config, warn_once
from deepserve.layers.rotary import RotaryEmbedding, rope_parameters, softmax_scale_correction
from deepserve.loader.checkpoint import load_tensor, param_for, stage_weights
from deepserve.loader.fp8 import SCALE_SUFFIX, dequantize_fp8_weights, fp8_block_size, skip_mtp_layers
from deepserve.loader.int4 import checkpoint_method, dequantize_int4_weights, int4_config, split_name

# The low-rank norms use RMSNorm's default eps in both transformers and DeepSeek's reference,
# not config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class PPMissingLayer(nn.Identity):
    """Stands in for a module another pipeline stage owns: no parameters, never called."""


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, config: Any, rotary: RotaryEmbedding, quant: QuantConfig | None = None) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads = heads // get_tp_world_size()
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank:
            self.wq_a = ReplicatedLinear(hidden, self.q_lora_rank, bias, quant=quant)  # W_DQ
            self.q_norm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = ColumnParallelLinear(self.q_lora_rank, heads * self.qk_head_dim, quant=quant)  # [W_UQ; W_QR]
        else:
            self.wq = ColumnParallelLinear(hidden, heads * self.qk_head_dim, quant=quant)
        # [W_DKV; W_KR]
        self.wkv_a = ReplicatedLinear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias, quant=quant)
        self.kv_norm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.wo = RowParallelLinear(heads * config.v_head_dim, hidden, bias, quant=quant)
        # wkv_b stays in the model dtype (layers/quantization.py): an FP8 checkpoint's is dequantized at load.
        self.rotary = rotary  # one module shared by every layer: its cos/sin table can be large (YaRN, 160k)
        # YaRN stretches the context; DeepSeek compensates with mscale(factor, mscale_all_dim)² on every score.
        scale = self.qk_head_dim**-0.5 * softmax_scale_correction(rope_parameters(config))
        self.mla = MLAAttention(heads, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim,
                                config.v_head_dim, scale)
        # DEEPSERVE_FUSED_QKV_A: after loading, wq_a (or wq) and wkv_a, which both read x, become one linear
        # (fuse_loaded_weights): one GEMV launch instead of two at decode.
        self.wqkv_a: nn.Module | None = None
        self.q_a_rows = 0
        self.fuse_qkv_a = envs.DEEPSERVE_FUSED_QKV_A

    def fuse_loaded_weights(self) -> None:
        """After loading (layers/quantization.quantize_after_loading, before its children's re-layout): the
        query's first projection and wkv_a stacked into one linear, under DEEPSERVE_FUSED_QKV_A. wq is
        column-parallel, so without a q LoRA only at tensor parallelism 1. Tried once: a refusal is said once a
        process and not retried (a later pass would see re-laid-out weights)."""
        if not self.fuse_qkv_a:
            return
        self.fuse_qkv_a = False
        # On by default: a refusal is a warning only where the switch was set.
        level = logging.WARNING if "DEEPSERVE_FUSED_QKV_A" in os.environ else logging.INFO
        if not self.q_lora_rank and get_tp_world_size() > 1:
            warn_once("DEEPSERVE_FUSED_QKV_A: q_proj and kv_a_proj_with_mqa stay apart under tensor parallelism "
                      "(q_proj is split by it, kv_a_proj_with_mqa is not)", level)
            return
        first = self.wq_a if self.q_lora_rank else self.wq
        merged = stacked_rows(first, self.wkv_a)
        if isinstance(merged, str):
            warn_once(f"DEEPSERVE_FUSED_QKV_A: the q and kv_a projections stay apart: {merged}", level)
            return
        self.q_a_rows = (first.qweight if first.int4 is not None else first.weight).shape[0]
        self.wqkv_a = merged
        self.wkv_a = None
        if self.q_lora_rank:
            self.wq_a = None
        else:
            self.wq = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # positions: [T], x: [T, E] -> [T, E]
        if self.wqkv_a is not None:  # [T, q_a_rows + C + Dr]: views of one product
            q, kv = self.wqkv_a(x).split([self.q_a_rows, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1)
            q = self.wq_b(self.q_norm(q)) if self.q_lora_rank else q  # [T, H * Dk]
        else:
            q = self.wq_b(self.q_norm(self.wq_a(x))) if self.q_lora_rank else self.wq(x)  # [T, H * Dk]
            kv = self.wkv_a(x)
        q_nope, q_pe = q.view(-1, self.num_heads, self.qk_head_dim).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)  # [T, H, Dn], [T, H, Dr]
        kv_c, k_pe = kv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)  # [T, C], [T, Dr]
        # q_pe and k_pe rotated inside (on GPUs in the latent store's launch)
        out = self.mla(q_nope, q_pe, self.kv_norm(kv_c), k_pe, rope=(positions, self.rotary))  # [T, H * Dv]
        return self.wo(out)


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    # transformers has no moe_layer_freq (every released checkpoint has 1); DeepSeek's code honours it.
    freq = getattr(config, "moe_layer_freq", 1) or 1
    dense = getattr(config, "first_k_dense_replace", 0) or 0
    return bool(getattr(config, "n_routed_experts", None)) and layer_idx >= dense and layer_idx % freq == 0


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary: RotaryEmbedding, routing: RoutingConfig | None,
                 quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = MultiHeadLatentAttention(config, rotary, quant)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if routing is not None and is_moe_layer(config, layer_idx):
            self.ffn = DeepseekMoE(config.hidden_size, config.moe_intermediate_size,
                                   getattr(config, "n_shared_experts", 0) or 0, routing, quant)
        else:
            self.ffn = MLP(config.hidden_size, config.intermediate_size, quant=quant)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.attn_norm(x), x
        else:
            x, residual = self.attn_norm(x, residual)
        x = self.attn(positions, x)
        x, residual = self.ffn_norm(x, residual)
        return self.ffn(x), residual


class MultiTokenPredictor(nn.Module):
    """DeepSeek-V3's MTP module (V3 technical report §2.2), run as a speculative-decoding draft.

    At position p it takes the main model's final hidden state h_p and the embedding of the token at
    p + 1, and predicts the token at p + 2:
        x = eh_proj([enorm(Emb(t_{p+1})); hnorm(h_p)])  (embedding first, the checkpoint's column order)
        h'_p = block(x) + its residual, logits = head(head_norm(h'_p))
    with its own decoder layer (and its own KV cache over the same positions), the main model's
    embedding and head. Chained, h'_p stands in for h_{p+1} at the next depth."""

    def __init__(self, config: Any, rotary: RotaryEmbedding, routing: RoutingConfig | None,
                 quant: QuantConfig | None) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, False)
        self.block = DecoderLayer(config, config.num_hidden_layers, rotary, routing, quant)
        self.head_norm = RMSNorm(hidden, config.rms_norm_eps)  # shared_head.norm

    def forward(self, embedded: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # embedded, hidden: [T, E] -> [T, E]
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))  # [T, 2E] -> [T, E]
        x, residual = self.block(positions, x, None)
        return x + residual


class DeepseekV2ForCausalLM(nn.Module):
    # On CUDA, decode steps run the Triton latent-decode and fused-MoE kernels: no host syncs, so the
    # runner captures them in CUDA graphs like the dense models.
    supports_cuda_graphs = True

    def __init__(self, config: Any, enable_expert_parallel: bool = False, quantization: str | None = None) -> None:
        super().__init__()
        check_supported(config)
        self.config = config
        # None: the model dtype throughout (an FP8 checkpoint is dequantized at load); "fp8": as
        # layers/quantization.py says (resolve_quantization picks it for FP8 checkpoints).
        quant = fp8_config(config, quantization)
        # Built before any layer, so a bad routing field is refused before weights are allocated.
        routing = (RoutingConfig.from_hf(config, enable_expert_parallel)
                   if getattr(config, "n_routed_experts", None) else None)
        rotary = RotaryEmbedding(config.qk_rope_head_dim, config.max_position_embeddings, rope_parameters(config),
                                 interleaved=rope_interleaved(config))
        # Under pipeline parallelism this stage builds only layers [start, end), the first stage the
        # embedding, the last the final norm and head; the others are parameterless placeholders.
        self.start_layer, self.end_layer = stage_layers(config.num_hidden_layers)
        self.first, self.last = is_first_stage(), is_last_stage()
        self.embed = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if self.first else PPMissingLayer()
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, rotary, routing, quant) if self.start_layer <= i < self.end_layer
            else PPMissingLayer() for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.last else PPMissingLayer()
        self.head = ParallelLMHead(config.vocab_size, config.hidden_size) if self.last else PPMissingLayer()
        if config.tie_word_embeddings and self.first and self.last:
            self.head.weight = self.embed.weight
        self._mtp_parts = (rotary, routing, quant)
        self.mtp: MultiTokenPredictor | None = None  # built by enable_mtp (speculative decoding only)

    def enable_mtp(self) -> MultiTokenPredictor:
        """Build the MTP module (on the current default device and dtype); its weights are loaded by
        load_mtp_weights or drawn as dummy ones by the caller."""
        if not getattr(self.config, "num_nextn_predict_layers", 0):
            raise ValueError("speculative_config.method mtp needs a checkpoint whose config has "
                             "num_nextn_predict_layers >= 1")
        self.mtp = MultiTokenPredictor(self.config, *self._mtp_parts)
        return self.mtp

    def mtp_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP module at T positions: input_ids [T] the tokens one ahead, hidden [T, E] the main
        model's (or, chained, the module's own) -> [T, E]. Inside a forward context, like forward."""
        return self.mtp(self.embed(input_ids), positions, hidden)

    def mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.compute_logits(self.mtp.head_norm(hidden))  # [N, E] -> [N, V]

    def load_mtp_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The MTP module's tensors (model.layers.{num_hidden_layers}.*) into self.mtp; the names loaded
        (relative to the module). Its embed_tokens and shared_head.head copies are skipped: shared."""
        prefix = f"model.layers.{self.config.num_hidden_layers}."
        own = {"enorm.": "enorm.", "hnorm.": "hnorm.", "eh_proj.": "eh_proj.", "shared_head.norm.": "head_norm."}

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if not name.startswith(prefix):
                    continue
                rest = name[len(prefix):]
                if rest.startswith(("embed_tokens.", "shared_head.head.")):
                    continue
                mapped = next((new + rest[len(old):] for old, new in own.items() if rest.startswith(old)), None)
                yield (mapped if mapped is not None else "model.layers.0." + rest), tensor

        params = dict(self.mtp.named_parameters())

        def target(name: str) -> tuple[str, Any]:
            if not name.startswith("model.layers.0."):
                return name, None
            mapped, shard_id = param_name(name)
            return "block." + mapped.removeprefix("layers.0."), shard_id

        return _load_into(self.mtp, params, renamed(), target, self.config, type(self).__name__)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The last stage returns hidden [T, E]; an earlier one (hidden, residual) for the next stage,
        which passes them as `intermediate`."""
        if self.first:
            x, residual = self.embed(input_ids), None  # [T] -> [T, E]
        else:
            x, residual = intermediate
        for layer in self.layers[self.start_layer : self.end_layer]:
            x, residual = layer(positions, x, residual)
        if not self.last:
            return x, residual
        x, _ = self.norm(x, residual)
        return x  # [T, E]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.compute_logits(hidden)  # [N, E] -> [N, V]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        weights = skip_mtp_layers(weights, self.config.num_hidden_layers)
        tied = self.config.tie_word_embeddings
        split_head = tied and self.last and not self.first  # the last stage's head: its own copy of the embedding
        if split_head:
            weights = ((("lm_head.weight" if n == "model.embed_tokens.weight" else n), t) for n, t in weights)
        weights = stage_weights(weights, self.start_layer, self.end_layer, {
            "model.embed_tokens.": self.first, "model.norm.": self.last, "lm_head.": self.last})
        if tied and not split_head:
            weights = ((n, t) for n, t in weights if n != "lm_head.weight")
        params = {n: p for n, p in self.named_parameters() if not n.startswith("mtp.")}
        return _load_into(self, params, weights, param_name, self.config, type(self).__name__)


def _load_into(model: nn.Module, params: dict[str, nn.Parameter], weights: Iterable[tuple[str, torch.Tensor]],
               target_of, config: Any, owner: str) -> set[str]:
    """Each checkpoint tensor into params[target_of(name)] through its weight_loader; the names loaded.
    With FP8 block scales, weights whose parameter is FP8 (it has a scale beside it) load as shipped; the
    others (wkv_b, or all of them without FP8 kernels) are dequantized to float32 and cast by their loader.
    AWQ / GPTQ: int4 layers take their tensors as shipped; wkv_b's are dequantized. A module built int4
    that the checkpoint ships unquantized gets a plain parameter (loader/checkpoint.param_for)."""
    block = fp8_block_size(config)
    if block is not None:
        weights = dequantize_fp8_weights(weights, block, keep=lambda n: target_of(n)[0] + SCALE_SUFFIX in params)
    method = checkpoint_method(config)
    if method in ("awq", "gptq"):
        weights = dequantize_int4_weights(weights, int4_config(config, method),
                                          keep=lambda m: target_of(m + ".qweight")[0] in params)
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        target, shard_id = target_of(name.removesuffix(SCALE_SUFFIX))
        if name.endswith(SCALE_SUFFIX):
            target += SCALE_SUFFIX
        param = param_for(model, params, target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {owner}")
        load_tensor(param, tensor, shard_id, name)
        loaded.add(target)
    return loaded


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """The V2 architecture; what changes (noaux_tc routing, sigmoid scores, FP8 weights, MTP layers)
    is all in the config and the checkpoint."""


def check_supported(config: Any) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act {act!r} is not supported for DeepSeek-V2/V3; supported: silu")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if kv_heads != heads:
        # MLA has no key/value heads of its own; transformers would repeat the expanded heads.
        raise ValueError(f"config.json num_key_value_heads ({kv_heads}) must equal num_attention_heads ({heads}) "
                         "for multi-head latent attention")


def rope_interleaved(config: Any) -> bool:
    # DeepSeek checkpoints rotate adjacent pairs; transformers' V3 exposes it as rope_interleave
    # (default True), its V2 always rotates pairs (complex multiplication).
    return bool(getattr(config, "rope_interleave", True))


_RENAMES = (
    ("model.embed_tokens.", "embed."), ("model.norm.", "norm."), ("lm_head.", "head."), ("model.layers.", "layers."),
    (".self_attn.q_proj.", ".attn.wq."), (".self_attn.q_a_proj.", ".attn.wq_a."),
    (".self_attn.q_a_layernorm.", ".attn.q_norm."), (".self_attn.q_b_proj.", ".attn.wq_b."),
    (".self_attn.kv_a_proj_with_mqa.", ".attn.wkv_a."), (".self_attn.kv_a_layernorm.", ".attn.kv_norm."),
    (".self_attn.kv_b_proj.", ".attn.mla.wkv_b."), (".self_attn.o_proj.", ".attn.wo."),
    (".input_layernorm.", ".attn_norm."), (".post_attention_layernorm.", ".ffn_norm."), (".mlp.", ".ffn."),
)
# checkpoint projection -> (our parameter, member of the merged w13); w2 is not merged
_PROJECTIONS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)}
_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_EXPERTS = {".experts.gate_up_proj": ".experts.w13", ".experts.down_proj": ".experts.w2"}


def param_name(checkpoint_name: str) -> tuple[str, Any]:
    """Checkpoint tensor name -> (our parameter name, shard id for its weight_loader or None)."""
    module, kind = split_name(checkpoint_name)
    if kind is not None:  # an int4 tensor: named like the weight, with its kind (layers/int4.py)
        target, shard_id = param_name(module + ".weight")
        ours = target.removesuffix(".weight") + f".{kind}" if target.endswith(".weight") else f"{target}_{kind}"
        return ours, shard_id
    name = checkpoint_name
    for old, new in _RENAMES:
        name = name.replace(old, new)
    expert = _EXPERT.search(name)
    if expert:  # one expert's projection into the stacked weights: shard (expert, member) or expert
        merged, member = _PROJECTIONS[expert.group(2)]
        e = int(expert.group(1))
        return f"{name[: expert.start()]}.experts.{merged}", e if member is None else (e, member)
    for fused, ours in _FUSED_EXPERTS.items():  # transformers' stacked layout, all experts at once
        if name.endswith(fused):
            return name.removesuffix(fused) + ours, None
    for proj, (merged, member) in _PROJECTIONS.items():
        if f".{proj}." in name:
            return name.replace(f".{proj}.", f".{merged}."), member
    return name, None
