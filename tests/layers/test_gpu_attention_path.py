"""The attention fronts' GPU path, run on the CPU, against transformers.

On the GPU, prefill attention is flash attention's varlen kernel called by name, one call for a step's
fresh prompts and one for its chunks over a cached prefix (MHA/GQA), or the fresh prompts' expanded
form (MLA); the decode rows take the Triton kernels. SDPA's cuDNN backend once cost W1 30-40 %, so no
GPU-path SDPA call may leave it allowed. Here `uses_gpu_kernels` is forced on (the Triton kernels run in
Triton's interpreter), flash's varlen op is replaced by an explicit softmax over the ragged batch that
checks its inputs, and SDPA fails if it is called with cuDNN's backend enabled. The logits of mixed
steps (fresh prompts, chunks over a cached prefix, decode rows) and greedy generations with chunked
prefill and prefix caching must equal transformers'.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

import deepserve.kernels.varlen_attention as varlen
import deepserve.layers.attention as attention_front
import deepserve.layers.mla as mla_front
from deepserve import LLM, SamplingParams
from tests.conftest import save_checkpoint
from tests.models.test_deepseek import COMMON as DEEPSEEK_COMMON
from tests.models.test_deepseek import hf_logits, make_runner, run_step, with_blocks
from tests.models.test_dense_models import assert_same_greedy, hf_greedy

pytest.importorskip("triton")

LLAMA = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
DEEPSEEK = dict(DEEPSEEK_COMMON, q_lora_rank=24, n_group=4, topk_group=2, n_shared_experts=1,
                first_k_dense_replace=1)
PROMPTS = [[5, 17, 300, 42, 9], list(range(100, 137)), [7] * 20, list(range(400, 411))]


def explicit_varlen(q, k, v, cu_q, cu_k, scale):
    """Each sequence's n queries are the last n of its L keys; fp64 softmax, key heads shared in groups."""
    out = torch.empty(*q.shape[:2], v.shape[-1], dtype=q.dtype)
    group = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        qs, ks = q[cu_q[b]:cu_q[b + 1]].double(), k[cu_k[b]:cu_k[b + 1]].double()
        vs = v[cu_k[b]:cu_k[b + 1]].double().repeat_interleave(group, dim=1)
        n, length = qs.shape[0], ks.shape[0]
        scores = torch.einsum("nhd,lhd->hnl", qs, ks.repeat_interleave(group, dim=1)) * scale
        visible = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]  # [n, L]
        out[cu_q[b]:cu_q[b + 1]] = torch.einsum("hnl,lhd->nhd", scores.masked_fill(~visible, -torch.inf)
                                                .softmax(-1), vs).to(q.dtype)
    return out


def longest(cu: list[int]) -> int:
    return max(b - a for a, b in zip(cu, cu[1:], strict=False))


class GpuPath:
    def __init__(self) -> None:
        self.calls: list[int] = []  # the number of sequences of each flash varlen call
        self.guard = True  # off while transformers computes the expected values (it calls SDPA too)


@pytest.fixture
def gpu_path(monkeypatch):
    """Forces the GPU path (see the module's docstring)."""
    state = GpuPath()
    calls = state.calls

    def fake_flash(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        assert cu_q.dtype == cu_k.dtype == torch.int32 and q.shape[-1] == k.shape[-1] == v.shape[-1]
        cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
        assert cu_q[-1] == q.shape[0] and cu_k[-1] == k.shape[0] and q.shape[1] % k.shape[1] == 0
        assert (max_q, max_k) == (longest(cu_q), longest(cu_k))
        calls.append(len(cu_q) - 1)
        return explicit_varlen(q, k, v, cu_q, cu_k, scale)

    sdpa = F.scaled_dot_product_attention

    def sdpa_without_cudnn(*args, **kwargs):
        assert not (state.guard and torch.backends.cuda.cudnn_sdp_enabled()), \
            "a GPU-path SDPA call left cuDNN's backend allowed"
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(attention_front, "uses_gpu_kernels", lambda t: True)
    monkeypatch.setattr(mla_front, "uses_gpu_kernels", lambda t: True)
    monkeypatch.setattr(varlen, "flash_varlen_fits", lambda q, v: q.shape[-1] == v.shape[-1])
    monkeypatch.setattr(varlen, "flash_varlen", fake_flash)
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa_without_cudnn)
    return state


