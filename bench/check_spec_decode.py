"""Speculative decoding on one GPU (issue 18): n-gram W2 speedup, and the verify step's cost on the V3 slice.

1. ngram: W2 (one request at a time, 1,024 prompt tokens, 512 out, greedy) on DeepSeek-LLM-7B with dummy
   weights, without speculation and with {"method": "ngram", "num_speculative_tokens": 4}. The prompt is
   a random 256-token block repeated four times ("repeat this text"), so drafts come from the prompt;
   with dummy weights what the model outputs is not under our control, so the acceptance rate measured
   is printed beside the speedup (target: >= 1.8x TPOT at k = 4, BENCHMARKS.md). TPOT here is each
   request's (last token - first token) / (tokens - 1), median over requests: with speculation a step's
   tokens arrive together. Wrong result (exit 1): the greedy tokens with speculation differ from those
   without before the 32nd token (a later split is printed: bf16 GEMMs of 5 rows and of 1 row may round
   a near-tie differently).
2. verify / mtp: a V3 7-layer slice (bf16, dummy weights, num_hidden_layers 7; the MTP layer dummy too: with
   it, the gate's 8-layer slice did not fit one H200 — each bf16 MoE layer's experts are 22.5 GB — and the
   MTP engine ran out of memory at start-up),
   one request with a 1,024-token context: the time of a plain decode step against a verify step with
   k = 1, 2, 3 random drafts (the target's share), and, in an engine with {"method": "mtp"}, the same
   steps followed by the MTP draft's passes (what an MTP step costs), through the runner as the engine
   calls it (CUDA graphs when they apply; printed). Goal: <= 1.3x at k = 1. Then the speedup those times
   would give at acceptance rates 0.6-0.9 (DeepSeek-V3's published MTP range), E[tokens per step] x
   t_decode / t_step with i.i.d. acceptance: an estimate, not a measurement. Wrong result (exit 1): a
   verify step's first token differs from the decode step's at the same position, or the MTP engine's
   64 greedy tokens differ from the plain engine's before the 32nd — unless the reference's top-2 there
   are within TIE_NATS, the other token is one of them and the two runs' logprobs agree within DRIFT_NATS
   (printed as a near-tie: consistent with bf16 rounding, which on dummy weights, whose logits are nearly
   flat, meets such ties often; a fault that only nudges logits would look the same).

    python bench/check_spec_decode.py            # the H200 run, about 6 minutes (four engine start-ups)
    python bench/check_spec_decode.py --smoke    # CPU, the demo model, tiny lengths: checks the script

Each engine runs in its own process (two 7B engines do not fit one card's 0.9 utilisation together). JSON
to $OUT/spec_decode.json when OUT is set; the table comes last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

K_NGRAM = 4
VERIFY_KS = (1, 2, 3)
RATES = (0.6, 0.7, 0.8, 0.9)
MIN_SAME_TOKENS = 32
# A differing greedy token may be a near-tie when the other run's token is in the reference's top-2 within
# this many nats of its best: bf16 logits of a few units are spaced ~0.016 apart, and GEMMs of 1 row and of
# k+1 rows round differently. The H200 showed an exact tie (-9.8676 twice) and a 0.016 gap.
TIE_NATS = 0.02
# ...and only when the two runs agree elsewhere: the chosen tokens' logprobs before the split (MTP), or the
# first token's logprob in both steps (verify), differ by at most this (bf16 rounding; a wrong row does not).
DRIFT_NATS = 0.05
SLICE_LAYERS = 7  # 3 dense + 4 MoE layers, + the MTP layer (an MoE layer) in the MTP engine: ~117 GB in bf16


def repeat_prompt(rng: random.Random, input_len: int, vocab_size: int) -> list[int]:
    """A random block of input_len / 4 tokens, four times."""
    block = [rng.randint(0, min(vocab_size, 10001) - 1) for _ in range(max(1, input_len // 4))]
    return (block * 4)[:input_len]


def engine_kwargs(smoke: bool, model: str, layers: int | None = None) -> dict:
    if smoke:  # the demo model's shape (a tiny DeepSeek-V3 with an MTP layer), dummy weights, on CPU
        return dict(device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=512, load_format="dummy")
    kwargs = dict(model=model, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096)
    if layers:
        kwargs.update(hf_overrides={"num_hidden_layers": layers}, quantization="none")  # bf16 slice
    return kwargs


def part_ngram(smoke: bool, speculative: bool) -> dict:
    from deepserve import LLM, SamplingParams
    from deepserve.bench.latency import measure_latency

    spec = {"method": "ngram", "num_speculative_tokens": K_NGRAM} if speculative else None
    llm = LLM(**engine_kwargs(smoke, "deepseek-llm-7b"), speculative_config=spec)
    vocab = llm.llm_engine.config.model.hf_config.vocab_size
    input_len, output_len, warmups, iters = (64, 24, 1, 2) if smoke else (1024, 512, 2, 5)
    result = measure_latency(llm, input_len, output_len, warmups, iters, vocab_size=vocab, prompt_fn=repeat_prompt)
    prompt = repeat_prompt(random.Random(1), input_len, vocab)
    (out,) = llm.generate([{"prompt_token_ids": prompt}],
                          SamplingParams(temperature=0.0, max_tokens=min(128, output_len), ignore_eos=True),
                          use_tqdm=False)
    result["greedy_tokens"] = list(out.outputs[0].token_ids)
    return result


def part_verify(smoke: bool, mtp: bool) -> dict:
    """Step times on the V3 slice at a 1,024-token context: without a draft, a plain decode step and
    verify steps with k random drafts (the target's share); with the MTP draft (mtp=True), the same
    steps followed by the draft's own passes (what an MTP step costs). Plus 64 greedy tokens."""
    import torch

    from deepserve import LLM, SamplingParams
    from deepserve.engine.request import Request, ScheduledRequest, SchedulerOutput
    from deepserve.runner.input_batch import prepare_inputs

    spec = {"method": "mtp", "num_speculative_tokens": max(VERIFY_KS)} if mtp else None
    llm = LLM(**engine_kwargs(smoke, "deepseek-v3", layers=SLICE_LAYERS), speculative_config=spec)
    core = llm.llm_engine.core
    runner, blocks = core.runner, core.scheduler.block_manager
    context = 64 if smoke else 1024
    iters = 5 if smoke else 50
    rng = random.Random(0)
    vocab = llm.llm_engine.config.model.hf_config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(context)]
    # Each position's top-2 (the reference a differing MTP token is judged by) and the chosen token's
    # logprob (the two engines' agreement before a split: a fault in the verify rows moves it).
    (greedy,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=2), use_tqdm=False)
    completion = greedy.outputs[0]
    greedy_top2 = [top2_of(position) for position in completion.logprobs or []]
    greedy_logprobs = [round(position[token].logprob, 4)
                       for token, position in zip(completion.token_ids, completion.logprobs or [], strict=False)]
    request = Request("verify", prompt, SamplingParams(temperature=0.0))
    assert blocks.allocate_slots(request, context + 3 * max(VERIFY_KS) + 1)
    runner.execute(SchedulerOutput([ScheduledRequest(request, context, 0)]))  # the prefill
    request.num_computed_tokens = context
    request.append_output_token(rng.randrange(vocab))

    def step(k: int) -> SchedulerOutput:
        drafts = [rng.randrange(vocab) for _ in range(k)]
        return SchedulerOutput([ScheduledRequest(request, 1 + k, context, spec_token_ids=drafts)], num_draft_tokens=k)

    def timed(k: int) -> tuple[float, int, bool, list]:
        if runner.drafter is not None:
            runner.drafter.k = max(k, 1)  # the draft proposes as many tokens as the step verifies
        out = step(k)
        graphed = runner.graphs is not None and runner.graphs.can_run(prepare_inputs(out, runner.block_size,
                                                                                     runner.device))
        # Untimed, with the first row's top-2 logprobs: a first token that differs from the decode step's
        # is a near-tie flip (bf16 rounds a 1-row and a (k+1)-row step differently) when it is the decode
        # step's second choice and the decode step's margin is small.
        request.sampling_params.logprobs = 2
        result = runner.execute(out)
        request.sampling_params.logprobs = None
        first = result.sampled[0][0]
        top2 = [(token, round(lp, 4)) for token, lp, _ in result.logprobs[0][0][1:3]] if result.logprobs else []
        for _ in range(3):
            runner.execute(out)
        times = []
        for _ in range(iters):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            runner.execute(out)  # ends with the host reading the tokens (and, with MTP, drafting)
            times.append(time.perf_counter() - start)
        return statistics.median(times), first, graphed, top2

    rows = {}
    decode_s, decode_token, _, decode_top2 = timed(0)
    for k in (0, *VERIFY_KS):
        t, first, graphed, top2 = (decode_s, decode_token, None, decode_top2) if k == 0 else timed(k)
        rows[k] = {"ms": 1e3 * t, "graphed": graphed, "same_first_token": first == decode_token,
                   "first_token": first, "top2": top2}
    rows[0]["graphed"] = timed(0)[2]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "context": context, "steps": rows, "greedy_tokens": list(greedy.outputs[0].token_ids),
            "greedy_top2": greedy_top2, "greedy_logprobs": greedy_logprobs}


