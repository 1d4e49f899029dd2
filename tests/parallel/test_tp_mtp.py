"""DeepSeek's MTP draft under TP=2 (gloo, CPU): every rank builds the MTP layer's slice and runs its forward
over the tokens rank 0 kept, so rank 0's drafts are the one-process drafts. Checked by the tokens (equal
to transformers' greedy ones, whatever the drafts) and by the drafts' acceptance, which a worker that ran
the draft's layer on the wrong tokens or positions would change: the counts must equal one process's."""

from __future__ import annotations

import gc

import pytest

from deepserve import SamplingParams
from tests.models.test_deepseek import PROMPTS
from tests.models.test_dense_models import assert_same_greedy, hf_greedy
from tests.models.test_mtp import mtp, write_checkpoint
from tests.parallel.conftest import make_llm, shutdown


@pytest.fixture(scope="module")
def repeating_mtp(tmp_path_factory, tokenizer):
    return write_checkpoint(tmp_path_factory, tokenizer, "tp-mtp-repeat", repeat=True)


def run(path: str, tp: int, **kwargs) -> tuple[list[list[int]], tuple[int, int, int]]:
    llm = make_llm(path, tp, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        s = llm.llm_engine.stats()
        counts = (s.spec_decode_num_drafts_total, s.spec_decode_num_draft_tokens_total,
                  s.spec_decode_num_accepted_tokens_total)
        return [list(o.outputs[0].token_ids) for o in outs], counts
    finally:
        shutdown(llm)
        del llm
        gc.collect()


@pytest.mark.parametrize("budget", [None, 8])  # 8 tokens a step: prefill chunks end mid-prompt
def test_mtp_drafts_under_tp2_equal_one_process(repeating_mtp, budget):
    path, hf_model, _ = repeating_mtp
    kwargs = dict(speculative_config=mtp(2), **({} if budget is None else {"max_num_batched_tokens": budget}))
    one_tokens, one_counts = run(path, 1, **kwargs)
    two_tokens, two_counts = run(path, 2, **kwargs)
    for ids, got in zip(PROMPTS, two_tokens, strict=True):
        assert_same_greedy(got, *hf_greedy(hf_model, ids, 12))
    assert two_tokens == one_tokens
    assert two_counts == one_counts and 0 < one_counts[2] < one_counts[1]
