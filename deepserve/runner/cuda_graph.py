"""CUDA graphs for decode steps: the forward pass and the logits, captured once per padded batch size.

A decode step launches hundreds of small kernels; replaying a graph launches them in one go.
Every tensor the graph reads lives in a static buffer sized for the largest batch. A batch of B
sequences replays the graph of the smallest captured size >= B; the padding rows write their KV to
slot -1 (skipped) and have seq_len 0, so they read nothing and change nothing.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch
from torch import nn

from deepserve.forward_context import AttentionMetadata, forward_context
from deepserve.runner.input_batch import StepInputs, table_width

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(self, model: nn.Module, max_batch: int, max_model_len: int, block_size: int,
                 device: torch.device, keep_hidden: bool = False, lookahead: int = 0) -> None:
        """keep_hidden: also keep the hidden states [B, E] (the MTP draft reads them, `hidden`); lookahead:
        KV slots a request may hold past max_model_len (the MTP draft's), which widen the block tables."""
        self.model = model
        self.sizes = capture_sizes(max_batch)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.keep_hidden = keep_hidden
        # As wide as a step's table can be (same rounding), so eager steps and graphs share kernel variants.
        max_blocks = table_width(-(-(max_model_len + lookahead) // block_size))
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.hiddens: dict[int, torch.Tensor] = {}  # with keep_hidden
        self._last: tuple[int, int] = (0, 0)  # (graph size, rows) of the last replay

    def capture(self) -> None:
        start = time.perf_counter()
        logger.info("capturing %d decode CUDA graphs (batch sizes %d..%d)", len(self.sizes), min(self.sizes),
                    max(self.sizes))
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):  # largest first: later graphs reuse its memory pool
            self._forward(b)  # warm-up outside the graph: Triton compiles, allocator settles
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs in %.1f s", len(self.sizes), time.perf_counter() - start)

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=self.input_ids.device),
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            block_size=self.block_size,
            max_seq_len=self.max_model_len,  # fixed at capture: grids are sized for the longest sequence
            query_start_loc_cpu=list(range(b + 1)),
            seq_lens_cpu=[1] * b,
            decode_only=True,
        )
        with forward_context(meta):
            hidden = self.model(self.input_ids[:b], self.positions[:b])
        if self.keep_hidden:
            self.hiddens[b] = hidden  # [b, E]
        return self.model.compute_logits(hidden)  # [b, V]

    def release(self) -> None:
        """Free every graph. Under tensor parallelism this must happen before the NCCL process group is
        destroyed: a live graph that holds NCCL kernels keeps the communicator's resources, and
        destroying the group then waits forever (seen on 2 x H200, NCCL 2.28: bench/RESULTS.md run 12)."""
        torch.cuda.synchronize()
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.logits.clear()
        self.hiddens.clear()
        torch.cuda.synchronize()

    def can_run(self, inputs: StepInputs) -> bool:
        return inputs.attn.decode_only and inputs.attn.num_seqs <= self.sizes[-1]

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [B, V] of the step's B decoding sequences (every row, sampling or not)."""
        n = inputs.attn.num_seqs
        b = self.sizes[bisect.bisect_left(self.sizes, n)]
        attn = inputs.attn
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(attn.slot_mapping)
        self.seq_lens[:n].copy_(attn.seq_lens)
        self.block_tables[:n, : attn.block_tables.shape[1]].copy_(attn.block_tables)
        if b > n:  # padding rows: no KV write, nothing to read
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].zero_()
        self.graphs[b].replay()
        self._last = (b, n)
        return self.logits[b][:n]

    def hidden(self) -> torch.Tensor:
        """The last replay's hidden states [B, E] (keep_hidden only); overwritten by the next replay."""
        b, n = self._last
        return self.hiddens[b][:n]
