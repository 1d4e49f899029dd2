"""Async scheduling under tensor parallelism (opt-in, `--async-scheduling` with TP > 1), on CPU with
gloo: rank 0 launches step n+1 before reading step n and broadcasts each step's sampled tokens, which
the workers use for their placeholder inputs. Tokens, logprobs and prompt logprobs equal one process
stepping one step at a time."""

from __future__ import annotations

import gc

import pytest

from deepserve import SamplingParams
from tests.conftest import save_checkpoint
from tests.models.test_deepseek import VARIANTS, make_hf_model
from tests.parallel.conftest import PROMPTS, make_llm, shutdown

SAMPLED = SamplingParams(max_tokens=8, temperature=0.8, seed=5, logprobs=2, prompt_logprobs=1)


def _outputs(path: str, tp: int, async_scheduling: bool, params: SamplingParams = SAMPLED, **kwargs):
    llm = make_llm(path, tp, async_scheduling=async_scheduling, **kwargs)
    try:
        assert llm.llm_engine.core.async_scheduling is async_scheduling
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [(list(c.token_ids), c.logprobs, o.prompt_logprobs) for o in outs for c in o.outputs]
    finally:
        shutdown(llm)
        del llm
        gc.collect()


def _close(a, b) -> bool:
    """Same tokens; logprobs equal to float32 noise (TP sums partial products in another order)."""
    for (ta, la, pa), (tb, lb, pb) in zip(a, b, strict=True):
        if ta != tb:
            return False
        for x, y in zip(la + [p for p in pa if p], lb + [p for p in pb if p], strict=True):
            if x.keys() != y.keys() or any(abs(x[t].logprob - y[t].logprob) > 1e-4 for t in x):
                return False
    return True


@pytest.mark.parametrize("budget", [None, 8])
def test_llama_tp2_async_matches_one_process(llama_path, budget):
    kwargs = {} if budget is None else dict(max_num_batched_tokens=budget, max_model_len=64)
    assert _close(_outputs(llama_path, 2, True, **kwargs), _outputs(llama_path, 1, False, **kwargs))


def test_llama_tp2_step_by_step_prompt_logprobs_match_one_process(llama_path):
    # Prompt logprobs are now computed at launch on rank 0 (before its tokens are read): the
    # step-by-step TP path must still run its collectives in the workers' order.
    assert _close(_outputs(llama_path, 2, False), _outputs(llama_path, 1, False))


def test_deepseek_v2_tp2_async_matches_one_process(tmp_path, tokenizer):
    path = save_checkpoint(make_hf_model(*VARIANTS["v2-group-limited-qlora-yarn"]), tokenizer, str(tmp_path))
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    assert _outputs(path, 2, True, greedy) == _outputs(path, 1, False, greedy)


def test_llama_tp2_async_with_a_grammar_matches_one_process(llama_path):
    # Under async scheduling a grammar's masks are built inside rank 0's launch of step n+1, after it read
    # step n's tokens (EngineCore._attach_grammar_bitmask): under tensor parallelism too the tokens equal
    # one process stepping one at a time, whose text (so the TP run's too) matches the pattern.
    import re

    from deepserve.sampling_params import StructuredOutputsParams

    pattern = "[a-c]{3,8}"
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=5,
                            structured_outputs=StructuredOutputsParams(regex=pattern))
    got, want = _outputs(llama_path, 2, True, params), _outputs(llama_path, 1, False, params)
    assert [tokens for tokens, _, _ in got] == [tokens for tokens, _, _ in want]
    llm = make_llm(llama_path, 1, async_scheduling=False)
    try:
        texts = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        shutdown(llm)
    assert all(re.fullmatch(pattern, text) for text in texts), texts
