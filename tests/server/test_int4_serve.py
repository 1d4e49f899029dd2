"""An AWQ or GPTQ (act order) int4 checkpoint served by `deepserve serve` (real server and engine core
process), asked through the official openai client: the greedy completion is transformers' on the
dequantized weights."""

from __future__ import annotations

import openai
import pytest
import torch
from serverkit import ADMIN
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from tests.conftest import save_checkpoint
from tests.loader.int4_pack import write_int4_checkpoint
from tests.models.test_dense_models import make_dense_model
from tests.models.test_int4_models import FORMATS


@pytest.mark.parametrize("fmt", ["awq", "gptq-act-order"])
def test_int4_checkpoint_served_follows_transformers(server_factory, tmp_path, tokenizer, fmt):
    hf_model = make_dense_model(LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=2))
    src = save_checkpoint(hf_model, tokenizer, str(tmp_path / "float"))
    path, ref_dir = str(tmp_path / fmt), str(tmp_path / "ref")
    method, bits, group, sym, desc_act = FORMATS[fmt]
    write_int4_checkpoint(src, path, ref_dir, method, bits, group, sym, desc_act)
    srv = server_factory([path, "--dtype", "float32", "--served-model-name", "tiny-int4", "--max-model-len", "256"])
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=ADMIN, max_retries=0, timeout=60)
    prompt = "paged attention keeps"
    got = client.completions.create(model="tiny-int4", prompt=prompt, max_tokens=8, temperature=0.0)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None)[0, len(ids):]
    assert got.choices[0].text == tokenizer.decode(want.tolist())
