"""The engine core's own host time per decode step, without a model: EngineCore (scheduler, stop rules,
outputs) over a runner that returns at once, so what is timed is what the step loop spends on the host
around the device's work (async scheduling hides it behind a decode step until it is longer than one;
structured output's masks come on top of it). Any machine; the H200's host is not this sandbox's.

    python bench/core_host_cost.py [--batch 256] [--prompt 1000] [--steps 200] [--profile]

Prints the mean ms per decode step (steady state: every request running) for schedule + launch bookkeeping
(commit) + collecting the step before (update_from_output, the outputs), and with --profile the top
functions by own time."""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import time

from deepserve.config import EngineArgs
from deepserve.engine.core import EngineCore, EngineCoreRequest
from deepserve.runner.model_runner import RunnerOutput
from deepserve.sampling_params import SamplingParams


@dataclasses.dataclass
class _Pending:
    out: object


class NullRunner:
    """Every sampling row gets token 7; nothing is computed. A request never stops before max_tokens."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def determine_num_blocks(self) -> int:
        return self.num_blocks

    def initialize_cache(self, num_blocks: int) -> None:
        pass

    def launch(self, out, previous=None) -> _Pending:
        return _Pending(out)

    def wait(self, pending: _Pending) -> RunnerOutput:
        return RunnerOutput([[7] * s.num_sampled for s in pending.out.scheduled])

    def finish_launch(self, pending) -> None:
        pass

    def execute(self, out) -> RunnerOutput:
        return self.wait(self.launch(out))


def build(batch: int, prompt: int, steps: int) -> EngineCore:
    """`batch` requests that are all still decoding after the prefills (up to 8 a step) and `steps` more."""
    block_size, max_tokens = 16, steps + batch + 64
    max_len = prompt + max_tokens + 16
    args = EngineArgs(device="cpu", block_size=block_size, max_model_len=max_len, async_scheduling=True,
                      max_num_seqs=batch, max_num_batched_tokens=max(8192, prompt))
    core = EngineCore(args.create_engine_config(), NullRunner(batch * (max_len // block_size + 2)))
    for i in range(batch):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        core.add_request(EngineCoreRequest(f"r{i}", [100 + (i * 7 + j) % 900 for j in range(prompt)], params,
                                           [2], 0.0))
    return core


def measure(batch: int, prompt: int, steps: int, profiler: cProfile.Profile | None = None) -> tuple[float, float]:
    """(ms of host time per decode step, tokens a step) over `steps` steps once every request is decoding."""
    core = build(batch, prompt, steps)
    while core.scheduler.waiting or len(core.scheduler.running) < batch:  # prefills, then all decode
        core.step()
    for _ in range(5):
        core.step()
    if profiler:
        profiler.enable()
    start = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        tokens += sum(len(o.new_token_ids) for o in core.step())
    elapsed = time.perf_counter() - start
    if profiler:
        profiler.disable()
    return 1e3 * elapsed / steps, tokens / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--profile", action="store_true")
    ns = parser.parse_args()
    profiler = cProfile.Profile() if ns.profile else None
    ms, tokens = measure(ns.batch, ns.prompt, ns.steps, profiler)
    print(f"batch {ns.batch}, prompt {ns.prompt}: {ms:.3f} ms of host time per decode step "
          f"({tokens:.0f} tokens a step{', under cProfile' if profiler else ''})")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
