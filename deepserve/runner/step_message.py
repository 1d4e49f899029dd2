"""What rank 0 sends the other ranks, and how: the engine config once, then one command per step.

A worker runs the same `prepare_inputs` and forward as rank 0, so it needs of each scheduled
request only what those read: the new tokens (not the whole sequence), the block table, the sizes
that decide sampling rows, and — only for the rare prompt-logprobs request — the prompt. Every
message is plain dicts, lists, ints, floats and strs, framed with msgpack (as the engine socket is)
and broadcast as a byte tensor over the host-side group: no pickle crosses a process boundary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from deepserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from deepserve.engine.request import ScheduledRequest, SchedulerOutput


def broadcast_message(msg: Any, group: Any) -> Any:
    """Rank 0 sends `msg` (msgpack-able), every other rank passes None and gets it; two broadcasts on
    the host-side group `group`: the length, then the bytes."""
    is_sender = dist.get_rank() == 0
    payload = msgpack.packb(msg, use_bin_type=True) if is_sender else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if is_sender
            else torch.empty(int(size), dtype=torch.uint8))
    dist.broadcast(data, src=0, group=group)
    return msg if is_sender else msgpack.unpackb(data.numpy().tobytes(), raw=False, strict_map_key=False)


def config_to_message(config: EngineConfig) -> dict[str, Any]:
    """The EngineConfig as plain values: each part's fields, the model's hf_config as its dict."""
    model = dataclasses.asdict(dataclasses.replace(config.model, hf_config=None))
    model["hf_config"] = config.model.hf_config.to_dict()
    return {"model": model, "cache": dataclasses.asdict(config.cache),
            "scheduler": dataclasses.asdict(config.scheduler), "parallel": dataclasses.asdict(config.parallel),
            # Every rank builds the MTP draft's layer (its weights slice, its KV cache) and runs its forward.
            "speculative": None if config.speculative is None else dataclasses.asdict(config.speculative)}


def config_from_message(msg: dict[str, Any]) -> EngineConfig:
    from transformers import CONFIG_MAPPING

    from deepserve.config import SpeculativeConfig

    fields = dict(msg["model"]["hf_config"])
    # The class's defaults, then rank 0's values set as they are: no second validation, which overrides
    # applied on rank 0 (--hf-overrides num_hidden_layers, say, with Qwen2's layer_types) would fail.
    hf_config = CONFIG_MAPPING[fields.pop("model_type")]()
    hf_config.update(fields)
    model = ModelConfig(**{**msg["model"], "hf_config": hf_config})
    speculative = msg.get("speculative")
    return EngineConfig(model=model, cache=CacheConfig(**msg["cache"]), scheduler=SchedulerConfig(**msg["scheduler"]),
                        parallel=ParallelConfig(**msg["parallel"]),
                        speculative=None if speculative is None else SpeculativeConfig(**speculative))


def describe_step(out: SchedulerOutput, next_token: bool = False) -> dict[str, Any]:
    """next_token: each request's tokens also carry the one after the step's, where known (the MTP draft
    reads, at each position, the token one ahead: a partial prefill chunk's last position reads the
    next prompt token)."""
    msg = {"op": "step", "reqs": [_describe(s, next_token) for s in out.scheduled]}
    # Host-tier copies (--swap-space): every rank makes them in its own cache shard.
    if out.blocks_to_swap_out:
        msg["swap_out"] = out.blocks_to_swap_out
    if out.blocks_to_swap_in:
        msg["swap_in"] = out.blocks_to_swap_in
    return msg


def _describe(sched: ScheduledRequest, next_token: bool = False) -> dict[str, Any]:
    r, start = sched.request, sched.start
    d = {
        "id": r.request_id, "start": start, "n": sched.num_new_tokens,
        "tokens": r.token_ids[start : start + sched.num_new_tokens + next_token], "blocks": r.block_ids,
        "num_tokens": r.num_tokens, "num_prompt": r.num_prompt_tokens,
    }
    if sched.spec_token_ids:  # a verify step's drafts (the worker's forward reads them as inputs)
        d["spec"] = sched.spec_token_ids
    k = r.sampling_params.prompt_logprobs
    if k is not None:
        # The worker must compute the same prompt-logprob rows (their logits are all-gathered).
        d.update(prompt_logprobs=k, prompt=r.prompt_token_ids, prompt_done=len(r.prompt_logprobs))
    return d


class TokenWindow:
    """token_ids[start : start + n] that answers absolute positions, as Request.token_ids does."""

    def __init__(self, start: int, tokens: list[int]) -> None:
        self.start, self.tokens = start, tokens

    def __getitem__(self, key: int | slice) -> int | list[int]:
        if isinstance(key, slice):
            return self.tokens[key.start - self.start : key.stop - self.start]
        return self.tokens[key - self.start]


@dataclass
class WorkerParams:
    prompt_logprobs: int | None = None


@dataclass
class WorkerRequest:
    """The fields of `Request` that input preparation and the forward read, nothing else."""

    request_id: str
    token_ids: TokenWindow
    block_ids: list[int]
    num_tokens: int
    num_prompt_tokens: int
    sampling_params: WorkerParams
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[None] = field(default_factory=list)  # only its length (positions done) is read


def rebuild_step(msg: dict[str, Any]) -> SchedulerOutput:
    scheduled = []
    for d in msg["reqs"]:
        request = WorkerRequest(
            d["id"], TokenWindow(d["start"], d["tokens"]), d["blocks"], d["num_tokens"], d["num_prompt"],
            WorkerParams(d.get("prompt_logprobs")), d.get("prompt", []), [None] * d.get("prompt_done", 0),
        )
        scheduled.append(ScheduledRequest(request, d["n"], d["start"],  # type: ignore[arg-type]
                                          spec_token_ids=d.get("spec", [])))
    return SchedulerOutput(scheduled, blocks_to_swap_out=[tuple(p) for p in msg.get("swap_out", [])],
                           blocks_to_swap_in=[tuple(p) for p in msg.get("swap_in", [])],
                           num_draft_tokens=sum(len(s.spec_token_ids) for s in scheduled))
