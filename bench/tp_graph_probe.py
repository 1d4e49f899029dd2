"""Where do decode CUDA graphs under tensor parallelism stop? A GPU-only diagnostic (two GPUs).

1. `raw`: two ranks, torch's NCCL process group, a graph holding a matmul and an all-reduce: capture,
   replay, compare with the sum computed eagerly. Each rank dumps its Python stack and exits if it
   is still running after 40 s (faulthandler), so a hang shows where it hangs.
2. `llm`: LLM(tensor_parallel_size=2) on a tiny Llama with enforce_eager=False (decode graphs on TP ranks) and greedy
   tokens compared with one GPU. Run it with PYTHONFAULTHANDLER=1 and send SIGABRT to the ranks
   after a timeout: every process then prints its stack.

Usage: python bench/tp_graph_probe.py raw [global|thread_local|relaxed] [reset] | llm
(`reset`: free the graph before destroying the process group; without it the teardown hung in run 12)
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def raw_rank(rank: int, world: int, port: int, mode: str, reset: bool) -> None:
    faulthandler.dump_traceback_later(40, exit=True)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    w = torch.randn(256, 256, device="cuda")
    x = torch.full((8, 256), float(rank + 1), device="cuda")
    warm = x @ w
    dist.all_reduce(warm)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    print(f"rank {rank}: capturing ({mode})", flush=True)
    with torch.cuda.graph(graph, capture_error_mode=mode):
        y = x @ w
        dist.all_reduce(y)
    print(f"rank {rank}: captured", flush=True)
    for step in range(3):
        x.fill_(float(rank + 1 + step))
        graph.replay()
        torch.cuda.synchronize()
        want = sum(torch.full((8, 256), float(r + 1 + step), device="cuda") @ w for r in range(world))
        print(f"rank {rank}: replay {step} max error {(y - want).abs().max().item():.2e}", flush=True)
    if reset:
        graph.reset()
        torch.cuda.synchronize()
    dist.destroy_process_group()
    print(f"rank {rank}: process group destroyed (graph reset first: {reset})", flush=True)


def raw(mode: str, reset: bool) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(raw_rank, args=(2, port, mode, reset), nprocs=2, join=True)


def llm() -> None:

    from transformers import LlamaConfig, LlamaForCausalLM

    from deepserve import LLM, SamplingParams

    logging.basicConfig(level=logging.INFO)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4))
    prompts = [{"prompt_token_ids": list(range(3 + i, 20 + 3 * i))} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        results = {}
        for tp in (1, 2):
            engine = LLM(path, dtype="float32", device="cuda", num_gpu_blocks_override=128, block_size=16,
                         skip_tokenizer_init=True, max_num_seqs=8, tensor_parallel_size=tp, enforce_eager=False)
            print(f"tp={tp}: engine ready", flush=True)
            results[tp] = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
            print(f"tp={tp}: generated", flush=True)
            del engine
        print("llm TP=2 graphs vs TP=1:", "EQUAL" if results[1] == results[2] else "MISMATCH", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "raw":
        raw(sys.argv[2] if len(sys.argv) > 2 else "global", "reset" in sys.argv)
    else:
        llm()
