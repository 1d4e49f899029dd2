"""Expert parallelism (--enable-expert-parallel): the tensor-parallel ranks split the routed experts, each
rank holding X / tp whole experts, and their partial outputs summed by one all-reduce equal one process's."""

from __future__ import annotations

import gc

import pytest
import torch

from deepserve.config import EngineArgs
from deepserve.distributed.layout import tp_problems
from deepserve.kernels.fused_moe import _check_inputs, fused_moe_ref
from deepserve.layers.moe import RoutedExperts
from tests.conftest import save_checkpoint
from tests.models.test_deepseek import VARIANTS, make_hf_model
from tests.parallel.conftest import GREEDY, PROMPTS, greedy_tokens, make_llm, shutdown

# V2 with moe_intermediate_size 31: odd, which expert parallelism does not split (the shared experts,
# 2 x 31 wide, stay tensor-parallel); V3 with noaux_tc routing and its correction bias.
CASES = {
    "v2-group-limited": ("v2-group-limited-qlora-yarn", dict(moe_intermediate_size=31, n_shared_experts=2)),
    "v3-neox-tied": ("v3-neox-no-qlora-tied", {}),
}


def _checkpoint(case: str, tmp_path, tokenizer) -> str:
    variant, extra = CASES[case]
    config_cls, model_cls, base = VARIANTS[variant]
    return save_checkpoint(make_hf_model(config_cls, model_cls, {**base, **extra}), tokenizer, str(tmp_path))


@pytest.mark.parametrize("case", sorted(CASES))
def test_ep2_matches_single_process(case, tmp_path, tokenizer):
    path = _checkpoint(case, tmp_path, tokenizer)
    llm = make_llm(path, 2, enable_expert_parallel=True)
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        ep_tokens = [list(o.outputs[0].token_ids) for o in outs]
        model = llm.llm_engine.core.runner.runner.model  # rank 0's
        experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
        assert experts
        for m in experts:  # rank 0: experts 0..3 of 8, each whole
            assert m.expert_parallel and m.expert_start == 0
            assert m.w13.shape[0] == 4 and m.w2.shape[0] == 4
            assert m.w13.shape[1] == 2 * m.inter == 2 * CASES[case][1].get("moe_intermediate_size", 32)
    finally:
        shutdown(llm)
        del llm
        gc.collect()
    assert ep_tokens == greedy_tokens(path, 1)


def test_non_dividing_experts_refused_naming_the_field(tmp_path, tokenizer):
    path = _checkpoint("v3-neox-tied", tmp_path, tokenizer)
    args = EngineArgs(model=path, device="cpu", tensor_parallel_size=2, enable_expert_parallel=True,
                      hf_overrides={"n_routed_experts": 7})
    with pytest.raises(ValueError, match=r"n_routed_experts \(7\) is not divisible by tensor_parallel_size \(2\)"):
        args.create_engine_config()
    # the same without expert parallelism is fine: only moe_intermediate_size is split then
    EngineArgs(model=path, device="cpu", tensor_parallel_size=2, hf_overrides={"n_routed_experts": 7}
               ).create_engine_config()


def test_tp_problems_under_ep():
    from types import SimpleNamespace

    cfg = SimpleNamespace(num_attention_heads=8, intermediate_size=64, moe_intermediate_size=12,
                          n_routed_experts=6, n_shared_experts=2)
    assert tp_problems(cfg, 8) == ["moe_intermediate_size (12) is not divisible by tensor_parallel_size (8)"]
    assert tp_problems(cfg, 2, expert_parallel=True) == []
    cfg.moe_intermediate_size = 11  # routed experts stay whole; the shared 2 x 11 still split in two
    assert tp_problems(cfg, 2, expert_parallel=True) == []
    assert [p.split(" (")[0] for p in tp_problems(cfg, 4, expert_parallel=True)] == [
        "n_routed_experts", "moe_intermediate_size * n_shared_experts"]


def _sharded(w13: torch.Tensor, w2: torch.Tensor, rank: int, per_expert: bool) -> RoutedExperts:
    """Rank `rank` of 2 under expert parallelism, loaded from the whole checkpoint tensors."""
    num_experts, two_inter, hidden = w13.shape
    m = RoutedExperts(num_experts, hidden, two_inter // 2, expert_parallel=True, tp_rank=rank, tp_size=2)
    if per_expert:  # DeepSeek's own layout: one tensor per expert and projection, every one offered
        inter = two_inter // 2
        for e in range(num_experts):
            m.w13.weight_loader(m.w13, w13[e, :inter], (e, 0))
            m.w13.weight_loader(m.w13, w13[e, inter:], (e, 1))
            m.w2.weight_loader(m.w2, w2[e], e)
    else:  # transformers' stacked layout
        m.w13.weight_loader(m.w13, w13)
        m.w2.weight_loader(m.w2, w2)
    return m


@pytest.mark.parametrize("per_expert", [False, True])
def test_ep_partials_sum_to_unsharded(per_expert):
    torch.manual_seed(0)
    num_experts, hidden, inter, tokens, k = 8, 16, 7, 13, 3
    w13 = torch.randn(num_experts, 2 * inter, hidden)
    w2 = torch.randn(num_experts, hidden, inter)
    whole = RoutedExperts(num_experts, hidden, inter, tp_rank=0, tp_size=1)
    whole.w13.weight_loader(whole.w13, w13)
    whole.w2.weight_loader(whole.w2, w2)
    x = torch.randn(tokens, hidden)
    ids = torch.stack([torch.randperm(num_experts)[:k] for _ in range(tokens)])  # [T, K]
    ids[0] = torch.tensor([0, 1, 2])  # a token whose experts are all on rank 0
    weights = torch.rand(tokens, k)
    expected = whole.forward_batched(x, weights, ids)

    shards = [_sharded(w13, w2, rank, per_expert) for rank in (0, 1)]
    for rank, m in enumerate(shards):
        assert m.w13.shape == (4, 2 * inter, hidden) and m.w2.shape == (4, hidden, inter)
        torch.testing.assert_close(m.w13.data, w13[4 * rank : 4 * rank + 4])
        torch.testing.assert_close(m.w2.data, w2[4 * rank : 4 * rank + 4])
    partials = [m.partial_batched(x, weights, ids) for m in shards]
    assert partials[1][0].abs().max() == 0  # rank 1 holds none of token 0's experts
    torch.testing.assert_close(partials[0] + partials[1], expected)
    # the fused path's bookkeeping (local ids, only this rank's assignments), with the kernel's reference
    def kernel(*args, **kwargs):  # the real kernel's input checks (shapes, contiguity, dtypes), then its reference
        _check_inputs(*args)
        assert kwargs == {"skips": True}  # other ranks' assignments carry the skip id, not weight 0
        return fused_moe_ref(*args)

    fused = [m.forward_fused(kernel, x, weights, ids) for m in shards]
    torch.testing.assert_close(fused[0] + fused[1], expected)
    reference = sum(m.forward_reference(x, weights, ids) for m in shards)  # token by token: another order
    torch.testing.assert_close(reference, expected, rtol=1e-4, atol=1e-4)