def fuse_rope_into_the_store(monkeypatch, hf_model, fused: bool) -> tuple[list, int]:
    """With `fused`, DEEPSERVE_FUSED_ROPE_KV_STORE's path (kernels/rope_kv_store.py): its calls, counted in
    the returned list, and how many a two-step test expects (one per layer and step: rope_and_store_kv in
    the MHA/GQA front, mla_rope_and_store in the MLA one)."""
    calls: list = []
    monkeypatch.setattr(attention_front, "FUSED_ROPE_KV_STORE", fused)  # on by default: both ways pinned
    monkeypatch.setattr(mla_front, "FUSED_ROPE_KV_STORE", fused)
    if not fused:
        return calls, 0
    import deepserve.kernels.rope_kv_store as rope_kv_store

    for name in ("rope_and_store_kv", "mla_rope_and_store"):
        kernel = getattr(rope_kv_store, name)
        monkeypatch.setattr(rope_kv_store, name, lambda *a, _kernel=kernel: calls.append(1) or _kernel(*a))
    layers = LLAMA if isinstance(hf_model, LlamaForCausalLM) else DEEPSEEK
    return calls, 2 * layers["num_hidden_layers"]


def unguarded(gpu_path: GpuPath, fn):
    """fn() with the SDPA guard off: transformers' own forward calls SDPA with every backend allowed."""
    gpu_path.guard = False
    try:
        return fn()
    finally:
        gpu_path.guard = True


@pytest.fixture(scope="module", params=["llama-gqa", "deepseek-v3"])
def checkpoint(request, tmp_path_factory, tokenizer):
    torch.manual_seed(0)
    if request.param == "llama-gqa":
        model = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()
    else:
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK)).eval()
    return save_checkpoint(model, tokenizer, str(tmp_path_factory.mktemp(request.param))), model


@pytest.mark.parametrize("expand_min,fused", [(128, False), (2, False), (128, True)],
                         ids=["short-chunks-absorbed", "chunks-expanded", "rope-fused-into-the-store"])
def test_mixed_step_matches_transformers(checkpoint, gpu_path, monkeypatch, expand_min, fused):
    """Step 1 prefills part of three prompts; step 2 has a decode row (one new token over a cache), two
    chunks over cached prefixes that are not adjacent in the step, and two fresh prompts."""
    monkeypatch.setattr(mla_front, "EXPAND_MIN_NEW_TOKENS", expand_min)
    path, hf_model = checkpoint
    fused_calls, expected_calls = fuse_rope_into_the_store(monkeypatch, hf_model, fused)
    runner = make_runner(path)
    runner.allocate_kv_cache(64)
    prompts = PROMPTS + [list(range(50, 59))]
    requests = with_blocks(runner, prompts)
    cuts = [4, 20, 0, 3, 0]  # prompt 0 then decodes its last prompt token; 2 and 4 are fresh in step 2
    run_step(runner, [(r, 0, c) for r, c in zip(requests, cuts, strict=True) if c])
    step = [(requests[i], cuts[i], len(prompts[i]) - cuts[i]) for i in (0, 2, 1, 4, 3)]
    logits = run_step(runner, step)
    for (request, cut, n), got in zip(step, logits.split([n for *_, n in step]), strict=True):
        want = unguarded(gpu_path, lambda r=request: hf_logits(hf_model, r.prompt_token_ids))[cut:cut + n]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert 2 in gpu_path.calls  # the two fresh prompts of step 2 in one flash varlen call
    assert len(fused_calls) == expected_calls  # both steps, every MHA/GQA layer


@pytest.mark.parametrize("expand_min,fused", [(128, False), (2, False), (128, True)],
                         ids=["short-chunks-absorbed", "chunks-expanded", "rope-fused-into-the-store"])
