from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepserve import demo
from deepserve.loader.tokenizer import apply_chat_template, load_eos_token_ids, load_tokenizer

BOS, EOS, USER, ASSISTANT = demo.SPECIAL_TOKENS
TEXT = "Stop strings, 流式输出 and 🚀 emoji survive a round trip.\n  Twice!"


def write_tokenizer(folder: Path, tokenizer_class: str, chat_template: str | None = demo.CHAT_TEMPLATE) -> Path:
    """A checkpoint's tokenizer files as DeepSeek ships them: tokenizer.json + tokenizer_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = demo.train_bpe_tokenizer(demo.CORPUS, 1000, demo.SPECIAL_TOKENS)
    tok.backend_tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": tokenizer_class, "bos_token": BOS, "eos_token": EOS, "add_bos_token": True}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return folder


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(str(write_tokenizer(tmp_path_factory.mktemp("tok"), "PreTrainedTokenizerFast")))


def test_round_trip(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    assert tokenizer.decode(ids) == BOS + TEXT


def test_deepseek_layout_declaring_llama_tokenizer_stays_byte_level(tmp_path):
    # DeepSeek checkpoints declare LlamaTokenizerFast over a byte-level tokenizer.json; loading must
    # keep the byte-level pre-tokenizer, or Chinese text and emoji would not round-trip.
    tok = load_tokenizer(str(write_tokenizer(tmp_path, "LlamaTokenizerFast")))
    assert tok.decode(tok.encode(TEXT), skip_special_tokens=True) == TEXT


def test_missing_folder_and_missing_files_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_tokenizer(str(tmp_path))


def test_eos_ids_from_generation_config_list(tmp_path, tokenizer):
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [7, 9]}))
    assert load_eos_token_ids(str(tmp_path), tokenizer) == {7, 9, tokenizer.eos_token_id}


def test_eos_ids_from_generation_config_int(tmp_path, tokenizer):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 11}))
    assert load_eos_token_ids(str(tmp_path), tokenizer) == {11, tokenizer.eos_token_id}


def test_eos_ids_without_generation_config(tmp_path, tokenizer):
    assert load_eos_token_ids(str(tmp_path), tokenizer) == frozenset({tokenizer.eos_token_id})


def test_chat_template_roles_in_order_with_generation_prompt(tokenizer):
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is a KV cache?"},
        {"role": "assistant", "content": "Saved keys and values."},
        {"role": "user", "content": "Why blocks?"},
    ]
    text = apply_chat_template(tokenizer, messages)
    history = f"{BOS}Answer briefly.{USER}What is a KV cache?{ASSISTANT}Saved keys and values.{EOS}"
    history += f"{USER}Why blocks?"
    assert text == history + ASSISTANT
    assert apply_chat_template(tokenizer, messages, add_generation_prompt=False) == history
    # The template brings its own bos: encode without adding another.
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(tokenizer.bos_token_id) == 1


def test_no_chat_template_is_a_clear_error(tmp_path):
    tok = load_tokenizer(str(write_tokenizer(tmp_path, "PreTrainedTokenizerFast", chat_template=None)))
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tok, [{"role": "user", "content": "hi"}])



def test_a_prompt_past_model_max_length_logs_no_transformers_warning(tmp_path):
    # tokenizer_config.json's model_max_length is not the engine's limit (max_model_len, which the engine
    # enforces with its own error): transformers' "Token indices sequence length is longer..." warning only
    # misled. Its other warnings still reach the log: the library's logger is left as it is.
    import logging

    from transformers.utils import logging as hf_logging

    folder = write_tokenizer(tmp_path, "PreTrainedTokenizerFast")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 16}))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # transformers' loggers do not propagate to the root logger
    logging.getLogger("transformers").addHandler(handler)
    try:
        tok = load_tokenizer(str(folder))
        assert tok.model_max_length == 16 and len(tok.encode(TEXT * 4)) > 16
        hf_logging.get_logger("transformers.tokenization_utils_base").warning("another warning")
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert [r.getMessage() for r in records] == ["another warning"]
