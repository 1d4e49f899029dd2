"""DeepSeek-V3's MTP layer as a speculative-decoding draft, on tiny V3 checkpoints that carry one
(model.layers.{num_hidden_layers}.*, beside what transformers saves: transformers' DeepseekV3 ignores it).

- The module's drafts equal a reference built from transformers' own DeepseekV3 decoder layer, norms and
  head (the first draft at the end of a prompt, and the chained second one).
- Greedy output with MTP drafts equals transformers' output without them (the draft changes only speed),
  under prefix hits, chunked prefill and forced preemption, with drafts both accepted and rejected.
- A checkpoint whose config promises the layer but whose files lack it is refused, naming it.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV3Model

from deepserve import LLM, SamplingParams
from deepserve.config import EngineArgs
from deepserve.engine.request import ScheduledRequest, SchedulerOutput
from deepserve.layers.linear import LinearBase
from deepserve.layers.moe import RoutedExperts
from deepserve.runner.model_runner import ModelRunner
from tests.conftest import save_checkpoint
from tests.models.test_deepseek import COMMON, PROMPTS, VARIANTS, make_hf_model, with_blocks
from tests.models.test_dense_models import assert_same_greedy, hf_greedy

# Every layer MoE (first_k_dense_replace 0), so a one-layer transformers model reproduces the MTP block.
_, _, V3 = VARIANTS["v3-neox-no-qlora-tied"]
V3 = {**V3, "num_nextn_predict_layers": 1}
N = COMMON["num_hidden_layers"]  # the MTP layer's index
E = COMMON["hidden_size"]


def mtp_tensors(hf_model, repeat: bool) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors: a decoder layer drawn by transformers (a model one layer deeper, its last
    layer), enorm, hnorm, eh_proj, shared_head, and the shared embedding / head copies DeepSeek ships.
    repeat=True makes a draft that predicts "the last token again" (eh_proj passes the embedding through,
    the block adds nothing; with tied embeddings the head then scores that token highest), which
    greedy outputs with runs accept and the rest reject."""
    deeper = make_hf_model(DeepseekV3Config, DeepseekV3ForCausalLM, {**V3, "num_hidden_layers": N + 1})
    tensors = {k: v.contiguous() for k, v in deeper.state_dict().items() if k.startswith(f"model.layers.{N}.")}
    g = torch.Generator().manual_seed(5)
    layer = f"model.layers.{N}."
    if repeat:
        for k in tensors:
            if k.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                tensors[k] = torch.zeros_like(tensors[k])
        eh, norms = torch.cat([torch.eye(E), torch.zeros(E, E)], dim=1), [torch.ones(E) for _ in range(3)]
    else:
        eh, norms = 0.2 * torch.randn(E, 2 * E, generator=g), [1 + 0.2 * torch.randn(E, generator=g) for _ in range(3)]
    tensors.update({layer + "eh_proj.weight": eh, layer + "enorm.weight": norms[0], layer + "hnorm.weight": norms[1],
                    layer + "shared_head.norm.weight": norms[2],
                    layer + "shared_head.head.weight": hf_model.lm_head.weight.detach().clone(),
                    layer + "embed_tokens.weight": hf_model.model.embed_tokens.weight.detach().clone()})
    return tensors


def write_checkpoint(tmp_path_factory, tokenizer, name: str, repeat: bool | None):
    hf_model = make_hf_model(DeepseekV3Config, DeepseekV3ForCausalLM, V3)
    path = save_checkpoint(hf_model, tokenizer, str(tmp_path_factory.mktemp(name)))
    tensors = None
    if repeat is not None:
        tensors = mtp_tensors(hf_model, repeat)
        save_file(tensors, f"{path}/model-mtp.safetensors")
    return path, hf_model, tensors


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory, tokenizer):
    return write_checkpoint(tmp_path_factory, tokenizer, "mtp-random", repeat=False)


@pytest.fixture(scope="module")
def repeating_mtp(tmp_path_factory, tokenizer):
    return write_checkpoint(tmp_path_factory, tokenizer, "mtp-repeat", repeat=True)


def mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


