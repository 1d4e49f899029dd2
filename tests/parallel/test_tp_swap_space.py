"""--swap-space under tensor parallelism: every rank makes the host-tier copies in its own cache shard
(the lists travel in the step message), so TP=2 gives the tokens of one process."""

from __future__ import annotations

import gc

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from deepserve import LLM
from deepserve.engine.request import Request, ScheduledRequest, SchedulerOutput
from deepserve.runner.step_message import describe_step, rebuild_step
from deepserve.sampling_params import SamplingParams
from tests.conftest import save_checkpoint
from tests.parallel.conftest import DENSE, GREEDY, PROMPTS, shutdown


def test_swap_lists_travel_in_the_step_message():
    request = Request("r", [1, 2, 3], SamplingParams())
    request.block_ids = [5]
    out = SchedulerOutput([ScheduledRequest(request, 3, 0)], blocks_to_swap_out=[(2, 0), (3, 1)],
                          blocks_to_swap_in=[(4, 6)])
    got = rebuild_step(describe_step(out))
    assert got.blocks_to_swap_out == [(2, 0), (3, 1)] and got.blocks_to_swap_in == [(4, 6)]
    plain = describe_step(SchedulerOutput([ScheduledRequest(request, 3, 0)]))
    assert "swap_out" not in plain and "swap_in" not in plain  # the default step message is unchanged


def run(path: str, tp: int, **kwargs) -> tuple[list[list[int]], int]:
    llm = LLM(path, device="cpu", dtype="float32", tensor_parallel_size=tp, num_gpu_blocks_override=12,
              block_size=4, max_model_len=48, **kwargs)
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], llm.llm_engine.stats().num_swapped_in_blocks_total
    finally:
        shutdown(llm)
        del llm
        gc.collect()


def test_tp2_swaps_on_every_rank(tmp_path, tokenizer):
    torch.manual_seed(0)
    # Weights large enough that the greedy tokens depend on the cache (a rank that skipped its copies fails).
    hf_model = LlamaForCausalLM(LlamaConfig(**DENSE, initializer_range=0.3)).eval()
    path = save_checkpoint(hf_model, tokenizer, str(tmp_path / "llama"))
    want, _ = run(path, 1)
    got, swapped_in = run(path, 2, swap_space=2**-12)
    assert swapped_in > 0
    assert got == want


def prompt_filler_prompt(path: str, tp: int, **kwargs) -> tuple[list[list[int]], int]:
    """A 33-token prompt, a filler that takes every GPU block, the prompt again; the outputs and the
    prompt tokens loaded from the host tier."""
    llm = LLM(path, device="cpu", dtype="float32", tensor_parallel_size=tp, num_gpu_blocks_override=12,
              block_size=4, max_model_len=48, **kwargs)
    try:
        prompt, filler = list(range(100, 133)), list(range(300, 338))
        outs = [llm.generate([p], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                             use_tqdm=False)[0] for p in (prompt, filler, prompt)]
        return [list(o.outputs[0].token_ids) for o in outs], llm.llm_engine.stats().prefix_cache_host_hits_total
    finally:
        shutdown(llm)
        del llm
        gc.collect()


def test_tp2_stores_and_loads_host_prefix_blocks_on_every_rank(tmp_path, tokenizer):
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(LlamaConfig(**DENSE, initializer_range=0.3)).eval()
    path = save_checkpoint(hf_model, tokenizer, str(tmp_path / "llama"))
    want, _ = prompt_filler_prompt(path, 1)
    got, host_hits = prompt_filler_prompt(path, 2, swap_space=2**-12)
    assert host_hits == 32  # the second prompt's 8 full blocks, loaded in both ranks' shards
    assert got == want and got[2] == got[0]