def test_mixed_step_with_an_fp8_cache_matches_the_reference_path(checkpoint, gpu_path, monkeypatch, expand_min,
                                                                  fused):
    """The same mixed step as above with --kv-cache-dtype fp8: the GPU path (Triton stores and decode
    kernels, cached histories gathered then dequantized for flash) against the CPU reference path, which
    quantizes to the same bytes and reads fp8 * scale the same way; non-unit scales on every layer."""
    monkeypatch.setattr(mla_front, "EXPAND_MIN_NEW_TOKENS", expand_min)
    path, hf_model = checkpoint
    fused_calls, expected_calls = fuse_rope_into_the_store(monkeypatch, hf_model, fused)
    prompts = PROMPTS + [list(range(50, 59))]
    cuts = [4, 20, 0, 3, 0]

    def mixed_step() -> torch.Tensor:
        runner = make_runner(path, kv_cache_dtype="fp8")
        for front in (m for m in runner.model.modules() if hasattr(m, "kv_cache_spec")):
            front.load_kv_scale("k", 0.3)
            front.load_kv_scale("v", 1.7)
        runner.allocate_kv_cache(64)
        requests = with_blocks(runner, prompts)
        run_step(runner, [(r, 0, c) for r, c in zip(requests, cuts, strict=True) if c])
        return run_step(runner, [(requests[i], cuts[i], len(prompts[i]) - cuts[i]) for i in (0, 2, 1, 4, 3)])

    on_gpu_path = mixed_step()
    assert gpu_path.calls and len(fused_calls) == expected_calls
    monkeypatch.undo()  # the reference path, with torch's own SDPA (and rope and the store unfused)
    monkeypatch.setattr(mla_front, "EXPAND_MIN_NEW_TOKENS", expand_min)
    torch.testing.assert_close(on_gpu_path, mixed_step(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("settings", [dict(), dict(max_num_batched_tokens=8)], ids=["whole-prompts", "chunked"])
def test_greedy_on_the_gpu_path_matches_transformers(checkpoint, gpu_path, settings):
    path, hf_model = checkpoint
    llm = LLM(path, dtype="float32", device="cpu", num_gpu_blocks_override=64, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    wants = unguarded(gpu_path, lambda: [hf_greedy(hf_model, ids, 6) for ids in PROMPTS])
    for _ in range(2):  # the second pass starts from prefix-cache hits
        for want, out in zip(wants, llm.generate(prompts, params, use_tqdm=False), strict=True):
            assert_same_greedy(out.outputs[0].token_ids, *want)
    assert llm.llm_engine.stats().prefix_cache_hits_total > 0 and gpu_path.calls


def test_chunks_over_a_cache_are_batched_under_a_key_budget(checkpoint, gpu_path, monkeypatch):
    # With a budget of 24 history keys, step 2's two chunks over a cache (histories 20 + 37 = 57 keys)
    # go in separate varlen calls; the logits still equal transformers'.
    import deepserve.runner.input_batch as input_batch

    monkeypatch.setattr(input_batch, "MAX_GATHERED_KEYS", 24)
    monkeypatch.setattr(mla_front, "EXPAND_MIN_NEW_TOKENS", 2)
    path, hf_model = checkpoint
    runner = make_runner(path)
    runner.allocate_kv_cache(64)
    requests = with_blocks(runner, PROMPTS[:3])
    cuts = [3, 20, 0]
    run_step(runner, [(r, 0, c) for r, c in zip(requests, cuts, strict=True) if c])
    step = [(r, c, len(r.prompt_token_ids) - c) for r, c in zip(requests, cuts, strict=True)]
    gpu_path.calls.clear()
    logits = run_step(runner, step)
    for (request, cut, n), got in zip(step, logits.split([n for *_, n in step]), strict=True):
        want = unguarded(gpu_path, lambda r=request: hf_logits(hf_model, r.prompt_token_ids))[cut:cut + n]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    if isinstance(hf_model, LlamaForCausalLM):  # MHA: one call for the fresh prompt, one per cached batch
        assert sorted(gpu_path.calls) == [1] * 3 * LLAMA["num_hidden_layers"]


def test_cached_chunks_are_cut_into_runs_under_the_budget():
    from deepserve.runner.input_batch import _bounded

    histories = [5, 6, 20, 3, 4]  # each sequence's seq_len: its history, this step's tokens included
    assert _bounded([0, 1, 2, 3, 4], histories, 12) == [[0, 1], [2], [3, 4]]
    assert _bounded([], histories, 12) == []


@pytest.mark.parametrize("on_gpu_path", [False, True], ids=["reference-path", "gpu-path"])
def test_verify_steps_match_transformers(checkpoint, gpu_path, monkeypatch, on_gpu_path):
    """N-gram speculative decoding: a verify step's rows (the last token and its drafts) run as one-token
    decode rows, on the GPU path through the Triton paged-decode kernels; greedy output still equals
    transformers' (on the reference path too, with the GPU path switched off)."""
    if not on_gpu_path:
        monkeypatch.undo()
    path, hf_model = checkpoint
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(path, dtype="float32", device="cpu", num_gpu_blocks_override=64, speculative_config=spec)
    prompts = PROMPTS + [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    wants = unguarded(gpu_path, lambda: [hf_greedy(hf_model, ids, 8) for ids in prompts])
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for want, out in zip(wants, outputs, strict=True):
        assert_same_greedy(out.outputs[0].token_ids, *want)
    assert llm.llm_engine.stats().spec_decode_num_draft_tokens_total > 0
