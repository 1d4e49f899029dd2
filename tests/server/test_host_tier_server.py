"""`deepserve serve --swap-space` with a GPU cache too small to keep a prompt: a real server process, the
official openai client, and /metrics counting the prompt's blocks stored on the host and loaded back."""

from __future__ import annotations

import httpx
import openai
from serverkit import ADMIN, metric

PROMPT = list(range(100, 133))  # 33 tokens: 8 full blocks of 4
FILLER = list(range(300, 338))  # with its 10 outputs, every one of the 12 GPU blocks


def test_served_prompt_is_found_again_in_the_host_tier(server_factory):
    srv = server_factory(["--num-gpu-blocks-override", "12", "--block-size", "4", "--max-model-len", "48",
                          "--swap-space", "0.001"])
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=ADMIN, max_retries=0, timeout=60)
    texts = []
    for prompt in (PROMPT, FILLER, PROMPT):
        done = client.completions.create(model="deepserve-demo", prompt=prompt, max_tokens=10, temperature=0.0,
                                         extra_body={"ignore_eos": True})
        texts.append(done.choices[0].text)
    assert texts[2] == texts[0]
    text = httpx.get(f"{srv.url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    assert metric(text, "deepserve:prefix_cache_host_stores_total") >= 8
    assert metric(text, "deepserve:prefix_cache_host_hits_total") == 32
