"""A model folder that is not a checkpoint is refused with a message naming what is missing, as a ConfigRefused
(the engine process logs it in one line: tests/server/test_core_process.py)."""

import json

import pytest

from deepserve.errors import ConfigRefused
from deepserve.loader.hf_config import load_hf_config, resolve_max_model_len


def test_a_folder_without_config_json_is_refused_naming_the_file(tmp_path):
    with pytest.raises(ConfigRefused, match=r"has no config\.json; --model takes"):
        load_hf_config(str(tmp_path))


def test_a_missing_folder_is_refused(tmp_path):
    with pytest.raises(ConfigRefused, match="is not a local folder"):
        load_hf_config(str(tmp_path / "nowhere"))


def test_a_config_transformers_cannot_read_is_refused_naming_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))  # no model_type
    with pytest.raises(ConfigRefused, match=r"config\.json: .*model_type") as caught:
        load_hf_config(str(tmp_path))
    assert isinstance(caught.value.__cause__, ValueError)  # transformers' own error kept as the cause


def test_a_context_longer_than_the_model_is_a_refusal_naming_the_flag():
    class Config:
        max_position_embeddings = 4096

    with pytest.raises(ConfigRefused, match="--max-model-len"):
        resolve_max_model_len(Config(), 8192)
