"""A real server with --speculative-config (n-gram): the openai client gets the same greedy text as the
offline engine without speculation, streamed or not, and /metrics exports vLLM's spec_decode counters."""

from __future__ import annotations

import httpx
import openai
import pytest
from serverkit import METRICS, USER, auth, metric, write_keys

from deepserve import LLM, SamplingParams

MODEL = "deepserve-demo"
PROMPT = "the cat sat on the mat, the cat sat on the mat, the cat sat on the"
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'


@pytest.fixture(scope="module")
def srv(server_factory, tmp_path_factory):
    keys = write_keys(str(tmp_path_factory.mktemp("spec") / "keys.yaml"))
    return server_factory(["--api-keys", keys, "--speculative-config", NGRAM])


def test_greedy_text_equals_the_engine_without_speculation_and_metrics_move(srv):
    (want,) = LLM(None, device="cpu", max_model_len=1024).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=USER, max_retries=0, timeout=60)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.outputs[0].text
    assert r.usage.completion_tokens == 24
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == want.outputs[0].text
    text = httpx.get(f"{srv.url}/metrics", headers=auth(METRICS)).text
    drafts = metric(text, "deepserve:spec_decode_num_draft_tokens_total")
    accepted = metric(text, "deepserve:spec_decode_num_accepted_tokens_total")
    assert metric(text, "deepserve:spec_decode_num_drafts_total") > 0
    assert 0 <= accepted <= drafts and drafts > 0


def test_logit_bias_reaches_the_verify_rows(srv):
    """A bias toward the prompt's own tokens makes the output repeat them, so the n-gram drafter proposes
    drafts and the verify rows decide: the speculating server must give what the offline engine without
    speculation gives under the same bias (not the unbiased argmax at a verify row)."""
    llm = LLM(None, device="cpu", max_model_len=1024)
    bias = {t: 30.0 for t in llm.get_tokenizer().encode(PROMPT, add_special_tokens=False)}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias=bias)
    (want,) = llm.generate([PROMPT], params, use_tqdm=False)
    (plain,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert want.outputs[0].text != plain.outputs[0].text
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=USER, max_retries=0, timeout=60)
    drafts = "deepserve:spec_decode_num_draft_tokens_total"
    before = metric(httpx.get(f"{srv.url}/metrics", headers=auth(METRICS)).text, drafts)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.0,
                                  logit_bias={str(t): b for t, b in bias.items()}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.outputs[0].text
    assert metric(httpx.get(f"{srv.url}/metrics", headers=auth(METRICS)).text, drafts) > before
