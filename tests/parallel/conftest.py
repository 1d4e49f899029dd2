"""Tiny checkpoints and a helper that runs one LLM and always shuts its workers down.

Every tensor-parallel engine makes this pytest process rank 0 of a process group; `run_llm`
shuts it down before returning, so the next test (TP=1 included) starts from a clean process.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from deepserve import LLM, SamplingParams
from tests.conftest import save_checkpoint
from tests.server.serverkit import ROOT, free_port

# vocab 500 does not divide by 4: the vocab-parallel embedding pads its last slice.
DENSE = dict(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
PROMPTS = [[5, 17, 300, 42, 9], list(range(100, 137)), [7] * 20]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def make_llm(path: str, tp: int, **kwargs) -> LLM:
    return LLM(path, device="cpu", dtype="float32", tensor_parallel_size=tp, num_gpu_blocks_override=64, **kwargs)


def shutdown(llm: LLM) -> None:
    runner = llm.llm_engine.core.runner
    if hasattr(runner, "shutdown"):
        runner.shutdown()


def greedy_tokens(path: str, tp: int, prompts: list[list[int]] = PROMPTS, **kwargs) -> list[list[int]]:
    llm = make_llm(path, tp, **kwargs)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        shutdown(llm)
        del llm
        gc.collect()


def start_node(path: str, master_port: int, log: str, node_rank: int, tp: int, pp: int = 1,
               nnodes: int = 2) -> subprocess.Popen:
    """Node `node_rank` > 0 of a multi-node engine, as a user starts it: `deepserve serve --node-rank k`,
    meeting node 0 (this pytest process) at the rendezvous on 127.0.0.1:master_port."""
    cmd = [sys.executable, "-m", "deepserve.entrypoints.cli", "--log-level", "INFO", "serve", path,
           "--port", str(free_port()), "--device", "cpu", "--dtype", "float32", "--tensor-parallel-size", str(tp),
           "--pipeline-parallel-size", str(pp), "--nnodes", str(nnodes), "--node-rank", str(node_rank),
           "--master-addr", "127.0.0.1", "--master-port", str(master_port)]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DEEPSERVE_TP_TIMEOUT_S": "30"}
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=os.path.dirname(log))


def make_node0(path: str, port: int, tp: int, pp: int = 1, nnodes: int = 2) -> LLM:
    return make_llm(path, tp, pipeline_parallel_size=pp, nnodes=nnodes, node_rank=0, master_addr="127.0.0.1",
                    master_port=port)


def stop_node(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def _dense_checkpoint(tmp_path_factory, tokenizer, name: str, config_cls, model_cls, **extra) -> str:
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**DENSE, **extra})).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):
                p.normal_(0, 0.5)  # Qwen2's q/k/v biases start at zero; make them count
    return save_checkpoint(model, tokenizer, str(tmp_path_factory.mktemp(name)))


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory, tokenizer) -> str:
    return _dense_checkpoint(tmp_path_factory, tokenizer, "llama-gqa", LlamaConfig, LlamaForCausalLM)


@pytest.fixture(scope="session")
def qwen2_path(tmp_path_factory, tokenizer) -> str:
    return _dense_checkpoint(tmp_path_factory, tokenizer, "qwen2-gqa", Qwen2Config, Qwen2ForCausalLM,
                             tie_word_embeddings=True)
