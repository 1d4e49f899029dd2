"""Which ranks capture decode CUDA graphs: one process by default; tensor-parallel ranks only when asked
(enforce_eager=False, --no-enforce-eager: the all-reduces are then captured with the rest); pipeline
stages and enforce_eager=True never."""

from __future__ import annotations

import pytest

from deepserve.config import EngineArgs
from deepserve.runner.worker import runner_config


def _config(**kw):
    return EngineArgs(model="deepseek-llm-7b", load_format="dummy", device="cpu", max_model_len=256,
                      **kw).create_engine_config()


@pytest.mark.parametrize("kw, eager", [
    ({}, False),
    ({"tensor_parallel_size": 2}, True),  # the default under tensor parallelism
    ({"tensor_parallel_size": 2, "enforce_eager": False}, False),
    ({"tensor_parallel_size": 2, "enforce_eager": True}, True),
    ({"enforce_eager": True}, True),
    ({"pipeline_parallel_size": 2}, True),
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "enforce_eager": False}, True),
])
def test_which_ranks_capture_graphs(kw, eager):
    assert runner_config(_config(**kw)).model.enforce_eager is eager


def test_the_cli_flag_is_three_valued():
    import argparse

    from deepserve.entrypoints.cli import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).enforce_eager is None
    assert parser.parse_args(["--enforce-eager"]).enforce_eager is True
    assert parser.parse_args(["--no-enforce-eager"]).enforce_eager is False
