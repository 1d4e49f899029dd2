"""DEEPSERVE_GRAMMAR_OVERLAP's correctness on this machine's device: the built-in demo model with async
scheduling, the same seeded structured-output requests with the switch off and on, one engine each; the
token ids must be equal, every completed JSON output must parse and carry the schema's keys, and the
switched engine must have filled most steps' masks beside its host work (a fill thread, sampling queued
later).
Exit code 1 on a mismatch.
    python bench/check_grammar_overlap.py          # GPU when there is one (the gate's switches suite)"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys

import torch

from deepserve import LLM, SamplingParams
from deepserve.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}


def requests() -> tuple[list[str], list[SamplingParams]]:
    as_json = StructuredOutputsParams(json=SCHEMA)
    prompts, params = [], []
    for i in range(48):  # a batch like a busy server's: constrained rows among plain ones
        prompts.append(f"request {i}:")
        if i % 4 == 3:
            params.append(SamplingParams(temperature=0.9, seed=i, max_tokens=48, ignore_eos=True))
        elif i % 4 == 2:
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=32, ignore_eos=True,
                                         structured_outputs=StructuredOutputsParams(regex="[a-d]{3,}")))
        else:
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=160, structured_outputs=as_json))
    return prompts, params


def run(overlap: bool) -> tuple[list, object, str]:
    """The outputs and the engine's GrammarTiming; the engine is gone when this returns (a second one in
    the process would otherwise find the first one's KV cache taking the GPU's memory)."""
    os.environ["DEEPSERVE_GRAMMAR_OVERLAP"] = "1" if overlap else "0"
    llm = LLM(async_scheduling=True, max_model_len=512, num_gpu_blocks_override=512)
    assert llm.llm_engine.core.grammar_overlap == overlap
    outputs, timing = llm.generate(*requests(), use_tqdm=False), llm.llm_engine.core.grammar_timing
    device = llm.llm_engine.config.model.device
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return outputs, timing, device


def main() -> int:
    before = os.environ.get("DEEPSERVE_GRAMMAR_OVERLAP")
    try:
        off, _, _ = run(False)
        on, timing, device = run(True)
    finally:
        os.environ.pop("DEEPSERVE_GRAMMAR_OVERLAP", None)
        if before is not None:
            os.environ["DEEPSERVE_GRAMMAR_OVERLAP"] = before
    _, params = requests()
    equal = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(off, on, strict=True))
    bad = []
    for i, (p, o) in enumerate(zip(params, on, strict=True)):
        so, c = p.structured_outputs, o.outputs[0]
        if so is not None and so.json is not None and c.finish_reason == "stop":
            value = json.loads(c.text)
            if not isinstance(value, dict) or set(value) != set(SCHEMA["required"]):
                bad.append(i)
        elif so is not None and so.regex is not None and not re.fullmatch("[a-d]*", c.text):
            bad.append(i)
    print(f"device {device}: {equal}/{len(on)} outputs equal with the switch off and on; "
          f"{len(bad)} invalid constrained outputs; {timing.steps} steps built masks, {timing.beside} beside the "
          f"engine's work, fill "
          f"{1e3 * timing.fill_s / max(timing.steps, 1):.2f} ms a step on its thread, the engine waited "
          f"{1e3 * timing.join_s / max(timing.steps, 1):.2f} ms a step for it")
    ok = equal == len(on) and not bad and timing.beside > timing.steps // 2
    print("grammar overlap = switch off:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    """No options: the check is fixed. Parsed anyway, so --help prints this usage instead of running the
    whole check (two engines), and a mistyped flag is an error rather than ignored."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args(sys.argv[1:])
    sys.exit(main())