def top2_of(position: dict) -> list[tuple[int, float]]:
    """One position's logprobs dict -> its two most likely (token, logprob), best first."""
    ranked = sorted(position.items(), key=lambda item: -item[1].logprob)[:2]
    return [(token, round(entry.logprob, 4)) for token, entry in ranked]


def logprob_drift(reference: list[float], other: list[float], upto: int | None) -> float | None:
    """Largest |difference| of the chosen tokens' logprobs over the positions both runs agree on."""
    pairs = list(zip(reference, other, strict=False))[:upto]
    return max((abs(a - b) for a, b in pairs), default=None)


def step_drift(decode_top2: list, row_top2: list) -> float | None:
    """|difference| of the verify step's first token's logprob and the decode step's for that token."""
    if not row_top2:
        return None
    token, lp = row_top2[0]
    return next((abs(lp - ref) for t, ref in decode_top2 if int(t) == int(token)), None)


def is_near_tie(reference_top2: list, other_token: int, drift: float | None) -> bool:
    return near_tie(reference_top2, other_token) and drift is not None and drift <= DRIFT_NATS


def near_tie(reference_top2: list, other_token: int) -> bool:
    """True when `other_token` is in the reference's top-2 within TIE_NATS of its best logprob (with an
    exact tie the reference's sampled token may be listed second)."""
    if not reference_top2:
        return False
    best = max(lp for _, lp in reference_top2)
    return any(int(token) == int(other_token) and best - lp <= TIE_NATS for token, lp in reference_top2)


