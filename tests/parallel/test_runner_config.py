"""Which ranks capture decode CUDA graphs: tensor-parallel ranks only with DEEPSERVE_TP_CUDA_GRAPHS=1
(the all-reduces are then captured with the rest); pipeline stages and --enforce-eager never."""

from __future__ import annotations

import pytest

from deepserve.config import EngineArgs
from deepserve.runner.worker import runner_config


def _config(**kw):
    return EngineArgs(model="deepseek-llm-7b", load_format="dummy", device="cpu", max_model_len=256,
                      **kw).create_engine_config()


@pytest.mark.parametrize("kw, eager", [
    ({"tensor_parallel_size": 2}, False),  # with DEEPSERVE_TP_CUDA_GRAPHS=1 (set below)
    ({"tensor_parallel_size": 2, "enforce_eager": True}, True),
    ({"pipeline_parallel_size": 2}, True),
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, True),
])
def test_graphs_under_tensor_parallelism_only(kw, eager, monkeypatch):
    monkeypatch.setenv("DEEPSERVE_TP_CUDA_GRAPHS", "1")
    assert runner_config(_config(**kw)).model.enforce_eager is eager


@pytest.mark.parametrize("value", [None, "0"])
def test_tensor_parallel_ranks_are_eager_by_default(value, monkeypatch):
    if value is None:
        monkeypatch.delenv("DEEPSERVE_TP_CUDA_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("DEEPSERVE_TP_CUDA_GRAPHS", value)
    assert runner_config(_config(tensor_parallel_size=2)).model.enforce_eager is True
