"""Pipeline parallelism across "nodes" on one machine: node 0 is this pytest process (the engine,
rank 0 and the rest of its block of ranks), node 1 is `deepserve serve --nnodes 2 --node-rank 1`,
meeting at torch.distributed's rendezvous on 127.0.0.1 (as in test_tp_multinode.py).

PP=2 (one rank per node) and TP=2 x PP=2 (node 0 = stage 0, node 1 = stage 1, the layout of "TP
inside a node, PP across nodes") give the same greedy tokens as one process for Llama and
DeepSeek (V2 under PP=2, V3 under TP=2 x PP=2: MLA and MoE on the far stage); node 1 exits 0
when node 0 stops. Killing node 1 fails node 0 with an error naming the rank, its node and stage,
and leaves none of node 1's ranks behind. An --nnodes that does not divide the ranks is refused.
Each engine start costs seconds of CI on two cores, so the kill shares the Llama TP=2 x PP=2 engine.
"""

from __future__ import annotations

import gc
import signal
import threading
import time

import pytest

from deepserve import SamplingParams
from deepserve.config import ParallelConfig
from deepserve.entrypoints.cli import main as cli_main
from deepserve.runner.executor import TensorParallelError
from tests.conftest import save_checkpoint
from tests.models.test_deepseek import VARIANTS, make_hf_model
from tests.parallel.conftest import GREEDY, PROMPTS, greedy_tokens, make_node0, shutdown, start_node, stop_node
from tests.parallel.test_tp_serve import _alive, _descendants
from tests.server.serverkit import free_port

LAYOUTS = {"pp2": (1, 2), "tp2xpp2": (2, 2)}  # (tensor_parallel_size, pipeline_parallel_size)
DEEPSEEK = {"deepseek_v2": "v2-group-limited-qlora-yarn", "deepseek_v3": "v3-noaux-qlora-yarn"}
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer, llama_path):
    """Model name -> (checkpoint, one process's greedy tokens), each built on first use."""
    built: dict[str, tuple[str, list[list[int]]]] = {}

    def get(model: str) -> tuple[str, list[list[int]]]:
        if model not in built:
            path = llama_path
            if model in DEEPSEEK:
                hf = make_hf_model(*VARIANTS[DEEPSEEK[model]])
                path = save_checkpoint(hf, tokenizer, str(tmp_path_factory.mktemp(model)))
            built[model] = (path, greedy_tokens(path, 1))
        return built[model]

    return get


def _check_layout(llm, tp: int) -> None:
    # Node 0 runs stage 0 whole (itself and its local workers); node 1's ranks are stage 1.
    executor = llm.llm_engine.core.runner
    assert sorted([0, *executor.workers.procs]) == list(range(tp))
    assert executor.workers.remote.ranks == list(range(tp, 2 * tp))


def _tokens(llm) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _close(llm) -> None:
    shutdown(llm)
    del llm
    gc.collect()


@pytest.mark.parametrize(("model", "layout"), [("llama", "pp2"), ("deepseek_v2", "pp2"), ("deepseek_v3", "tp2xpp2")])
def test_two_nodes_match_single_process_and_node1_exits_with_node0(checkpoints, model, layout, tmp_path):
    path, expected = checkpoints(model)
    tp, pp = LAYOUTS[layout]
    port = free_port()
    log = tmp_path / "node1.log"
    node1 = start_node(path, port, str(log), node_rank=1, tp=tp, pp=pp)
    try:
        llm = make_node0(path, port, tp=tp, pp=pp)
        try:
            _check_layout(llm, tp)
            tokens = _tokens(llm)
        finally:
            _close(llm)
        assert node1.wait(30) == 0, log.read_text()[-3000:]
    finally:
        stop_node(node1)
    assert tokens == expected


def test_tp2xpp2_on_two_nodes_matches_then_a_killed_node_is_named(checkpoints, tmp_path, monkeypatch):
    # Llama, TP=2 x PP=2: node 1 is `deepserve serve` holding rank 2 and a rank 3 it spawned. After a
    # correct generation it is killed mid-generation, while rank 0 waits for the last stage's logits.
    # (One engine for both checks: each start of four ranks costs ~10 s of the CI budget.)
    path, expected = checkpoints("llama")
    monkeypatch.setenv("DEEPSERVE_TP_HEARTBEAT_TIMEOUT_S", "3")
    port = free_port()
    node1 = start_node(path, port, str(tmp_path / "node1.log"), node_rank=1, tp=2, pp=2)
    try:
        llm = make_node0(path, port, tp=2, pp=2)
        try:
            _check_layout(llm, 2)
            assert _tokens(llm) == expected
            ranks = _descendants(node1.pid)
            assert ranks, "node 1 should have spawned rank 3"
            threading.Timer(0.3, node1.send_signal, (signal.SIGKILL,)).start()
            start = time.monotonic()
            # Ranks 2 and 3 both die with node 1; whichever's last heartbeat is older is named first (under
            # load that was rank 3 in some runs), and either names the killed node.
            with pytest.raises(TensorParallelError, match=r"rank [23] \(node 1, stage 1\) sent no heartbeat"):
                llm.generate(PROMPTS, LONG, use_tqdm=False)
            assert time.monotonic() - start < 20
            with pytest.raises(TensorParallelError, match="rank [23]"):  # the engine stays failed
                llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        finally:
            _close(llm)
    finally:
        stop_node(node1)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in ranks), "a rank of the killed node outlived it"


def test_ranks_are_split_into_one_block_per_node():
    two = ParallelConfig(tensor_parallel_size=8, pipeline_parallel_size=2, nnodes=2, master_port=29500)
    assert (two.world_size, two.ranks_per_node) == (16, 8)
    assert [two.node_ranks(k) for k in range(2)] == [range(0, 8), range(8, 16)]  # node k = stage k
    four = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=4, master_port=29500)
    assert [list(four.node_ranks(k)) for k in range(4)] == [[0], [1], [2], [3]]


def test_nnodes_that_does_not_divide_the_ranks_is_refused(llama_path, capsys):
    pattern = (r"--nnodes 3 must be >= 1 and divide the number of ranks, --tensor-parallel-size 2 x "
               r"--pipeline-parallel-size 2 = 4 .* fitting --nnodes values: 1, 2, 4$")
    with pytest.raises(ValueError, match=pattern):
        ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=3, master_port=29500)
    # The same from the command line of a node k > 0: refused before it joins anything.
    argv = ["serve", llama_path, "--port", str(free_port()), "--device", "cpu", "-tp", "2", "-pp", "2",
            "--nnodes", "3", "--node-rank", "1", "--master-port", str(free_port())]
    assert cli_main(argv) == 2
    assert "--nnodes 3 must be >= 1 and divide" in capsys.readouterr().err
