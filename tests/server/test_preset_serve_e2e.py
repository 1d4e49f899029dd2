"""`deepserve serve PRESET --load-format dummy`: a shape preset (shrunk with --hf-overrides to run on
a CPU) served over HTTP with a tokenizer that covers the preset's whole vocabulary."""

from __future__ import annotations

import os

import openai
import pytest
from serverkit import ADMIN

from deepserve.loader.presets import preset_config
from deepserve.loader.vocab_tokenizer import build_vocab_tokenizer

SMALL = ('{"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, '
         '"num_key_value_heads": 2}')


@pytest.mark.parametrize("name", ["r1-distill-qwen-7b", "deepseek-v3"])
def test_vocab_tokenizer_covers_the_vocabulary(name):
    cfg = preset_config(name)
    tok = build_vocab_tokenizer(cfg)
    assert len(tok) == cfg.vocab_size
    assert tok.eos_token_id == cfg.eos_token_id and tok.bos_token_id == cfg.bos_token_id
    specials = {cfg.bos_token_id, cfg.eos_token_id}
    pieces = tok.convert_ids_to_tokens(list(range(cfg.vocab_size)))
    fillers = [i for i, p in enumerate(pieces) if i not in specials and len(p) > 1]
    assert len(fillers) == cfg.vocab_size - 256 - len(specials)  # the rest are the 256 byte tokens
    words = tok.batch_decode([[i] for i in fillers])
    assert len(set(words)) == len(words)  # every other id decodes to a text of its own
    text = "Hello, wörld! 你好 🙂"
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


def test_serve_preset_with_dummy_weights(server_factory, tmp_path):
    os.environ["DEEPSERVE_CACHE_DIR"] = str(tmp_path)  # the tokenizer folder goes here, not ~/.cache
    try:
        srv = server_factory(["deepseek-llm-7b", "--load-format", "dummy", "--hf-overrides", SMALL,
                              "--dtype", "float32", "--served-model-name", "llm7b"])
    finally:
        del os.environ["DEEPSERVE_CACHE_DIR"]
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=ADMIN, max_retries=0)
    r = client.completions.create(model="llm7b", prompt=[5, 102_399, 77_000], max_tokens=4,
                                  extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 4 and r.choices[0].text
    chat = client.chat.completions.create(model="llm7b", max_tokens=3, messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 3
    assert os.path.isdir(os.path.join(str(tmp_path), "tokenizers"))
