"""The benchmark workloads of BENCHMARKS.md, generated exactly as defined there."""

from __future__ import annotations

import random
from dataclasses import dataclass

from deepserve.sampling_params import SamplingParams, StructuredOutputsParams

W1_PROMPT_TOKENS = 142_827
W1_OUTPUT_TOKENS = 133_966


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    exact_output: bool = True  # every request makes exactly max_tokens tokens (ignore_eos, no grammar)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self) -> int:
        return sum(p.max_tokens for p in self.params)


def w1(num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024) -> Workload:
    """nano-vllm's offline workload: random token prompts of 100..1024, outputs of 100..1024, T=0.6.
    A maximum below 100 makes every length that maximum (a W1 shrunk for a CPU)."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(min(100, max_input_len), max_input_len))]
               for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True,
                             max_tokens=rng.randint(min(100, max_output_len), max_output_len))
              for _ in range(num_seqs)]
    workload = Workload("W1", prompts, params)
    if (num_seqs, max_input_len, max_output_len) == (256, 1024, 1024):
        assert workload.num_prompt_tokens == W1_PROMPT_TOKENS, "W1 prompt tokens differ from BENCHMARKS.md"
        assert workload.num_output_tokens == W1_OUTPUT_TOKENS, "W1 output tokens differ from BENCHMARKS.md"
    return workload


def fixed(input_len: int, output_len: int, num_requests: int, seed: int = 0) -> Workload:
    """W4's fixed-shape grid point: every request has the same prompt and output length."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(input_len)] for _ in range(num_requests)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len) for _ in range(num_requests)]
    return Workload(f"fixed-{input_len}-{output_len}", prompts, params)


def within_vocab(workload: Workload, vocab_size: int) -> Workload:
    """The workload for a model whose vocabulary is smaller than the ids BENCHMARKS.md draws (0..10,000):
    each id taken modulo vocab_size (the demo model has 1,011 tokens). Lengths, and so the token totals,
    stay the workload's; a vocabulary that holds every id (W1 draws up to 10,000 inclusive) gets the
    workload itself, so the benchmarks' W1 stays BENCHMARKS.md's."""
    if all(t < vocab_size for p in workload.prompts for t in p):
        return workload
    prompts = [[t % vocab_size for t in p] for p in workload.prompts]
    return Workload(workload.name, prompts, workload.params, workload.exact_output)


W4_GRID = [(128, 128, 3000), (1000, 1000, 1000), (2048, 128, 1000), (128, 2048, 500)]


# A schema no request completes early on its own: an open-ended array of records (strings, numbers and
# nested arrays exercise the lexer and the parser), so masks are computed at every step of every request.
BENCH_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 64},
                       "score": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["id", "name", "score", "tags"],
        "additionalProperties": False,
    },
}


def with_output_lengths(workload: Workload, lengths: list[int]) -> Workload:
    """The same prompts, unconstrained, each request making exactly lengths[i] tokens: a constrained run's
    work without its constraint. A grammar ends requests early (W1+json made 50,692 of W1's 133,966 output
    tokens on one H200), and fewer tokens per request alone lowers output tok/s (the prefill is the same,
    the batches thin out sooner), so structured output's cost is judged against this, not against W1."""
    if len(lengths) != len(workload.prompts) or min(lengths, default=1) < 1:
        raise ValueError("lengths must give each request of the workload at least one token")
    params = []
    for p, n in zip(workload.params, lengths, strict=True):
        q = p.clone()
        q.structured_outputs, q.max_tokens, q.ignore_eos = None, n, True
        params.append(q)
    return Workload(f"{workload.name}+lengths", workload.prompts, params)


def with_json_schema(workload: Workload) -> Workload:
    """The same prompts and lengths with BENCH_SCHEMA on every request (issue 19's cost target: W1 with a
    schema on every request within 10 % of W1). A request may still end early where the grammar completes
    (the closing bracket), so its tokens are counted, not assumed."""
    params = []
    for p in workload.params:
        q = p.clone()
        q.structured_outputs = StructuredOutputsParams(json=BENCH_SCHEMA)
        params.append(q)
    return Workload(f"{workload.name}+json", workload.prompts, params, exact_output=False)
