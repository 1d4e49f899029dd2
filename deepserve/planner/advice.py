"""What would fit when a plan does not: more GPUs, FP8 or int4 weights, an fp8 KV cache, a shorter context — each
with numbers.

Every suggestion is a full re-plan with one setting changed, so its figures are as exact as the plan's.
"""

from __future__ import annotations

import dataclasses

from deepserve.planner.gpus import GIB

_TP_SIZES = (2, 4, 8)  # GPUs in one node; beyond 8, pipeline stages span nodes
_PP_SIZES = (2, 4, 8)
GPUS_PER_NODE = 8  # the node the advice assumes (an 8-GPU H100/H200 server)


def nodes_needed(num_gpus: int) -> int:
    """Nodes of GPUS_PER_NODE that num_gpus ranks take (--nnodes)."""
    return max(1, -(-num_gpus // GPUS_PER_NODE))


def advise(failed) -> list[dict]:
    from deepserve.planner.estimate import plan

    req = failed.request
    out: list[dict] = []
    more = _more_gpus(failed, plan)
    if more is not None:
        out.append(more)
    out += _quantized(failed, plan)
    if req.kv_cache_dtype not in ("fp8", "fp8_e4m3"):  # fp8_e5m2 too: the engine takes fp8 (e4m3) only
        alt = _try(plan, dataclasses.replace(req, kv_cache_dtype="fp8", max_model_len=failed.max_model_len))
        if _runs(alt):
            out.append(_entry("fp8 KV cache", "--kv-cache-dtype fp8", alt,
                              f"halves KV bytes per token to {alt.kv_bytes_per_token:,}"))
    if failed.kv_tokens >= req.block_size:
        shorter = failed.kv_tokens  # whole blocks, so exactly one sequence of this length fits
        out.append({"change": "shorter context", "flags": f"--max-model-len {shorter}", "num_gpus": failed.num_gpus,
                    "max_sequences": 1, "max_model_len": shorter,
                    "detail": f"{failed.kv_tokens:,} KV tokens fit per GPU: one sequence of {shorter:,} tokens"})
    else:
        out.append({"change": "shorter context", "flags": None, "num_gpus": failed.num_gpus, "max_sequences": 0,
                    "max_model_len": 0, "detail": "no context length helps: " + _why_no_context(failed)})
    if failed.fp8_dequantized:  # the planner's own --quantization none: every re-plan's serve line needs it too
        for entry in out:
            if entry["flags"] and "--quantization" not in entry["flags"]:
                entry["flags"] += " --quantization none"
    return out


def load_bound(p) -> bool:
    """No KV block though the budget has room for one: loading is over the budget (estimate.plan gives no
    blocks when the load peak is, e.g. --quantization fp8 holding the unquantized weights until converted)."""
    return p.num_blocks == 0 and p.kv_cache_bytes >= p.kv_bytes_per_token * p.request.block_size


def _why_no_context(failed) -> str:
    """Why no --max-model-len fits: the weights and activations alone are over the budget, or loading is
    (load_bound), or they leave less than a block."""
    used = f"weights {failed.weights_bytes / GIB:.1f} GiB + activations {failed.activation_bytes / GIB:.1f} GiB"
    budget = f"the {failed.budget_bytes / GIB:.1f} GiB budget"
    if failed.kv_cache_bytes < 0:
        return f"{used} are {-failed.kv_cache_bytes / GIB:.1f} GiB over {budget} before any KV cache"
    if load_bound(failed):
        return "loading the weights is over the budget whatever the context (see the note below)"
    return f"{used} leave {failed.kv_cache_bytes / GIB:.1f} GiB of {budget} for the KV cache, less than one block"


def _more_gpus(failed, plan) -> dict | None:
    """More tensor-parallel ranks in one node, then pipeline stages across nodes at the largest size in a
    node that the model divides by (28 heads: 4, not 8)."""
    from deepserve.distributed.layout import fitting_tp_sizes
    from deepserve.planner.shapes import resolve_model

    req = failed.request
    in_node = fitting_tp_sizes(resolve_model(req.model)[1], GPUS_PER_NODE, req.enable_expert_parallel)
    # At least the request's own size: it fits (plan checked it), so within a node it is in in_node.
    node_tp = req.tensor_parallel_size if req.tensor_parallel_size > GPUS_PER_NODE else max(in_node)
    candidates = [(tp, req.pipeline_parallel_size) for tp in _TP_SIZES
                  if tp > req.tensor_parallel_size and tp in in_node]
    candidates += [(node_tp, pp) for pp in _PP_SIZES if pp > req.pipeline_parallel_size]
    for tp, pp in candidates:
        alt = _try(plan, dataclasses.replace(req, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                             max_model_len=failed.max_model_len))
        if _runs(alt):
            flags = f"--tensor-parallel-size {tp}" + (f" --pipeline-parallel-size {pp}" if pp > 1 else "")
            nodes = nodes_needed(tp * pp)
            flags += f" --nnodes {nodes}" if nodes > 1 else ""
            where = "one node" if nodes == 1 else f"{nodes} nodes of {GPUS_PER_NODE} GPUs"
            return _entry("more GPUs", flags, alt, f"{tp * pp} GPUs ({where}); weights "
                          f"{alt.weights_bytes / GIB:.1f} GiB per GPU")
    return None


def _quantized(failed, plan) -> list[dict]:
    """Smaller weights on the same GPUs: FP8 quantized at load (a bf16 checkpoint on a GPU with FP8 tensor
    cores; elsewhere the re-plan is refused, so not advised), then an int4 (AWQ) build of the model, for an
    FP8 plan too. A preset's serve line takes --quantization awq (dummy int4 weights); a checkpoint on disk
    is served int4 only from an int4 checkpoint of the model, so that is what the advice names."""
    req = failed.request
    if failed.quantization in ("awq", "gptq") or req.quantization in ("awq", "gptq"):
        return []  # int4 already: nothing smaller to offer
    out = []
    if failed.quantization is None:  # an FP8 plan is FP8 already
        alt = _try(plan, dataclasses.replace(req, quantization="fp8", max_model_len=failed.max_model_len))
        if _runs(alt) and alt.quantization == "fp8":
            out.append(_entry("fp8 weights", "--quantization fp8", alt, "an FP8 checkpoint as shipped, a bf16 one "
                              f"quantized at load; weights {alt.weights_bytes / GIB:.1f} GiB per GPU"))
    alt = _try(plan, dataclasses.replace(req, quantization="awq", max_model_len=failed.max_model_len))
    if _runs(alt) and alt.quantization == "awq":
        out.append(_entry("int4 weights", "--quantization awq", alt, "needs an AWQ int4 build of the model (GPTQ: "
                          f"--quantization gptq); weights {alt.weights_bytes / GIB:.1f} GiB per GPU"))
    elif _runs_from_another_checkpoint(alt):
        out.append(_entry("int4 weights", None, alt, "an AWQ int4 checkpoint of this model would fit: serve that "
                          "folder instead (its quantization_config selects int4; GPTQ too); weights "
                          f"{alt.weights_bytes / GIB:.1f} GiB per GPU"))
    return out


def _runs(alt) -> bool:
    """A re-plan worth advising: it fits, and this engine version would take its serve line."""
    return alt is not None and alt.fits and not alt.engine_refuses


def _runs_from_another_checkpoint(alt) -> bool:
    """A re-plan that fits and that serve refuses only because the checkpoint on disk is not the int4 format
    asked for: an int4 checkpoint of the model would run it."""
    # the mismatch's note is its only one: any other refusal would stand with an int4 checkpoint too
    return alt is not None and alt.fits and alt.checkpoint_mismatch is not None and len(alt.warnings) == 1


def _try(plan, req):
    try:
        return plan(req, advise=False)
    except ValueError:  # e.g. heads not divisible by that tensor-parallel size
        return None


def _entry(change: str, flags: str | None, alt, detail: str) -> dict:
    return {"change": change, "flags": flags, "num_gpus": alt.num_gpus, "max_sequences": alt.max_sequences,
            "max_model_len": alt.max_model_len,
            "detail": f"{detail}; {alt.kv_tokens:,} KV tokens, {alt.max_sequences:,} sequences of "
                      f"{alt.max_model_len:,}"}
