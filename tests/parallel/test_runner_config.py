"""Which ranks capture decode CUDA graphs: tensor-parallel ranks by default (the all-reduces are
captured with the rest) unless DEEPSERVE_TP_CUDA_GRAPHS=0; pipeline stages and --enforce-eager never."""

from __future__ import annotations

import pytest

from deepserve.config import EngineArgs
from deepserve.runner.worker import runner_config


def _config(**kw):
    return EngineArgs(model="deepseek-llm-7b", load_format="dummy", device="cpu", max_model_len=256,
                      **kw).create_engine_config()


@pytest.mark.parametrize("kw, eager", [
    ({"tensor_parallel_size": 2}, False),
    ({"tensor_parallel_size": 2, "enforce_eager": True}, True),
    ({"pipeline_parallel_size": 2}, True),
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, True),
])
def test_graphs_under_tensor_parallelism_only(kw, eager, monkeypatch):
    monkeypatch.delenv("DEEPSERVE_TP_CUDA_GRAPHS", raising=False)
    assert runner_config(_config(**kw)).model.enforce_eager is eager


def test_tensor_parallel_graphs_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("DEEPSERVE_TP_CUDA_GRAPHS", "0")
    assert runner_config(_config(tensor_parallel_size=2)).model.enforce_eager is True
