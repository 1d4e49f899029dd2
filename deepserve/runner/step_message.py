"""The one message rank 0 sends the tensor-parallel workers each step, and its inverse.

A worker runs the same `prepare_inputs` and forward as rank 0, so it needs of each scheduled
request only what those read: the new tokens (not the whole sequence), the block table, the sizes
that decide sampling rows, and — only for the rare prompt-logprobs request — the prompt. The
message is plain lists, ints and strs, sent with torch.distributed's own object broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepserve.engine.request import ScheduledRequest, SchedulerOutput


def describe_step(out: SchedulerOutput) -> dict[str, Any]:
    return {"op": "step", "reqs": [_describe(s) for s in out.scheduled]}


def _describe(sched: ScheduledRequest) -> dict[str, Any]:
    r, start = sched.request, sched.start
    d = {
        "id": r.request_id, "start": start, "n": sched.num_new_tokens,
        "tokens": r.token_ids[start : start + sched.num_new_tokens], "blocks": r.block_ids,
        "num_tokens": r.num_tokens, "num_prompt": r.num_prompt_tokens,
    }
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
        scheduled.append(ScheduledRequest(request, d["n"], d["start"]))  # type: ignore[arg-type]
    return SchedulerOutput(scheduled)
