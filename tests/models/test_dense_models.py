"""Llama and Qwen2 against transformers' own implementations, on tiny random checkpoints.

Logits must match in float32, and greedy generations token for token with prefix caching,
chunked prefill and forced preemption on and off."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from deepserve import LLM, SamplingParams
from deepserve.config import EngineArgs
from deepserve.engine.request import Request, ScheduledRequest, SchedulerOutput
from deepserve.forward_context import forward_context
from deepserve.runner.input_batch import prepare_inputs
from deepserve.runner.model_runner import ModelRunner
from tests.conftest import save_checkpoint

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=256)
VARIANTS = {
    "llama-mha-untied": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "llama-gqa-tied": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2-gqa-untied": (Qwen2Config, Qwen2ForCausalLM, dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen2-mqa-tied": (Qwen2Config, Qwen2ForCausalLM, dict(num_key_value_heads=1, tie_word_embeddings=True)),
}
PROMPTS = [[5, 17, 300, 42, 9], list(range(100, 137)), [7] * 20, list(range(400, 411))]


def make_dense_model(config_cls, model_cls, extra: dict):
    """A tiny random transformers Llama / Qwen2 (seed 0) of COMMON's shape."""
    torch.manual_seed(0)
    hf_model = model_cls(config_cls(**COMMON, **extra)).eval()
    # Qwen2's biases start at zero; make them count.
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return hf_model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory, tokenizer):
    hf_model = make_dense_model(*VARIANTS[request.param])
    path = save_checkpoint(hf_model, tokenizer, str(tmp_path_factory.mktemp(request.param)))
    return path, hf_model


