"""The model's bytes per GPU rank, measured on the engine's own classes built on the meta device.

With tensor parallelism the layers shard themselves (ColumnParallelLinear, RowParallelLinear, the vocab
embedding, the routed experts) by asking torch.distributed for the world size, so we build them inside a
throw-away "fake" process group of that size: no memory, no devices, and the same divisibility errors
the engine would raise.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

_PRESET_ALIASES = {"deepseek-r1-distill-qwen-7b": "r1-distill-qwen-7b"}


@dataclass(frozen=True)
class ModelShape:
    """One tensor-parallel rank's share of the model, layer by layer (pipeline stages are cut from this)."""

    architecture: str
    num_params: int                # the whole model, counted at TP=1
    layer_weight_bytes: list[int]  # per decoder layer, this rank's parameters and buffers
    layer_kv_elems: list[int]      # per decoder layer, KV cache elements per token on this rank
    first_stage_bytes: int         # the embedding: lives on pipeline stage 0
    last_stage_bytes: int          # final norm, lm_head, shared rope tables: the last stage
    hidden_size: int
    vocab_size: int
    ffn_width: int                 # widest FFN intermediate per token on this rank (MoE: top_k × expert width)
    attn_width: int                # q + k + v (or MLA's q and latent) columns per token on this rank
    is_mla: bool
    max_position_embeddings: int
    # The loaders' refusal of a tensor-parallel shard that cuts an FP8 weight block (None: none is cut)
    fp8_shard_problem: str | None = None


def resolve_model(model: str) -> tuple[str, Any, bool]:
    """(display name, transformers config, is_preset) for a folder, a config.json path or a preset name."""
    from deepserve.loader.hf_config import load_hf_config
    from deepserve.loader.presets import PRESET_NAMES, preset_config

    if os.path.isfile(model):
        if os.path.basename(model) != "config.json":
            raise ValueError(f"{model!r} is a file but not a config.json; pass the checkpoint folder or its config")
        folder = os.path.dirname(os.path.abspath(model))
        return folder, load_hf_config(folder), False
    if os.path.isdir(model):
        return model, load_hf_config(model), False
    name = _PRESET_ALIASES.get(model.lower(), model.lower())
    if name in PRESET_NAMES:
        return name, preset_config(name), True
    raise ValueError(
        f"model {model!r} is neither a checkpoint folder, a config.json nor a preset; presets: "
        f"{', '.join(PRESET_NAMES)} (deepseek-r1-distill-qwen-7b is accepted for r1-distill-qwen-7b)"
    )


