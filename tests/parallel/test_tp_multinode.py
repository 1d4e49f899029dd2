"""Two "nodes" on one machine: node 0 is this pytest process (the engine and rank 0), node 1 is
`deepserve serve --nnodes 2 --node-rank 1` (rank 1), meeting at torch.distributed's rendezvous on
127.0.0.1. Greedy tokens equal one process's; node 1 exits cleanly when node 0 stops; killing node 1
fails node 0 with an error naming rank 1."""

from __future__ import annotations

import gc
import signal
import subprocess

import pytest

from deepserve.runner.executor import TensorParallelError
from tests.parallel.conftest import GREEDY, PROMPTS, greedy_tokens, make_node0, shutdown, start_node, stop_node
from tests.server.serverkit import free_port


def _start_node1(path: str, master_port: int, tmp_path) -> tuple[subprocess.Popen, str]:
    log = str(tmp_path / "node1.log")
    return start_node(path, master_port, log, node_rank=1, tp=2), log


def _node0(path: str, port: int):
    return make_node0(path, port, tp=2)


def test_two_nodes_match_single_process_and_node1_exits_with_node0(llama_path, tmp_path):
    port = free_port()
    node1, log = _start_node1(llama_path, port, tmp_path)
    try:
        llm = _node0(llama_path, port)
        try:
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
        finally:
            shutdown(llm)
            del llm
            gc.collect()
        assert node1.wait(30) == 0, open(log).read()[-3000:]
    finally:
        stop_node(node1)
    assert tokens == greedy_tokens(llama_path, 1)


def test_killed_node_is_named(llama_path, tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPSERVE_TP_HEARTBEAT_TIMEOUT_S", "3")
    port = free_port()
    node1, _ = _start_node1(llama_path, port, tmp_path)
    try:
        llm = _node0(llama_path, port)
        try:
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
            node1.send_signal(signal.SIGKILL)
            node1.wait(10)
            with pytest.raises(TensorParallelError, match=r"rank 1 \(node 1\) sent no heartbeat"):
                llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        finally:
            shutdown(llm)
            del llm
            gc.collect()
    finally:
        stop_node(node1)


def test_serve_on_two_nodes(llama_path, tmp_path):
    # Node 0 is a real `deepserve serve` (its engine process holds rank 0); stopping it stops node 1.
    from tests.parallel.test_tp_serve import PROMPT, _offline_text, complete
    from tests.server.serverkit import Server

    port = free_port()
    node1, log = _start_node1(llama_path, port, tmp_path)
    server = Server([llama_path, "--tensor-parallel-size", "2", "--dtype", "float32", "--device", "cpu",
                     "--max-model-len", "256", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                     "--master-port", str(port)], str(tmp_path))
    try:
        server.wait_ready()
        text = complete(server, llama_path, PROMPT)
    finally:
        assert server.stop() == 0, server.tail()
        try:
            assert node1.wait(30) == 0, open(log).read()[-3000:]
        finally:
            stop_node(node1)
    assert text == _offline_text(llama_path)
