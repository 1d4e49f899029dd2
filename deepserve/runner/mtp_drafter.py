"""DeepSeek's MTP layer as a speculative-decoding draft (models/deepseek_v2.py: MultiTokenPredictor).

After each step, once its tokens are on the host, the drafter:
1. runs the MTP module over every position the step computed and kept (a verify step's last token and
   accepted drafts; every token of a prefill chunk or decode step): at position p, the embedding of the
   token at p + 1 with the main model's hidden state at p. This writes the module's own KV cache at
   those positions (in the request's blocks, beside the main model's layers), so later positions can
   attend to them; at a request's last position, it gives the first draft (argmax: a point-mass draft,
   which the rejection sampler's acceptance rule assumes);
2. chains k - 1 more depths one position at a time, each feeding the module's own output hidden state
   and the previous draft, their KV written in the `lookahead` slots the scheduler reserved (rewritten
   by step 1 of a later step before anything reads them).
The drafts go back to the scheduler in RunnerOutput.draft_token_ids; they change only how many tokens a
step keeps, never which (verification decides). So where the draft's cache is only approximately right,
only the acceptance rate suffers: a prefix-cache hit shares a block whose last position's draft KV was
computed with the token that followed it in the request that filled it.
"""

from __future__ import annotations

import torch
from torch import nn

from deepserve.engine.request import ScheduledRequest, SchedulerOutput
from deepserve.forward_context import forward_context
from deepserve.runner.input_batch import prepare_inputs
from deepserve.runner.step_message import TokenWindow


class _Positions:
    """What prepare_inputs reads of a request, for the MTP module's own pass: `tokens` at absolute
    positions start.. (each the token one ahead of its position), the request's blocks."""

    def __init__(self, start: int, tokens: list[int], block_ids: list[int]) -> None:
        self.token_ids = TokenWindow(start, tokens)
        self.block_ids = block_ids
        self.num_tokens = start + len(tokens)  # so the last position is the sampling row


class MtpDrafter:
    def __init__(self, model: nn.Module, num_speculative_tokens: int, block_size: int, max_model_len: int,
                 device: torch.device) -> None:
        self.model, self.k = model, num_speculative_tokens
        self.block_size, self.max_model_len, self.device = block_size, max_model_len, device

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput, hidden: torch.Tensor, sampled: list[list[int]]) -> list[list[int]]:
        """Drafts for each scheduled request (empty where the step sampled nothing). hidden [T, E] is the
        main model's output over the step's token rows; sampled the step's tokens per request."""
        passes, rows, drafting = [], [], []
        row = 0
        for i, sched in enumerate(out.scheduled):
            request, start, tokens = sched.request, sched.start, sampled[i]
            kept = len(tokens) if sched.spec_token_ids else sched.num_new_tokens  # positions whose KV stays
            # The token one ahead of each kept position: known ones, then this step's (a partial prefill
            # chunk's last position reads the next prompt token; a verify step's, its accepted drafts).
            ahead = (request.token_ids[start + 1: start + 1 + kept] + tokens)[:kept]
            passes.append(ScheduledRequest(_Positions(start, ahead, request.block_ids), kept, start))
            rows.extend(range(row, row + kept))
            row += sched.num_new_tokens
            if tokens:
                drafting.append(i)
        drafts: list[list[int]] = [[] for _ in out.scheduled]
        if not drafting:
            self._run(passes, hidden[torch.tensor(rows, device=hidden.device)])
            return drafts
        h, last = self._run(passes, hidden[torch.tensor(rows, device=hidden.device)])
        keep = torch.tensor(drafting, device=h.device)
        h = h[last[keep]]  # [R, E]: the module's hidden state at each drafting request's last position
        token = self.model.mtp_logits(h).argmax(dim=-1)  # [R]
        positions = [passes[i].start + passes[i].num_new_tokens for i in drafting]  # of the first draft
        chosen = [token]
        for depth in range(1, self.k):
            live = [j for j, p in enumerate(positions) if p + depth < self.max_model_len]
            if len(live) < len(positions):
                break  # a draft past the context is never verified; stop every chain here (rare)
            ids = chosen[-1].tolist()
            steps = [ScheduledRequest(_Positions(p + depth - 1, [t], out.scheduled[i].request.block_ids), 1,
                                      p + depth - 1) for p, t, i in zip(positions, ids, drafting, strict=True)]
            h, _ = self._run(steps, h)
            chosen.append(self.model.mtp_logits(h).argmax(dim=-1))
        table = torch.stack(chosen, dim=1).tolist()  # [R, depths]
        for i, row_drafts in zip(drafting, table, strict=True):
            drafts[i] = row_drafts
        return drafts

    def _run(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP module over these positions: (its hidden states [T, E], the last row of each sequence [B])."""
        inputs = prepare_inputs(SchedulerOutput(scheduled), self.block_size, self.device)
        with forward_context(inputs.attn):
            h = self.model.mtp_forward(inputs.input_ids, inputs.positions, hidden)
        return h, inputs.sample_rows
