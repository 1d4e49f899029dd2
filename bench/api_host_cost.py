"""Host time per engine step on the serving path, on the CPU, for a batch of B streams (no model, no GPU).

What `deepserve serve` does with each step's outputs besides the forward itself:
- core: the engine core process packs the step's outputs into one message (core_process.encode);
  for reference, the same message with dataclasses.asdict's deep copy (what it did before);
- api decode: the API server unpacks it (decode + EngineCoreOutput.from_dict);
- output processor: detokenizes and builds each request's cumulative output (OutputProcessor.process);
- deltas + SSE: each stream's new text as an OpenAI chat chunk event (ChoiceTracker.advance + sse).
The engine core and the API server are one thread each: at saturation (W3) a step's share here adds to
the step's time whenever it exceeds what the GPU's step hides. Median over the steps of each phase.

    python bench/api_host_cost.py                          # the demo tokenizer, B = 256, 300 steps
    python bench/api_host_cost.py --tokenizer PATH --batch 256 --steps 600
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from deepserve.engine.core import EngineCoreOutput, EngineCoreRequest  # noqa: E402
from deepserve.engine.core_process import StepOutputs, decode, encode  # noqa: E402
from deepserve.engine.processors import OutputProcessor  # noqa: E402
from deepserve.sampling_params import SamplingParams  # noqa: E402
from deepserve.server import openai_format as f  # noqa: E402
from deepserve.server.httpio import sse  # noqa: E402


def deep_copy_encode(msg: StepOutputs) -> bytes:
    """The message as dataclasses.asdict packed it (the reference row)."""
    return msgpack.packb({"type": type(msg).__name__, **dataclasses.asdict(msg)}, use_bin_type=True)


def measure(tokenizer, batch: int, steps: int, prompt_len: int = 500) -> dict[str, float]:
    rng = random.Random(0)
    vocab = min(len(tokenizer), 30000)
    processor = OutputProcessor(tokenizer)
    trackers = {}
    for i in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        processor.add_request(f"r{i}", None, [EngineCoreRequest(f"0_r{i}", prompt, SamplingParams(max_tokens=steps),
                                                                [0], 0.0)])
        trackers[f"r{i}"] = f.ChoiceTracker(0, 0, False, None)
    base = f.envelope("chat.completion.chunk", "chatcmpl-x", "model")
    stats = {"num_running": batch, "num_waiting": 0, "kv_cache_usage": 0.5}
    times: dict[str, list[float]] = {k: [] for k in ("core", "core (asdict)", "api decode", "output processor",
                                                      "deltas + SSE")}
    for step in range(steps):
        finish = "length" if step == steps - 1 else None
        outputs = [EngineCoreOutput(f"0_r{i}", [rng.randrange(vocab)], finish) for i in range(batch)]
        t0 = time.perf_counter()
        frame = encode(StepOutputs([o.to_dict() for o in outputs], stats))
        t1 = time.perf_counter()
        deep_copy_encode(StepOutputs([dataclasses.asdict(o) for o in outputs], stats))
        t2 = time.perf_counter()
        received = [EngineCoreOutput.from_dict(d) for d in decode(frame[4:]).outputs]
        t3 = time.perf_counter()
        results, _ = processor.process(received)
        t4 = time.perf_counter()
        for out in results:
            delta = trackers[out.request_id].advance(out.outputs[0])
            if delta is not None:
                sse({**base, "choices": [f.chat_chunk_choice(delta, None)]})
        t5 = time.perf_counter()
        for key, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
            times[key].append(seconds)
    return {key: 1e3 * statistics.median(values) for key, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", help="a tokenizer folder (default: the built-in demo model's)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    ns = parser.parse_args()
    if ns.batch < 1 or ns.steps < 2:
        parser.error("--batch must be >= 1 and --steps >= 2")
    from deepserve.config import EngineArgs
    from deepserve.loader.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(ns.tokenizer or EngineArgs().model_path())
    result = measure(tokenizer, ns.batch, ns.steps)
    print(f"host ms per engine step, {ns.batch} streams, median of {ns.steps} steps")
    print("| phase | process | ms |\n|---|---|---|")
    for key, ms in result.items():
        where = "engine core" if key.startswith("core") else "API server"
        print(f"| {key} | {where} | {ms:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
