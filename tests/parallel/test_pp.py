"""Pipeline parallelism: PP=2 and TP=2 x PP=2 give the same greedy tokens as one process, through
LLM(...), on CPU with gloo; a stage builds (and reads) only its own layers."""

from __future__ import annotations

import gc
from collections import defaultdict

import pytest

from deepserve.distributed.layout import check_pp_fits
from deepserve.distributed.parallel_state import stage_layers
from deepserve.loader import checkpoint
from tests.conftest import save_checkpoint
from tests.models.test_deepseek import VARIANTS, make_hf_model
from tests.parallel.conftest import DENSE, greedy_tokens, make_llm, shutdown
from tests.parallel.test_tp_sliced_loading import _CountingFile


def test_llama_pp2_matches_single_process(llama_path):
    assert greedy_tokens(llama_path, 1, pipeline_parallel_size=2) == greedy_tokens(llama_path, 1)


def test_qwen2_tied_tp2_pp2_matches_single_process(qwen2_path):
    # Tied embeddings: the last stage's LM head is its own copy of the first stage's embedding.
    assert greedy_tokens(qwen2_path, 2, pipeline_parallel_size=2) == greedy_tokens(qwen2_path, 1)


@pytest.mark.parametrize("variant", ["v2-group-limited-qlora-yarn", "v3-neox-no-qlora-tied"])
def test_deepseek_pp2_matches_single_process(variant, tmp_path, tokenizer):
    # 3 layers over 2 stages (1 + 2): an uneven split, MLA and MoE on the second stage.
    path = save_checkpoint(make_hf_model(*VARIANTS[variant]), tokenizer, str(tmp_path))
    assert greedy_tokens(path, 1, pipeline_parallel_size=2) == greedy_tokens(path, 1)


def test_stage_builds_and_reads_only_its_layers(llama_path, monkeypatch):
    whole = make_llm(llama_path, 1)
    try:
        full = sum(p.numel() for p in whole.llm_engine.core.runner.model.parameters())
    finally:
        del whole
        gc.collect()
    reads: dict[str, int] = defaultdict(int)
    monkeypatch.setattr(checkpoint, "safe_open", lambda path, **kw: _CountingFile(path, reads, **kw))
    llm = make_llm(llama_path, 1, pipeline_parallel_size=2)
    monkeypatch.undo()
    try:
        # Rank 0 (this process) read only stage 0's tensors.
        assert reads and all(n.startswith(("model.embed_tokens.", "model.layers.0.")) for n in reads), sorted(reads)
        model = llm.llm_engine.core.runner.runner.model  # rank 0 = stage 0: embedding + layer 0
        names = [n for n, _ in model.named_parameters()]
        assert names and all(n.startswith(("model.embed_tokens.", "model.layers.0.")) for n in names), names
        assert sum(p.numel() for p in model.parameters()) < full
        assert len(llm.llm_engine.core.runner.runner.attention_layers) == DENSE["num_hidden_layers"] // 2
    finally:
        shutdown(llm)
        del llm
        gc.collect()


def test_stage_split_and_too_many_stages_refused():
    assert [stage_layers(5, s, 2) for s in range(2)] == [(0, 2), (2, 5)]
    assert [stage_layers(4, s, 4) for s in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]

    class Cfg:
        num_hidden_layers = 2

    with pytest.raises(ValueError, match="num_hidden_layers"):
        check_pp_fits(Cfg(), 3)


def test_prompt_logprobs_refused_under_pp(llama_path):
    from deepserve import SamplingParams

    llm = make_llm(llama_path, 1, pipeline_parallel_size=2)
    try:
        with pytest.raises(ValueError, match=r"prompt_logprobs .* is not supported with pipeline_parallel_size"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)
    finally:
        shutdown(llm)
        del llm
        gc.collect()