@contextlib.contextmanager
def _fake_tp_group(tp: int):
    import torch.distributed as dist

    if tp == 1:
        yield
        return
    if dist.is_initialized():
        raise RuntimeError("the planner builds its own tensor-parallel group; run it outside a distributed job")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(backend="fake", rank=0, world_size=tp, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _build_meta(hf_config: Any, dtype: torch.dtype, tp: int, quantization: str | None = None,
                expert_parallel: bool = False) -> tuple[nn.Module, str | None]:
    """The model on the meta device, and what the weight loaders would refuse (fp8_shard_problem)."""
    from deepserve.layers.quantization import quantize_after_loading
    from deepserve.models.registry import get_model_class

    model_class = get_model_class(hf_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with _fake_tp_group(tp), torch.device("meta"):
            model = model_class(hf_config, enable_expert_parallel=expert_parallel, quantization=quantization)
            problem = fp8_shard_problem(model)  # before the after-load fusions: the loaders see these layers
            quantize_after_loading(model)  # per-channel FP8 made at load: the bytes the engine ends with
            return model, problem
    finally:
        torch.set_default_dtype(previous)


def fp8_shard_problem(model: nn.Module) -> str | None:
    """The first FP8 weight block a tensor-parallel shard would cut, in the weight loaders' own words (their
    check, called here with rank 1's start): serve refuses such a checkpoint while loading it. Rank r's
    share starts at r × its size, so some rank cuts a block exactly when rank 1 does."""
    from deepserve.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, _whole_blocks
    from deepserve.layers.moe import RoutedExperts, expert_shard_blocks

    try:
        for m in model.modules():
            if getattr(m, "block", None) is None:
                continue
            bn, bk = m.block
            if isinstance(m, RoutedExperts) and m.inter_ranks > 1:
                for block in (bn, bk):  # w13's rows and w2's columns
                    expert_shard_blocks(m.inter, m.inter, block)
            elif isinstance(m, ColumnParallelLinear):
                for member, rows in enumerate(m.member_rows):
                    # QKVParallelLinear's k and v: replicated kv heads make fewer shards (its weight_loader)
                    shards = m.tp_size // m.kv_replicas if isinstance(m, QKVParallelLinear) and member else m.tp_size
                    if shards > 1:
                        _whole_blocks(rows, rows, bn, f"{type(m).__name__} output rows")
            elif isinstance(m, RowParallelLinear) and m.tp_size > 1:
                _whole_blocks(m.in_per_rank, m.in_per_rank, bk, f"{type(m).__name__} input columns")
    except ValueError as exc:
        return str(exc)
    return None


def _decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == num_layers]
    if not lists:
        raise ValueError(f"cannot find the {num_layers} decoder layers in {type(model).__name__}")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _layer_bytes(layers: nn.ModuleList) -> list[int]:
    # A tensor shared by several layers (DeepSeek-V2's one rope table) is allocated once: count it once.
    seen: set[int] = set()
    out = []
    for layer in layers:
        tensors = [t for t in [*layer.parameters(), *layer.buffers()] if id(t) not in seen]
        seen.update(id(t) for t in tensors)
        out.append(_bytes(tensors))
    return out


def _kv_elems(layer: nn.Module) -> int:
    # Exactly what ModelRunner allocates: each attention module's KV-cache spec, per token.
    modules = [m for m in layer.modules() if hasattr(m, "kv_cache_spec")]
    return sum(m.kv_cache_spec(torch.bfloat16).elements_per_token for m in modules)


@functools.lru_cache(maxsize=32)
def model_shape(model: str, dtype: str, tp: int, quantization: str | None = None,
                expert_parallel: bool = False) -> ModelShape:
    """quantization: the engine's resolved value (layers/quantization.resolve_quantization);
    expert_parallel: the routed experts whole, tp-th of them a rank (--enable-expert-parallel)."""
    _, hf_config, _ = resolve_model(model)
    built, fp8_problem = _build_meta(hf_config, getattr(torch, dtype), tp, quantization, expert_parallel)
    layers = _decoder_layers(built, hf_config.num_hidden_layers)
    in_layers = {id(t) for t in [*layers.parameters(), *layers.buffers()]}
    outside = [(n, t) for n, t in [*built.named_parameters(), *built.named_buffers()] if id(t) not in in_layers]
    first = _bytes(t for n, t in outside if "embed" in n)
    last = _bytes(t for n, t in outside if "embed" not in n)
    return ModelShape(
        architecture=type(built).__name__,
        num_params=(model_shape(model, dtype, 1, quantization).num_params if tp > 1
                    else sum(_weights_in(n, p) for n, p in built.named_parameters())),
        layer_weight_bytes=_layer_bytes(layers),
        layer_kv_elems=[_kv_elems(layer) for layer in layers],
        first_stage_bytes=first,
        last_stage_bytes=last,
        hidden_size=hf_config.hidden_size,
        vocab_size=hf_config.vocab_size,
        ffn_width=_ffn_width(hf_config) // tp,
        attn_width=_attn_width(hf_config, tp),
        is_mla=bool(getattr(hf_config, "kv_lora_rank", None)),
        max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", None) or 4096),
        fp8_shard_problem=fp8_problem,
    )


def _weights_in(name: str, param: torch.Tensor) -> int:
    """Model parameters a tensor holds: FP8 and int4 scales, zero points and g_idx are bytes, not
    parameters; an int4 qweight's int32 holds 32 / bits of them."""
    if name.endswith(("_scale_inv", "weight_scale", "scales", "qzeros", "g_idx")):
        return 0
    if name.endswith("qweight"):
        return param.numel() * (32 // param.quant_bits)
    return param.numel()


def _ffn_width(c: Any) -> int:
    dense = c.intermediate_size
    experts = getattr(c, "n_routed_experts", None)
    if not experts:
        return dense
    routed = c.num_experts_per_tok * c.moe_intermediate_size + (c.n_shared_experts or 0) * c.moe_intermediate_size
    return max(dense, routed)


def _attn_width(c: Any, tp: int) -> int:
    heads = c.num_attention_heads
    if getattr(c, "kv_lora_rank", None):
        q = heads * (c.qk_nope_head_dim + c.qk_rope_head_dim) // tp
        expanded = heads * (c.qk_nope_head_dim + c.v_head_dim) // tp  # prefill expands the latent to k_nope, v
        return q + c.kv_lora_rank + c.qk_rope_head_dim + expanded
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    return (heads // tp + 2 * max(1, kv_heads // tp)) * head_dim
