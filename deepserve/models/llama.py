"""Llama architecture: DeepSeek-LLM 7B/67B, DeepSeek-Coder, DeepSeek-R1-Distill-Llama; Qwen2
(DeepSeek-R1-Distill-Qwen) is this model with biases on q, k and v.

Shapes: T new tokens in the step (all sequences flattened), E hidden size, H query heads,
Hkv key/value heads, D head dim, I intermediate size, V vocab.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from deepserve.distributed.parallel_state import get_tp_world_size, is_first_stage, is_last_stage, stage_layers
from deepserve.layers.activation import SiluAndMul
from deepserve.layers.attention import Attention
from deepserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from deepserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from deepserve.layers.norm import RMSNorm
from deepserve.layers.quantization import QuantConfig, fp8_config
from deepserve.layers.rotary import RotaryEmbedding, rope_parameters


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias, quant=quant)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, quant=quant)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))  # [T, E] -> [T, 2I/tp] -> [T, I/tp] -> [T, E]


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, o_bias: bool, rotary_emb: RotaryEmbedding,
                 quant: QuantConfig | None = None) -> None:
        super().__init__()
        tp = get_tp_world_size()
        hidden = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        self.num_heads = config.num_attention_heads // tp
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, config.num_attention_heads, num_kv_heads, qkv_bias,
                                          quant=quant)
        self.num_kv_heads = self.qkv_proj.num_kv_heads_per_rank
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, hidden, bias=o_bias, quant=quant)
        self.rotary_emb = rotary_emb  # one table shared by every layer
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, scale=self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        # the attention layer rotates q and k (with the cache store where it can: one launch)
        return self.o_proj(self.attn(q, k, v, rope=(positions, self.rotary_emb)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, biases: tuple[bool, bool], rotary_emb: RotaryEmbedding,
                 quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, *biases, rotary_emb, quant)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, bias=getattr(config, "mlp_bias", False),
                            quant=quant)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class PPMissingLayer(nn.Identity):
    """Stands in for a module another pipeline stage owns: no parameters, never called."""


class LlamaModel(nn.Module):
    def __init__(self, config: Any, biases: tuple[bool, bool], quant: QuantConfig | None = None) -> None:
        super().__init__()
        # Under pipeline parallelism this stage builds only layers [start, end), the first stage the
        # embedding and the last the final norm; the others are parameterless placeholders.
        self.start_layer, self.end_layer = stage_layers(config.num_hidden_layers)
        self.first, self.last = is_first_stage(), is_last_stage()
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size) if self.first
                             else PPMissingLayer())
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # [max_position, head_dim] in float32: 64 MiB at 131k positions, so built once, not per layer.
        rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings, rope_parameters(config))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, biases, rotary_emb, quant) if self.start_layer <= i < self.end_layer
            else PPMissingLayer() for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.last else PPMissingLayer()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The last stage returns hidden [T, E]; an earlier one (hidden, residual) for the next stage,
        which passes them as `intermediate`."""
        if self.first:
            x, residual = self.embed_tokens(input_ids), None  # [T, E]
        else:
            x, residual = intermediate
        for layer in self.layers[self.start_layer : self.end_layer]:
            x, residual = layer(positions, x, residual)
        if not self.last:
            return x, residual
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our merged parameter fragment, shard id)
    stacked_params = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Any, enable_expert_parallel: bool = False, quantization: str | None = None) -> None:
        # Every model class takes the model options load_model passes; a dense model has no experts to split.
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.attention_biases(config), fp8_config(config, quantization))
        self.lm_head = (ParallelLMHead(config.vocab_size, config.hidden_size) if self.model.last
                        else PPMissingLayer())
        if config.tie_word_embeddings and self.model.first and self.model.last:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o): Llama's `attention_bias` sets both."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.model(input_ids, positions, intermediate)  # [T] -> hidden [T, E]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)  # [N, E] -> [N, V]

    def _int4_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """An AWQ / GPTQ checkpoint: int4 tensors of int4 layers pass as shipped, the others (every layer
        under --quantization none) are dequantized (loader/int4.py)."""
        from deepserve.loader.checkpoint import stacked_name
        from deepserve.loader.int4 import checkpoint_method, dequantize_int4_weights, int4_config

        method = checkpoint_method(self.config)
        if method not in ("awq", "gptq"):
            return weights
        params = dict(self.named_parameters())
        return dequantize_int4_weights(weights, int4_config(self.config, method),
                                       keep=lambda m: stacked_name(m + ".qweight", self.stacked_params)[0] in params)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from deepserve.loader.checkpoint import load_named_weights, stacked_name, stage_weights
        from deepserve.loader.fp8 import SCALE_SUFFIX, dequantize_fp8_weights, fp8_block_size

        m, tied = self.model, self.config.tie_word_embeddings
        split_head = tied and m.last and not m.first  # the last stage's head: its own copy of the embedding
        skip = ("rotary_emb.inv_freq",) + (("lm_head.weight",) if tied and not split_head else ())
        if split_head:
            weights = ((("lm_head.weight" if n == "model.embed_tokens.weight" else n), t) for n, t in weights)
        weights = stage_weights(weights, m.start_layer, m.end_layer, {
            "model.embed_tokens.": m.first, "model.norm.": m.last, "lm_head.": m.last})
        block = fp8_block_size(self.config)
        if block is not None:  # an FP8 checkpoint: as shipped into FP8 parameters, dequantized into others
            params = dict(self.named_parameters())
            weights = dequantize_fp8_weights(
                weights, block, keep=lambda n: stacked_name(n, self.stacked_params)[0] + SCALE_SUFFIX in params)
        weights = self._int4_weights(weights)
        return load_named_weights(self, weights, self.stacked_params, skip)