def estimated_speedup(ratio: float, k: int) -> dict[str, float]:
    """E[tokens per step] / (step time / plain decode step time), i.i.d. acceptance a per draft."""
    return {str(a): (1 - a ** (k + 1)) / (1 - a) / ratio for a in RATES}


def run_part(part: str, smoke: bool) -> dict:
    """One part in a fresh process; its JSON."""
    cmd = [sys.executable, __file__, "--part", part] + (["--smoke"] if smoke else [])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"part {part} failed with exit code {proc.returncode}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if os.environ.get("OUT"):  # each part as it ends: a later part's failure keeps the earlier ones
        Path(os.environ["OUT"], f"spec_decode-{part}.json").write_text(json.dumps(result))
    return result


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, the demo model, tiny lengths")
    parser.add_argument("--part", choices=["ngram-off", "ngram-on", "verify", "mtp"], help=argparse.SUPPRESS)
    parser.add_argument("--mtp-only", action="store_true",
                        help="only the V3 slice's verify and MTP parts (two engine start-ups instead of four)")
    ns = parser.parse_args()
    if ns.part:  # a child process: one part, its JSON on the last line
        if ns.part in ("verify", "mtp"):
            result = part_verify(ns.smoke, ns.part == "mtp")
        else:
            result = part_ngram(ns.smoke, ns.part == "ngram-on")
        print(json.dumps(result))
        return 0
    off = on = None
    if not ns.mtp_only:
        off, on = (run_part(p, ns.smoke) for p in ("ngram-off", "ngram-on"))
    verify, mtp = (run_part(p, ns.smoke) for p in ("verify", "mtp"))
    split = first_difference(off["greedy_tokens"], on["greedy_tokens"]) if off else None
    mtp_split = first_difference(verify["greedy_tokens"], mtp["greedy_tokens"])
    speedup = off["tpot_ms_per_request_median"] / on["tpot_ms_per_request_median"] if off else None
    wrong, ties = [], []
    if off and split is not None and split < min(MIN_SAME_TOKENS, len(off["greedy_tokens"])):
        wrong.append(f"n-gram greedy tokens differ from those without speculation at token {split}")
    mtp_drift = logprob_drift(verify.get("greedy_logprobs") or [], mtp.get("greedy_logprobs") or [], mtp_split)
    if mtp_split is not None and mtp_split < min(MIN_SAME_TOKENS, len(verify["greedy_tokens"])):
        reference = verify.get("greedy_top2") or []
        top2 = reference[mtp_split] if mtp_split < len(reference) else []
        line = (f"MTP greedy tokens differ from those without speculation at token {mtp_split}: MTP's "
                f"{mtp['greedy_tokens'][mtp_split]}, the plain engine's top-2 (token, logprob) {top2}; "
                f"largest logprob difference before it {mtp_drift}")
        (ties if mtp_split < len(mtp["greedy_tokens"])
         and is_near_tie(top2, mtp["greedy_tokens"][mtp_split], mtp_drift) else wrong).append(line)
    for name, part in (("verify", verify), ("MTP", mtp)):
        decode = part["steps"].get("0", part["steps"].get(0))
        for k, row in part["steps"].items():
            if not row["same_first_token"]:
                drift = step_drift(decode.get("top2") or [], row.get("top2") or [])
                line = (f"{name} k={k}: first token {row.get('first_token')} differs from the decode step's "
                        f"{decode.get('first_token')}; decode step's top-2 (token, logprob) {decode.get('top2')}, "
                        f"this step's {row.get('top2')}; the token's logprob differs by {drift}")
                (ties if is_near_tie(decode.get("top2") or [], row.get("first_token"), drift)
                 else wrong).append(line)
    base = verify["steps"][0]["ms"] if 0 in verify["steps"] else verify["steps"]["0"]["ms"]
    for part in (verify, mtp):
        for k, row in part["steps"].items():
            row["ratio"] = row["ms"] / base
            if int(k):
                row["estimated_speedup"] = estimated_speedup(row["ratio"], int(k))
    device = (off or verify).get("device")
    result = {"device": device, "ngram_off": off, "ngram_on": on, "ngram_tpot_speedup": speedup,
              "greedy_first_difference": split, "verify": verify, "mtp": mtp,
              "mtp_greedy_first_difference": mtp_split, "mtp_logprob_drift": mtp_drift, "wrong": wrong,
              "near_ties": ties}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "spec_decode.json").write_text(json.dumps(result, indent=2))
    print(f"\n{device}; verify steps at context {verify['context']}")
    print("| what | value |\n|---|---|")
    if off:
        spec = on["speculative"]
        print(f"| W2 ({off['input_len']} in / {off['output_len']} out, repeated prompt) TPOT without speculation "
              f"(per request) | {off['tpot_ms_per_request_median']:.2f} ms |")
        print(f"| W2 TPOT n-gram k={K_NGRAM} (per request) | {on['tpot_ms_per_request_median']:.2f} ms |")
        print(f"| n-gram speedup (target >= 1.8x) | {speedup:.2f}x |")
        print(f"| n-gram acceptance rate / mean accepted length | {spec['acceptance_rate']:.3f} / "
              f"{spec['mean_accepted_length']:.2f} |")
        print(f"| greedy tokens with = without speculation | "
              f"{'all' if split is None else f'first {split}'} of {len(off['greedy_tokens'])} |")
    print(f"| MTP greedy tokens with = without speculation (V3 slice) | "
          f"{'all' if mtp_split is None else f'first {mtp_split}'} of {len(verify['greedy_tokens'])}; "
          f"largest logprob difference where equal: {mtp_drift} |")
    for name, part, note in (("verify step (target only)", verify, "draft cost excluded"),
                             ("MTP step (verify + draft)", mtp, "draft included")):
        for k, row in part["steps"].items():
            label = ("plain decode step" if part is verify else "decode step + MTP draft") if not int(k) \
                else f"{name} k={k}"
            est = ", ".join(f"{a}: {v:.2f}x" for a, v in row.get("estimated_speedup", {}).items())
            print(f"| V3 slice {label} | {row['ms']:.2f} ms = {row['ratio']:.2f}x, graphs {row['graphed']}"
                  + (f"; est. speedup at acceptance {est} ({note})" if est else "") + " |")
    for line in ties:
        print(f"near-tie (top-2 within {TIE_NATS} nats, logprobs within {DRIFT_NATS}; consistent with bf16 "
              f"rounding): {line}")
    for line in wrong:
        print(f"WRONG: {line}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
