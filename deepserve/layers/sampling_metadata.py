"""SamplingMetadata: one step's per-row sampling parameters as device tensors.

Built once per step from the scheduled requests; the Sampler reads it and never looks at
SamplingParams. A field left as None (or a flag left False) means no row needs that stage,
which is how the Sampler skips work: no sort without top-k/top-p, no count tensors without
penalties, no argmax when every row samples, no per-row generators without seeds.
"""

from __future__ import annotations

import ctypes
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from deepserve.sampling_params import SamplingParams

_MASK64 = 2**64 - 1


@dataclass
class SamplingMetadata:
    greedy: torch.Tensor  # [B] bool
    # 1.0 on greedy rows, so dividing the whole batch by it never divides by ~0.
    temperature: torch.Tensor  # [B] float32
    all_greedy: bool
    all_random: bool
    # Filters. Greedy rows and rows that disable a filter carry its neutral value.
    top_k: torch.Tensor | None = None  # [B] int64 in [1, V]; V keeps everything
    max_top_k: int = 0  # max of top_k, known on the host so top-k needs no device sync
    top_p: torch.Tensor | None = None  # [B] float32; 1.0 keeps everything
    min_p: torch.Tensor | None = None  # [B] float32; 0.0 keeps everything
    # Penalties: these five are all set together, or all None.
    repetition_penalty: torch.Tensor | None = None  # [B] float32
    frequency_penalty: torch.Tensor | None = None  # [B] float32
    presence_penalty: torch.Tensor | None = None  # [B] float32
    prompt_mask: torch.Tensor | None = None  # [B, V] bool, token occurs in the prompt
    output_counts: torch.Tensor | None = None  # [B, V] float32, occurrences in the output
    # (row ids, token ids) that min_tokens forbids this step.
    min_tokens_index: tuple[torch.Tensor, torch.Tensor] | None = None  # [M] int64 each
    # logit_bias: (row ids [N] int64, token ids [N] int64, biases [N] float32); None when no row has one.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Seeded random rows only: row -> generator seeded from (seed, number of output tokens).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # Top logprobs to return per row (max over rows, clamped to V); None: no row wants logprobs.
    max_num_logprobs: int | None = None
    # Structured output: bit v of row b's words set = token v allowed (engine/grammar.py); rows without a
    # grammar are all ones. None when no row has a grammar: nothing allocated, nothing launched.
    allowed_token_bitmask: torch.Tensor | None = None  # [B, ceil(V / 32)] int32

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        eos_token_ids: list[frozenset[int]],
        vocab_size: int,
        device: torch.device,
        request_keys: list[int] | None = None,
        history: PenaltyHistory | None = None,
        grammar_bitmask: bytes | bytearray | MaskSlot | None = None,
        penalties: bool = True,
    ) -> SamplingMetadata:
        """`history` (with the rows' `request_keys`, Request.serial) keeps the penalties' token counts on
        the device from step to step (the model runner holds one); without it they are built from scratch.
        penalties=False leaves them for set_verify_penalties (speculative decoding's verify rows)."""
        greedy = [p.greedy for p in params]
        # Greedy rows ignore temperature and the filters: they get the neutral values.
        rnd = [None if g else p for p, g in zip(params, greedy, strict=True)]
        temperature = [1.0 if p is None else p.temperature for p in rnd]
        top_k = [p.top_k if p is not None and 0 < p.top_k < vocab_size else vocab_size for p in rnd]
        top_p = [1.0 if p is None else p.top_p for p in rnd]
        min_p = [0.0 if p is None else p.min_p for p in rnd]
        meta = cls(
            greedy=_to(greedy, torch.bool, device),
            temperature=_f32(temperature, device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
        )
        if min(top_k, default=vocab_size) < vocab_size:
            meta.top_k = _to(top_k, torch.int64, device)
            meta.max_top_k = max(top_k)
        if min(top_p, default=1.0) < 1.0:
            meta.top_p = _f32(top_p, device)
        if max(min_p, default=0.0) > 0.0:
            meta.min_p = _f32(min_p, device)
        if penalties and any(p.has_penalties for p in params):
            if history is None or request_keys is None:
                history, request_keys = PenaltyHistory(vocab_size, device), list(range(len(params)))
            meta._set_penalties(params, prompt_token_ids, output_token_ids, request_keys, history, device)
        meta.min_tokens_index, meta.logit_bias = _token_edits(params, output_token_ids, eos_token_ids, vocab_size,
                                                              device)
        for i, (p, out) in enumerate(zip(rnd, output_token_ids, strict=True)):
            if p is not None and p.seed is not None:
                gen = torch.Generator(device=device)
                gen.manual_seed(row_seed(p.seed, len(out)))
                meta.generators[i] = gen
        if grammar_bitmask is not None:
            meta.allowed_token_bitmask = bitmask_tensor(grammar_bitmask, len(params), vocab_size, device)
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        if wanted:
            meta.max_num_logprobs = min(max(wanted), vocab_size)
        return meta

    def set_verify_penalties(self, params: list[SamplingParams], request_keys: list[int],
                             prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
                             history: PenaltyHistory, row_request: list[int], row_drafts: list[list[int]]) -> None:
        """Penalties for a verify step's rows from the history, as a plain step reads them: the history's
        row of each of the step's requests (params, keys, prompts and kept outputs, one entry per request),
        repeated for each of its rows (row_request: the request's index), with the drafts before the row
        (row_drafts) counted on top in the row's copy only: the history holds kept tokens, never drafts."""
        device = history.device
        self._set_penalties(params, prompt_token_ids, output_token_ids, request_keys, history, device)  # [R, V]
        index = _to(row_request, torch.int64, device)
        for name in ("repetition_penalty", "frequency_penalty", "presence_penalty", "prompt_mask", "output_counts"):
            setattr(self, name, getattr(self, name).index_select(0, index))  # [S, ...] copies
        vocab = self.output_counts.shape[1]
        flat = [row * vocab + t for row, drafts in enumerate(row_drafts) for t in drafts]
        if flat:
            self.output_counts.view(-1).index_add_(0, _to(flat, torch.int64, device),
                                                   torch.ones(len(flat), device=device))

    def _set_penalties(
        self,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        request_keys: list[int],
        history: PenaltyHistory,
        device: torch.device,
    ) -> None:
        self.repetition_penalty = _f32([p.repetition_penalty for p in params], device)
        self.frequency_penalty = _f32([p.frequency_penalty for p in params], device)
        self.presence_penalty = _f32([p.presence_penalty for p in params], device)
        self.prompt_mask, self.output_counts = history.rows(params, request_keys, prompt_token_ids, output_token_ids)


class PenaltyHistory:
    """The token history the penalties read, kept on the device between steps: per request, a row
    saying which tokens its prompt holds (filled once) and a row counting each token of its output
    (each step adds only the tokens since its last step). Rebuilding both every step cost the host
    ~57 ms per step for 256 rows of 2,000 prompt tokens (measured on a 2-core CPU machine).

    Rows live in one [slots, V] buffer each; slot 0 stays zero and serves the rows that need no
    history (a prompt without repetition_penalty costs nothing). A request absent from a step is
    forgotten (its slot is reused) and rebuilt from its whole history if it comes back, so what a
    row holds never depends on what happened to other requests. Requests are keyed by Request.serial,
    never reused (a request_id may be, once its request has finished). The buffers grow by doubling,
    to at most max_rows slots (max_num_seqs + 1 is all a step can use): 5 bytes per vocabulary entry
    and slot, allocated only once a request asks for a penalty.
    """

    def __init__(self, vocab_size: int, device: torch.device, max_rows: int | None = None) -> None:
        self.vocab_size, self.device, self.max_rows = vocab_size, device, max_rows
        self.slot_of: dict[Hashable, int] = {}
        self.counted: dict[Hashable, int] = {}  # output tokens already in the request's counts row
        self.free: list[int] = []
        self.prompt_mask = torch.zeros(1, vocab_size, dtype=torch.bool, device=device)  # [slots, V]
        self.output_counts = torch.zeros(1, vocab_size, dtype=torch.float32, device=device)  # [slots, V]

    def rows(self, params: list[SamplingParams], request_ids: list[Hashable], prompt_token_ids: list[list[int]],
             output_token_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's [B, V] prompt mask (bool) and output counts (float32), row by row."""
        wanted = {rid: p for rid, p in zip(request_ids, params, strict=True) if p.has_penalties}
        lengths = dict(zip(request_ids, map(len, output_token_ids), strict=True))
        # Forget the absent, and any whose output shrank (never expected: then rebuild, not guess).
        for rid in [r for r in self.slot_of if r not in wanted or self.counted[r] > lengths[r]]:
            self.free.append(self.slot_of.pop(rid))
            del self.counted[rid]
        fresh = [rid for rid in wanted if rid not in self.slot_of]
        self._assign(fresh)
        mask_pos: list[int] = []  # flat slot * V + token positions to set / to count
        count_pos: list[int] = []
        for rid, prompt, output in zip(request_ids, prompt_token_ids, output_token_ids, strict=True):
            p = wanted.get(rid)
            if p is None:
                continue
            base = self.slot_of[rid] * self.vocab_size
            if rid in fresh and p.repetition_penalty != 1.0:
                mask_pos += [base + t for t in prompt]
            start, end = self.counted[rid], len(output)
            while end > start and output[end - 1] < 0:  # a placeholder (async scheduling) is counted once known
                end -= 1
            count_pos += [base + t for t in output[start:end]]
            self.counted[rid] = end
        if mask_pos:
            self.prompt_mask.view(-1)[_to(mask_pos, torch.int64, self.device)] = True
        if count_pos:
            positions = _to(count_pos, torch.int64, self.device)
            self.output_counts.view(-1).index_add_(0, positions, torch.ones(len(count_pos), device=self.device))
        slots = _to([self.slot_of.get(rid, 0) for rid in request_ids], torch.int64, self.device)  # 0: no history
        return self.prompt_mask.index_select(0, slots), self.output_counts.index_select(0, slots)

    def _assign(self, request_ids: list[Hashable]) -> None:
        """Give each request a zeroed slot, growing the buffers (doubling, up to max_rows) when none is free."""
        short = len(request_ids) - len(self.free)
        if short > 0:
            old = self.prompt_mask.shape[0]
            new = max(old + short, min(2 * old, self.max_rows or 2 * old))
            self.prompt_mask = torch.cat([self.prompt_mask, self.prompt_mask.new_zeros(new - old, self.vocab_size)])
            self.output_counts = torch.cat([self.output_counts,
                                            self.output_counts.new_zeros(new - old, self.vocab_size)])
            self.free += range(old, new)
        taken = [self.free.pop() for _ in request_ids]
        if taken:
            index = _to(taken, torch.int64, self.device)
            self.prompt_mask[index] = False
            self.output_counts[index] = 0.0
        for rid, slot in zip(request_ids, taken, strict=True):
            self.slot_of[rid], self.counted[rid] = slot, 0


def bitmask_tensor(data: bytes | bytearray | MaskSlot, rows: int, vocab_size: int,
                   device: torch.device) -> torch.Tensor:
    """The engine's mask bytes (little-endian 32-bit words, row after row) as int32 [rows, ceil(V / 32)]; a
    bytearray (what the engine builds) is viewed, not copied; a MaskSlot is copied out of its slot."""
    words = (vocab_size + 31) // 32
    size = data.view.numel() if isinstance(data, MaskSlot) else len(data)
    if size != rows * words * 4:
        raise ValueError(f"grammar bitmask has {size} bytes, expected {rows} rows x {words} words x 4")
    if isinstance(data, MaskSlot):
        host = data.view.view(torch.int32).view(rows, words)
        if device.type != "cuda":
            return host.clone()  # the slot is handed out again: the step keeps its own copy
        out = host.to(device, non_blocking=True)  # pinned: queued, the host goes on at once
        data.owner.copied(data, device)
        return out
    host = torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=torch.int32)
    host = host.view(rows, words)
    # From pageable memory the copy may hold the host until the forward queued before it ends: up to 159 ms
    # in a prefill step of W1 with a schema on one H200 (bench/step_trace.py); MaskBuffers avoids it.
    return host.to(device, non_blocking=True) if device.type == "cuda" else host


@dataclass
class MaskSlot:
    """One step's masks in a slot of `owner`: a uint8 view of the slot's memory."""

    view: torch.Tensor
    owner: MaskBuffers
    index: int

    @property
    def address(self) -> int:  # where llguidance writes the rows
        return self.view.data_ptr()


class MaskBuffers:
    """Pinned host buffers that one engine's structured-output masks are filled into
    (DEEPSERVE_PINNED_GRAMMAR_MASKS), used in turn: a copy from pinned memory is queued without the host
    waiting, where one from pageable memory may wait for the forward queued before it. A slot is handed
    out again only after the copy out of it has run (its event): an engine holds at most two slots at once
    (a step's being filled, the step before's being copied), so with four that copy ended steps before and
    the wait is a formality. Both calls come from the engine's own thread (the rows are chosen there even
    when the fill runs beside it, DEEPSERVE_GRAMMAR_OVERLAP), so no lock. Slots start at `initial_bytes`
    (the largest batch's masks) so none is allocated inside a step, and grow if a step needs more (more
    sampling rows than sequences: drafts)."""

    def __init__(self, slots: int = 4, initial_bytes: int = 0) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._initial = initial_bytes
        self._next = 0

    def take(self, num_bytes: int) -> MaskSlot:
        """The next slot's first num_bytes, every bit set (a row nobody fills allows everything)."""
        index, self._next = self._next, (self._next + 1) % len(self._buffers)
        event, self._events[index] = self._events[index], None
        if event is not None:
            event.synchronize()
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < num_bytes:
            size = max(num_bytes, self._initial)
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            self._buffers[index] = buffer
        view = buffer[:num_bytes]
        ctypes.memset(view.data_ptr(), 0xFF, num_bytes)  # one thread: a torch fill_ may wake its OpenMP pool
        return MaskSlot(view, self, index)

    def copied(self, slot: MaskSlot, device: torch.device) -> None:
        """The copy out of `slot` was just queued on `device`'s current stream: the slot waits for it."""
        if slot.owner is not self:
            raise ValueError("a mask slot was reported to buffers it does not belong to")
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self._events[slot.index] = event


def row_seed(seed: int, num_output_tokens: int) -> int:
    """The generator seed for one seeded row at one step.

    It depends on nothing but the request's seed and how many tokens it has produced, so the
    draw is the same whatever else is in the batch, wherever the row sits, and after a
    recompute. Two rounds of the splitmix64 finaliser keep nearby (seed, step) pairs apart.
    """
    return _mix64(_mix64(seed & _MASK64) ^ num_output_tokens)


def _mix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _token_edits(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    eos_token_ids: list[frozenset[int]],
    vocab_size: int,
    device: torch.device,
) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """The rows' edits to single tokens' logits, in one pass over the rows (a step without either pays that
    pass only): (rows, stop tokens) min_tokens forbids, and (rows, tokens, biases) of logit_bias."""
    # Like vLLM, eos is masked too when ignore_eos is set: min_tokens forbids every stop token.
    rows: list[int] = []
    cols: list[int] = []
    biased: list[int] = []
    for i, (p, out, eos) in enumerate(zip(params, output_token_ids, eos_token_ids, strict=True)):
        if len(out) < p.min_tokens:
            stops = sorted(t for t in eos.union(p.stop_token_ids) if t < vocab_size)
            rows += [i] * len(stops)
            cols += stops
        if p.logit_bias:
            biased.append(i)
    min_tokens = (_to(rows, torch.int64, device), _to(cols, torch.int64, device)) if rows else None
    return min_tokens, _logit_bias_entries(params, biased, device) if biased else None


def _logit_bias_entries(params: list[SamplingParams], biased: list[int],
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row ids, token ids, biases) of the biased rows, from each request's tensors made once (_bias_tensors):
    a step costs a concatenation, not a Python loop over up to 1,024 entries a request."""
    parts = [_bias_tensors(params[i]) for i in biased]
    tokens = torch.cat([t for t, _ in parts])
    biases = torch.cat([b for _, b in parts])
    rows = torch.repeat_interleave(torch.tensor(biased, dtype=torch.int64),
                                   torch.tensor([len(t) for t, _ in parts], dtype=torch.int64))
    if device.type != "cuda":
        return rows, tokens, biases
    return tuple(x.to(device, non_blocking=True) for x in (rows, tokens, biases))  # as _to: no wait on the device


def _bias_tensors(p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """p.logit_bias as host tensors (token ids int64, biases float32), kept on p for its next steps; made anew
    if p.logit_bias was replaced. The engine's p is the request's own (InputProcessor clones a biased request's
    params), so no caller edits the dict behind the tensors."""
    cached = getattr(p, "_logit_bias_tensors", None)
    if cached is None or cached[0] is not p.logit_bias:
        tokens = torch.tensor(list(p.logit_bias), dtype=torch.int64)
        biases = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
        cached = (p.logit_bias, tokens, biases)
        p._logit_bias_tensors = cached
    return cached[1], cached[2]


def _f32(values: list[float], device: torch.device) -> torch.Tensor:
    return _to(values, torch.float32, device)


def _to(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Built on the host, then copied without blocking: `torch.tensor(..., device="cuda")` would wait
    # for the whole forward pass queued before it, so the sampler could not be queued behind it.
    host = torch.tensor(values, dtype=dtype)
    return host.to(device, non_blocking=True) if device.type == "cuda" else host