def reference_drafts(hf_model, tensors: dict[str, torch.Tensor], prompt: list[int], first_token: int) -> list[int]:
    """The first two drafts after `prompt` (whose next token is first_token), from transformers' parts:
    a one-layer DeepseekV3Model holding the MTP block (its final norm = shared_head.norm), fed
    eh_proj([enorm(Emb(t_{p+1})); hnorm(h_p)]) as inputs_embeds, h_p the main model's last hidden state."""
    layer = f"model.layers.{N}."
    block = DeepseekV3Model(DeepseekV3Config(**{**COMMON, **V3, "num_hidden_layers": 1})).eval()
    state = {k.replace(layer, "layers.0."): v for k, v in tensors.items()
             if k.startswith(layer) and not k.startswith(tuple(layer + p for p in ("enorm", "hnorm", "eh_proj",
                                                                                 "shared_head", "embed_tokens")))}
    state["norm.weight"] = tensors[layer + "shared_head.norm.weight"]
    state["embed_tokens.weight"] = tensors[layer + "embed_tokens.weight"]
    block.load_state_dict(state)
    embed, head = tensors[layer + "embed_tokens.weight"], tensors[layer + "shared_head.head.weight"]

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + COMMON.get("rms_norm_eps", 1e-6)) * w

    def mtp_inputs(tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        x = torch.cat([rms(embed[tokens], tensors[layer + "enorm.weight"]),
                       rms(hidden, tensors[layer + "hnorm.weight"])], dim=-1)
        return x @ tensors[layer + "eh_proj.weight"].T

    outputs: list[torch.Tensor] = []
    hook = block.layers[0].register_forward_hook(lambda m, a, out: outputs.append(out[0] if isinstance(out, tuple)
                                                                                    else out))
    with torch.no_grad():
        h_main = hf_model.model(torch.tensor([prompt])).last_hidden_state[0]  # [L, E], after the final norm
        x = mtp_inputs(prompt[1:] + [first_token], h_main)  # [L, E]
        first = int((block(inputs_embeds=x[None]).last_hidden_state[0, -1] @ head.T).argmax())
        pre_norm = outputs[-1][0, -1]  # the module's own hidden state at the last position
        x2 = torch.cat([x, mtp_inputs([first], pre_norm[None])])  # one more position, chained
        second = int((block(inputs_embeds=x2[None]).last_hidden_state[0, -1] @ head.T).argmax())
    hook.remove()
    return [first, second]


@pytest.mark.parametrize("fused", [False, True], ids=["", "fused"])
def test_drafts_equal_a_reference_from_transformers_parts(random_mtp, fused, monkeypatch):
    # fused: DEEPSERVE_SHARED_EXPERTS_FUSION and DEEPSERVE_FUSED_QKV_A reach the MTP module's layer too
    path, hf_model, tensors = random_mtp
    monkeypatch.setenv("DEEPSERVE_SHARED_EXPERTS_FUSION", "1" if fused else "0")
    monkeypatch.setenv("DEEPSERVE_FUSED_QKV_A", "1" if fused else "0")  # on by default: the unfused path too
    runner = ModelRunner(EngineArgs(model=path, dtype="float32", device="cpu", speculative_config=mtp(2))
                         .create_engine_config())
    if fused:
        from deepserve.layers.moe import DeepseekMoE
        from deepserve.models.deepseek_v2 import MultiHeadLatentAttention

        layers = list(runner.model.mtp.modules())
        assert any(isinstance(m, DeepseekMoE) for m in layers) and any(isinstance(m, MultiHeadLatentAttention)
                                                                        for m in layers)
        assert all(m.shared_experts is None for m in layers if isinstance(m, DeepseekMoE))
        assert all(m.wqkv_a is not None for m in layers if isinstance(m, MultiHeadLatentAttention))
    runner.allocate_kv_cache(64)
    requests = with_blocks(runner, PROMPTS)
    result = runner.execute(SchedulerOutput([ScheduledRequest(r, len(p), 0) for r, p in zip(requests, PROMPTS,
                                                                                             strict=True)]))
    for prompt, tokens, drafts in zip(PROMPTS, result.sampled, result.draft_token_ids, strict=True):
        assert drafts == reference_drafts(hf_model, tensors, prompt, tokens[0])


def test_the_draft_is_quantized_with_the_model(random_mtp):
    # `--quantization fp8` on an unquantized checkpoint: the MTP module's linears turn FP8 at load like the
    # main model's (they stayed in the checkpoint's dtype before), and the draft still runs
    path, _, _ = random_mtp
    runner = ModelRunner(EngineArgs(model=path, dtype="float32", device="cpu", quantization="fp8",
                                    speculative_config=mtp(2)).create_engine_config())
    quantizable = [m for m in runner.model.mtp.modules()
                   if getattr(getattr(m, "quant", None), "quantize_at_load", False)]
    linears = [m for m in quantizable if isinstance(m, LinearBase)]
    experts = [m for m in quantizable if isinstance(m, RoutedExperts)]
    assert linears and experts
    assert all(m.weight.dtype == torch.float8_e4m3fn and m.weight_scale is not None for m in linears)
    assert all(m.w13.dtype == m.w2.dtype == torch.float8_e4m3fn for m in experts)
    runner.allocate_kv_cache(64)
    requests = with_blocks(runner, PROMPTS)
    result = runner.execute(SchedulerOutput([ScheduledRequest(r, len(p), 0) for r, p in zip(requests, PROMPTS,
                                                                                             strict=True)]))
    assert [len(d) for d in result.draft_token_ids] == [2] * len(PROMPTS)


SETTINGS = {
    "default": dict(),
    "chunked-tiny-budget": dict(max_num_batched_tokens=8),
    "forced-preemption": dict(num_gpu_blocks_override=16, block_size=4, max_model_len=56),
}


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_with_mtp_drafts_matches_transformers(repeating_mtp, setting, k):
    path, hf_model, _ = repeating_mtp
    llm = LLM(path, dtype="float32", device="cpu", speculative_config=mtp(k),
              **{"num_gpu_blocks_override": 64, **SETTINGS[setting]})
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    wants = [hf_greedy(hf_model, ids, 12) for ids in PROMPTS]
    for _ in range(2):  # the second pass starts from prefix-cache hits
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        for want, out in zip(wants, outputs, strict=True):
            assert_same_greedy(out.outputs[0].token_ids, *want)
            assert len(out.outputs[0].token_ids) == 12
    stats = llm.llm_engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens_total < stats.spec_decode_num_draft_tokens_total
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0
    if setting == "forced-preemption":
        assert stats.num_preemptions_total > 0
    if setting == "default":
        assert stats.prefix_cache_hits_total > 0


def test_sampling_with_mtp_drafts_replays_by_seed(repeating_mtp):
    path, _, _ = repeating_mtp
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, ignore_eos=True, seed=3)
    runs = [LLM(path, dtype="float32", device="cpu", num_gpu_blocks_override=64, speculative_config=mtp(2))
            .generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)[0].outputs[0].token_ids
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 10