def our_logits(path: str, prompts: list[list[int]], **engine) -> list[torch.Tensor]:
    """Logits at every position of every prompt, all prompts in one ragged step (engine: more EngineArgs)."""
    runner = ModelRunner(EngineArgs(model=path, dtype="float32", device="cpu", **engine).create_engine_config())
    runner.allocate_kv_cache(64)
    scheduled, next_block = [], 0
    for i, ids in enumerate(prompts):
        req = Request(str(i), ids, SamplingParams())
        nb = -(-len(ids) // runner.block_size)
        req.block_ids = list(range(next_block, next_block + nb))
        next_block += nb
        scheduled.append(ScheduledRequest(req, len(ids), 0))
    inputs = prepare_inputs(SchedulerOutput(scheduled), runner.block_size, runner.device)
    with torch.inference_mode(), forward_context(inputs.attn):
        logits = runner.model.compute_logits(runner.model(inputs.input_ids, inputs.positions))
    return list(logits.split([len(p) for p in prompts]))


def test_logits_match_transformers(checkpoint):
    path, hf_model = checkpoint
    ours = our_logits(path, PROMPTS)
    for ids, got in zip(PROMPTS, ours, strict=True):
        with torch.no_grad():
            want = hf_model(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def hf_greedy(hf_model, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with transformers, full forward each step (no cache): tokens and logits."""
    seq, all_logits = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            logits = hf_model(torch.tensor([seq])).logits[0, -1]
            all_logits.append(logits)
            seq.append(int(logits.argmax()))
    return seq[len(ids):], all_logits


def assert_same_greedy(got: list[int], want: list[int], want_logits: list[torch.Tensor]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            top2 = want_logits[i].topk(2).values
            assert top2[0] - top2[1] < 1e-3, f"token {i}: got {g}, transformers {w}; {got} vs {want}"
            return  # a near-tie in transformers' own logits: later tokens may differ legitimately


ENGINE_SETTINGS = {
    "default": dict(),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "chunked-tiny-budget": dict(max_num_batched_tokens=8),
    "forced-preemption": dict(num_gpu_blocks_override=12, block_size=4, max_model_len=48),
    # Async scheduling (step n+1 scheduled and launched before step n's tokens are read).
    "async": dict(async_scheduling=True),
    "async-chunked-tiny-budget": dict(async_scheduling=True, max_num_batched_tokens=8),
    "async-forced-preemption": dict(async_scheduling=True, num_gpu_blocks_override=12, block_size=4,
                                    max_model_len=48),
}


@pytest.mark.parametrize("setting", sorted(ENGINE_SETTINGS))
def test_greedy_generation_matches_transformers(checkpoint, setting):
    path, hf_model = checkpoint
    max_tokens = 10
    llm = LLM(path, dtype="float32", device="cpu", **{"num_gpu_blocks_override": 64, **ENGINE_SETTINGS[setting]})
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # Twice the same batch: the second pass runs on a warm prefix cache.
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for _ in range(2):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for ids, out in zip(PROMPTS, outputs, strict=True):
            want, want_logits = hf_greedy(hf_model, ids, max_tokens)
            assert_same_greedy(out.outputs[0].token_ids, want, want_logits)
            assert out.outputs[0].finish_reason == "length"
    stats = llm.llm_engine.stats()
    if setting.endswith("forced-preemption"):
        assert stats.num_preemptions_total > 0
    if setting in ("default", "async"):
        assert stats.prefix_cache_hits_total > 0
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0
    assert llm.llm_engine.core.async_scheduling == setting.startswith("async")


def hf_greedy_with_repetition_penalty(hf_model, ids: list[int], n: int, penalty: float
                                      ) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding through transformers' own RepetitionPenaltyLogitsProcessor (prompt and output)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    processor, seq, all_logits = RepetitionPenaltyLogitsProcessor(penalty), list(ids), []
    with torch.no_grad():
        for _ in range(n):
            logits = processor(torch.tensor([seq]), hf_model(torch.tensor([seq])).logits[:, -1])[0]
            all_logits.append(logits)
            seq.append(int(logits.argmax()))
    return seq[len(ids):], all_logits


@pytest.mark.parametrize("setting", ["default", "forced-preemption"])
def test_repetition_penalty_matches_transformers(checkpoint, setting):
    # Penalized rows beside an unpenalized one, over many steps: the penalty history the runner keeps
    # on the device (new tokens counted each step; rebuilt after a preemption) against transformers.
    path, hf_model = checkpoint
    max_tokens = 10  # the preemption setting's context is 48 tokens; the longest prompt 37
    llm = LLM(path, dtype="float32", device="cpu", **{"num_gpu_blocks_override": 64, **ENGINE_SETTINGS[setting]})
    penalized = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, repetition_penalty=1.8)
    plain = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    params = [penalized, plain, penalized, penalized]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for ids, p, out in zip(PROMPTS, params, outputs, strict=True):
        if p is plain:
            want, want_logits = hf_greedy(hf_model, ids, max_tokens)
        else:
            want, want_logits = hf_greedy_with_repetition_penalty(hf_model, ids, max_tokens, 1.8)
        assert_same_greedy(out.outputs[0].token_ids, want, want_logits)
    if setting == "forced-preemption":
        assert llm.llm_engine.stats().num_preemptions_total > 0


def test_logprobs_and_prompt_logprobs_match_transformers(checkpoint):
    path, hf_model = checkpoint
    llm = LLM(path, dtype="float32", device="cpu", num_gpu_blocks_override=64, max_num_batched_tokens=16)
    ids = PROMPTS[1]  # 37 tokens: prompt logprobs come from three chunks
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    c = out.outputs[0]
    seq = ids + c.token_ids
    with torch.no_grad():
        want = torch.log_softmax(hf_model(torch.tensor([seq])).logits[0].float(), dim=-1)  # [L, V]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[ids[pos]].logprob - want[pos - 1, ids[pos]].item()) < 1e-4
        assert entry[ids[pos]].rank == int((want[pos - 1] > want[pos - 1, ids[pos]]).sum()) + 1
        assert set(want[pos - 1].topk(2).indices.tolist()) <= set(entry)
    assert len(c.logprobs) == 4
    total = 0.0
    for i, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        row = want[len(ids) - 1 + i]
        assert entry[tok].rank == 1  # greedy picks the top token
        assert abs(entry[tok].logprob - row[tok].item()) < 1e-4
        assert set(entry) == set(row.topk(3).indices.tolist())
        total += row[tok].item()
    assert abs(c.cumulative_logprob - total) < 1e-3


def test_sharded_checkpoint_with_index_loads(tmp_path, tokenizer):
    torch.manual_seed(1)
    hf_model = LlamaForCausalLM(LlamaConfig(**COMMON, num_key_value_heads=2)).eval()
    path = str(tmp_path / "sharded")
    hf_model.save_pretrained(path, max_shard_size="200KB")
    tokenizer.save_pretrained(path)
    import os

    shards = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    assert len(shards) > 1 and os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    (got,) = our_logits(path, [PROMPTS[0]])
    with torch.no_grad():
        want = hf_model(torch.tensor([PROMPTS[0]])).logits[0]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_dummy_weights_need_only_the_config(tmp_path, tokenizer):
    config = LlamaConfig(**COMMON, num_key_value_heads=2)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), load_format="dummy", device="cpu", num_gpu_blocks_override=32)
    (out,) = llm.generate(["hello"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    with pytest.raises(FileNotFoundError, match="load_format='dummy'"):
        LLM(str(tmp_path), device="cpu", num_gpu_blocks_override=32)
