"""Vocab-parallel token embedding and LM head: each rank holds a contiguous slice of the vocab
(padded so every rank's slice has the same size)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepserve.distributed.parallel_state import get_tp_rank, get_tp_world_size, tp_all_gather_last_dim, tp_all_reduce


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"embedding has {loaded.shape[0]} rows, config.vocab_size is {self.vocab_size}")
        rows = loaded[self.vocab_start : self.vocab_start + self.per_rank]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        owned = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * owned.unsqueeze(-1)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> logits [N, vocab_size]
        logits = tp_all_gather_last_dim(F.linear(hidden, self.weight))
        return logits[:, : self.vocab_size]
