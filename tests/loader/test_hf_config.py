"""A model folder that is not a checkpoint is refused with a message naming what is missing, as a ConfigRefused
(the engine process logs it in one line: tests/server/test_core_process.py)."""

import json
import re

import pytest

from deepserve.errors import ConfigRefused, FilesMissing
from deepserve.loader.hf_config import load_hf_config, resolve_max_model_len


def test_a_folder_without_config_json_is_refused_naming_the_file(tmp_path):
    with pytest.raises(ConfigRefused, match=r"has no config\.json; --model takes"):
        load_hf_config(str(tmp_path))


def test_a_missing_folder_is_refused_and_still_a_file_not_found_error(tmp_path):
    with pytest.raises(FilesMissing, match="is not a local folder") as caught:
        load_hf_config(str(tmp_path / "nowhere"))
    assert isinstance(caught.value, FileNotFoundError)  # what it was before it became a refusal


@pytest.mark.parametrize(("text", "said"), [('{"model_type": "llama",', r"is not valid JSON: Expecting property name"),
                                            (b"\xff\xfe{}", "is not valid JSON"),
                                            ('["llama"]', "must hold a JSON object .* not a list")])
def test_a_config_json_that_is_not_a_json_object_is_refused_naming_the_file(tmp_path, text, said):
    # transformers says "not a valid JSON file" with an OSError, which was no refusal: a traceback, exit 1.
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigRefused, match=rf"^{re.escape(str(path))} {said}"):
        load_hf_config(str(tmp_path))


def test_an_unsupported_architecture_is_a_refusal_naming_the_supported_ones():
    from types import SimpleNamespace

    from deepserve.models.registry import get_model_class, supported_architectures

    with pytest.raises(ConfigRefused) as refused:
        get_model_class(SimpleNamespace(architectures=["GPT2LMHeadModel"]))
    said = str(refused.value)
    assert "\n" not in said and "config.json" in said and "GPT2LMHeadModel" in said, said
    assert all(arch in said for arch in supported_architectures()), said


def test_too_little_host_memory_is_a_refusal_saying_what_to_change(monkeypatch):
    import torch

    from deepserve.loader import model_loader

    monkeypatch.setattr(model_loader, "_available_host_bytes", lambda: 2**30)
    with torch.device("meta"):
        model = torch.nn.Linear(2**15, 2**15, bias=False)  # 4 GiB of float32, none of it allocated
    with pytest.raises(ConfigRefused) as refused:
        model_loader._check_host_memory(model, torch.float32)
    said = str(refused.value)  # one line: the weights' size and dtype, the memory free, the flags that help
    assert "\n" not in said, said
    assert all(fact in said for fact in ("4.0 GiB", "float32", "1.0 GiB", "--device", "--dtype")), said


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
