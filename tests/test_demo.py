from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from deepserve import demo
from deepserve.engine.detokenizer import IncrementalDetokenizer
from deepserve.loader.tokenizer import apply_chat_template, load_eos_token_ids, load_tokenizer

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")
FILES += ("tokenizer_config.json", demo.MTP_FILE)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return demo.write_demo_model(str(tmp_path_factory.mktemp("demo") / "model"))


def test_folder_is_a_complete_hf_checkpoint(model_dir):
    assert set(FILES) <= set(os.listdir(model_dir))
    with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        assert json.load(f)["chat_template"] == demo.CHAT_TEMPLATE


def test_loads_with_transformers_and_generates(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.vocab_size == len(tok)
    assert abs(len(tok) - 1000) <= 50
    assert model.dtype == torch.float32
    assert (tok.bos_token, tok.eos_token) == (demo.BOS, demo.EOS)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    prompt = apply_chat_template(tok, [{"role": "user", "content": "Why stream tokens?"}])
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    out = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    new_ids = out[0, ids.shape[1] :].tolist()
    assert len(new_ids) == 12
    # Same text through our incremental path as through a full decode.
    detok = IncrementalDetokenizer(tok, ids[0].tolist())
    detok.update(new_ids)
    detok.finish()
    assert detok.output_text == tok.decode(new_ids, skip_special_tokens=True)


def test_our_loaders_read_it(model_dir):
    tok = load_tokenizer(model_dir)
    assert load_eos_token_ids(model_dir, tok) == {tok.convert_tokens_to_ids(demo.EOS)}
    text = "Batching 让加速器 stay busy 🚀."
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    assert [tok.convert_tokens_to_ids(t) for t in demo.SPECIAL_TOKENS] == [0, 1, 2, 3]


def test_mtp_speculation_runs_on_it_and_keeps_transformers_greedy_output(model_dir):
    # Its config says num_nextn_predict_layers = 1 (DeepSeek-V3's), so its files hold that layer: method
    # "mtp" runs on the demo. The drafts are random (so is the model); greedy output must not change.
    from deepserve import LLM, SamplingParams

    ids = AutoTokenizer.from_pretrained(model_dir).encode("Why stream tokens?")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None)
    llm = LLM(model_dir, device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == want[0, len(ids):].tolist()
    assert llm.llm_engine.stats().spec_decode_num_drafts_total > 0


def test_special_tokens_encode_as_single_ids():
    tok = demo.train_bpe_tokenizer(demo.CORPUS, 1000, demo.SPECIAL_TOKENS)
    ids = tok.encode(f"{demo.USER}hi{demo.ASSISTANT}", add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids(demo.USER)
    assert ids[-1] == tok.convert_tokens_to_ids(demo.ASSISTANT)


def test_deterministic_bytes(model_dir, tmp_path):
    again = demo.write_demo_model(str(tmp_path / "again"))
    for name in FILES:
        with open(os.path.join(model_dir, name), "rb") as a, open(os.path.join(again, name), "rb") as b:
            assert a.read() == b.read(), name


def test_does_not_touch_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    demo.write_demo_model(str(tmp_path / "m"))
    assert torch.equal(torch.rand(3), expected)


def test_ensure_writes_once_under_xdg_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = demo.ensure_demo_model()
    assert path == str(tmp_path / "deepserve" / demo.CACHE_NAME)
    assert set(FILES) <= set(os.listdir(path))
    assert os.listdir(tmp_path / "deepserve") == [demo.CACHE_NAME]  # no temp folder left behind

    def fail(path):
        raise AssertionError("rewrote a complete demo model")

    monkeypatch.setattr(demo, "write_demo_model", fail)
    assert demo.ensure_demo_model() == path


def test_ensure_losing_a_race_keeps_the_winner(tmp_path, monkeypatch):
    target = str(tmp_path / "model")
    real_write = demo.write_demo_model

    def write_while_another_process_finishes(tmp):
        real_write(target)  # the other process renames its complete folder into place first
        with open(os.path.join(target, "marker"), "w") as f:
            f.write("winner")
        return real_write(tmp)

    monkeypatch.setattr(demo, "write_demo_model", write_while_another_process_finishes)
    assert demo.ensure_demo_model(target) == target
    assert os.path.isfile(os.path.join(target, "marker"))
    assert os.listdir(tmp_path) == ["model"]


def test_ensure_refuses_a_foreign_folder(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "notes.txt").write_text("not a model")
    with pytest.raises(RuntimeError, match="delete it"):
        demo.ensure_demo_model(str(tmp_path / "model"))
