"""Which tensor_parallel_size a model can be split into, checked before any process starts.

Torch-free on purpose: `EngineConfig` calls it while validating, in the API server's process too.
The rules mirror what the layers slice: query heads, the MLP's and the experts' intermediate sizes
are split evenly; key/value heads are split evenly or, when there are fewer than ranks, replicated
(each kv head on tp / kv_heads ranks, as QKVParallelLinear does). The vocab need not divide: the
vocab-parallel embedding pads its last slice. Under expert parallelism the routed experts are split
instead of their intermediate size: n_routed_experts must divide, moe_intermediate_size need not.
"""

from __future__ import annotations

from typing import Any


def _split_sizes(hf_config: Any, expert_parallel: bool = False) -> dict[str, int]:
    """config.json field -> the size every rank must get an equal share of."""
    sizes = {"num_attention_heads": hf_config.num_attention_heads}
    if getattr(hf_config, "intermediate_size", None):
        sizes["intermediate_size"] = hf_config.intermediate_size
    moe_inter = getattr(hf_config, "moe_intermediate_size", None)
    if not getattr(hf_config, "n_routed_experts", None) or not moe_inter:
        return sizes  # a dense model may carry the field without using it
    if not expert_parallel:
        sizes["moe_intermediate_size"] = moe_inter
        return sizes
    # Routed experts stay whole, one rank each; the shared experts (one MLP n_shared_experts times as
    # wide) stay tensor-parallel.
    sizes["n_routed_experts"] = hf_config.n_routed_experts
    shared = moe_inter * (getattr(hf_config, "n_shared_experts", 0) or 0)
    if shared:
        sizes["moe_intermediate_size * n_shared_experts"] = shared
    return sizes


def _kv_heads(hf_config: Any) -> int:
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


def tp_problems(hf_config: Any, tp: int, expert_parallel: bool = False) -> list[str]:
    """Why `tp` does not fit this model, one line per field; empty when it fits."""
    problems = [f"{name} ({size}) is not divisible by tensor_parallel_size ({tp})"
                + (" (--enable-expert-parallel splits the routed experts across ranks)"
                   if name == "n_routed_experts" else "")
                for name, size in _split_sizes(hf_config, expert_parallel).items() if size % tp]
    kv = _kv_heads(hf_config)
    if kv % tp and tp % kv:
        problems.append(f"num_key_value_heads ({kv}) is neither divisible by nor a divisor of "
                        f"tensor_parallel_size ({tp}), so kv heads can be neither split nor replicated evenly")
    return problems


def fitting_tp_sizes(hf_config: Any, limit: int = 64, expert_parallel: bool = False) -> list[int]:
    return [t for t in range(1, limit + 1) if not tp_problems(hf_config, t, expert_parallel)]


def check_tp_divides(hf_config: Any, tp: int, expert_parallel: bool = False) -> None:
    problems = tp_problems(hf_config, tp, expert_parallel)
    if problems:
        fits = ", ".join(map(str, fitting_tp_sizes(hf_config, expert_parallel=expert_parallel)))
        raise ValueError(f"--tensor-parallel-size {tp} does not fit this model: {'; '.join(problems)}. "
                         f"Sizes that fit: {fits}")


def pp_problems(hf_config: Any, pp: int) -> list[str]:
    """Why `pp` pipeline stages do not fit this model: every stage needs at least one decoder layer."""
    layers = hf_config.num_hidden_layers
    if layers < pp:
        return [f"num_hidden_layers ({layers}) is less than pipeline_parallel_size ({pp}): every stage needs "
                "at least one layer"]
    return []


def check_pp_fits(hf_config: Any, pp: int) -> None:
    problems = pp_problems(hf_config, pp)
    if problems:
        raise ValueError(f"--pipeline-parallel-size {pp} does not fit this model: {'; '.join(problems)}. "
                         f"Sizes that fit: 1..{hf_config.num_hidden_layers}")
