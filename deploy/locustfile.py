"""Locust scenario for seed 004's pre-deployment load test: 2,000 concurrent users on one endpoint.

Run it against the router (or one server) from a machine with `pip install locust`:

    DEEPSERVE_API_KEYS=keys.txt DEEPSERVE_MODEL=deepseek-r1-distill-qwen-7b \
    locust -f deploy/locustfile.py --host http://ROUTER:8080 --headless \
        --users 2000 --spawn-rate 50 --run-time 15m --csv w3-locust

Each simulated user holds one API key (the lines of DEEPSERVE_API_KEYS, dealt round robin, or the one
DEEPSERVE_API_KEY) and keeps a conversation: a streamed chat turn of about 200 new prompt tokens
(DEEPSERVE_PROMPT_WORDS, default 150 words) after the system prompt and the last two turns, and up to
DEEPSERVE_MAX_TOKENS (default 180) new ones (BENCHMARKS.md W3's short shape), then a think time of
DEEPSERVE_THINK_MIN..MAX seconds (default 1..5), for as long as the run lasts. The conversation's
X-Session-ID header keeps a user's turns on one replica (the router's prefix affinity).

Locust's own entry "chat" times a request to its response headers (it streams); each request also
reports "ttft" (to the first content chunk) and "e2e" (to the end of the stream) as entries of their
own, so the CSV has TTFT and end-to-end percentiles.
429s (a key's quota) are counted as their own name "chat 429", not as failures: with 1,000
requests/min/user, a quota that bites is the system working.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
import uuid

from locust import HttpUser, between, events, task

MODEL = os.environ.get("DEEPSERVE_MODEL", "deepserve-demo")
MAX_TOKENS = int(os.environ.get("DEEPSERVE_MAX_TOKENS", "180"))
PROMPT_WORDS = int(os.environ.get("DEEPSERVE_PROMPT_WORDS", "150"))
THINK = (float(os.environ.get("DEEPSERVE_THINK_MIN", "1")), float(os.environ.get("DEEPSERVE_THINK_MAX", "5")))
WORDS = ("model cache token batch latency replica router quota stream prefix kernel tensor attention "
         "expert layer memory request server cluster deploy metric window budget schedule").split()


def _keys() -> list[str]:
    path = os.environ.get("DEEPSERVE_API_KEYS")
    if path:
        with open(path, encoding="utf-8") as f:
            keys = [line.strip() for line in f if line.strip() and not line.startswith("#")]
        if keys:
            return keys
    key = os.environ.get("DEEPSERVE_API_KEY")
    if not key:
        raise SystemExit("set DEEPSERVE_API_KEY (one key for every user) or DEEPSERVE_API_KEYS (a file, one per line)")
    return [key]


_KEYS = itertools.cycle(_keys())


def _question(rng: random.Random) -> str:
    # 150 words of English-like text is ~200 tokens for the DeepSeek and Qwen tokenizers.
    return " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS)) + "?"


class ChatUser(HttpUser):
    wait_time = between(*THINK)

    def on_start(self) -> None:
        self.key = next(_KEYS)
        self.session = uuid.uuid4().hex
        self.rng = random.Random(self.session)
        self.messages = [{"role": "system", "content": "You are a concise assistant."}]

    @task
    def chat(self) -> None:
        self.messages.append({"role": "user", "content": _question(self.rng)})
        # The system prompt and the last two turns: the context stays bounded however long the run.
        body = {"model": MODEL, "messages": self.messages[:1] + self.messages[1:][-5:], "max_tokens": MAX_TOKENS,
                "stream": True}
        headers = {"Authorization": f"Bearer {self.key}", "X-Session-ID": self.session}
        start = time.perf_counter()
        with self.client.post("/v1/chat/completions", json=body, headers=headers, stream=True,
                              name="chat", catch_response=True) as r:
            if r.status_code == 429:
                r.success()
                events.request.fire(request_type="POST", name="chat 429", response_time=0, response_length=0,
                                    exception=None, context={})
                return
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
                return
            answer, first = [], None
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    r.failure(f"stream error: {chunk['error'].get('message')}")
                    return
                delta = (chunk.get("choices") or [{}])[0].get("delta", {}).get("content")
                if delta:
                    if first is None:
                        first = time.perf_counter()
                    answer.append(delta)
            end = time.perf_counter()
            if first is not None:
                events.request.fire(request_type="POST", name="ttft", response_time=(first - start) * 1000,
                                    response_length=0, exception=None, context={})
            events.request.fire(request_type="POST", name="e2e", response_time=(end - start) * 1000,
                                response_length=len("".join(answer)), exception=None, context={})
        self.messages.append({"role": "assistant", "content": "".join(answer)})