def test_a_checkpoint_without_the_layer_is_refused(tmp_path_factory, tokenizer):
    path, _, _ = write_checkpoint(tmp_path_factory, tokenizer, "mtp-missing", repeat=None)
    with pytest.raises(ValueError, match=rf"holds no tensor named model.layers.{N}\.\*.*num_nextn_predict_layers=1"):
        LLM(path, dtype="float32", device="cpu", speculative_config=mtp(1))


def test_an_encrypted_checkpoint_decrypts_its_mtp_layer_too(repeating_mtp, tmp_path):
    # The MTP layer is read after the model, from the same files: with the checkpoint sealed it needs the
    # key as well (it was once read without it and refused).
    pytest.importorskip("cryptography")
    from deepserve.entrypoints.cli import main

    path, hf_model, _ = repeating_mtp
    sealed, key = tmp_path / "sealed", tmp_path / "key"
    assert main(["encrypt-model", path, str(sealed), "--key-file", str(key), "--new-key-file"]) == 0
    assert "model-mtp.safetensors.enc" in os.listdir(sealed)
    llm = LLM(str(sealed), decryption_key_file=str(key), dtype="float32", device="cpu", speculative_config=mtp(3),
              num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert_same_greedy(out.outputs[0].token_ids, *hf_greedy(hf_model, prompt, 12))
    assert llm.llm_engine.stats().spec_decode_num_accepted_tokens_total > 0  # the repeating layer's drafts
