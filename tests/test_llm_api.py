"""The offline API end to end on the built-in demo model: n, seeds, stops, logprobs, bad input."""

from __future__ import annotations

import json

import pytest

from deepserve import LLM, SamplingParams
from deepserve.entrypoints.cli import main


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", num_gpu_blocks_override=256, max_model_len=256)


PROMPT = "Paged attention keeps the cache in blocks"


def test_outputs_come_back_in_input_order_with_vllm_shape(llm):
    prompts = ["one", "two two", "three three three"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    tok = llm.get_tokenizer()
    for o, p in zip(outs, prompts, strict=True):
        assert o.finished and o.prompt_token_ids == tok.encode(p)
        (c,) = o.outputs
        assert c.index == 0 and len(c.token_ids) == 5 and c.finish_reason == "length"
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


def test_n_gives_indexed_outputs_sharing_the_prompt(llm):
    (out,) = llm.generate([PROMPT * 3], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8,
                                                        ignore_eos=True), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # each child has its own seed


def test_seeded_request_is_independent_of_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    (alone,) = llm.generate([PROMPT], seeded, use_tqdm=False)
    others = SamplingParams(temperature=0.9, max_tokens=7, ignore_eos=True)
    batch = llm.generate(["noise a", PROMPT, "more noise here", "x"],
                         [others, seeded, SamplingParams(temperature=1.0, seed=99, max_tokens=12), others],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    (again,) = llm.generate([PROMPT], seeded, use_tqdm=False)
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids


def test_stop_string_truncates_text_and_frees_the_request(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (full,) = llm.generate([PROMPT], greedy, use_tqdm=False)
    text = full.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert len(stop) == 2 and "\ufffd" not in stop
    cut = text.index(stop)
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=include)
        (out,) = llm.generate([PROMPT], params, use_tqdm=False)
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.text == text[: cut + (len(stop) if include else 0)]
    assert llm.llm_engine.stats().num_running == 0


def test_min_tokens_holds_a_stop_string_back(llm):
    # As in vLLM: a stop string ends the output only once it has more than min_tokens tokens.
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (full,) = llm.generate([PROMPT], greedy, use_tqdm=False)
    ids, text = full.outputs[0].token_ids, full.outputs[0].text
    tok = llm.get_tokenizer()
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    first_end = next(n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n]))
    held = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], min_tokens=len(ids))
    (out,) = llm.generate([PROMPT], held, use_tqdm=False)
    assert out.outputs[0].text == text and out.outputs[0].finish_reason == "length"
    early = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], min_tokens=first_end - 1)
    (out,) = llm.generate([PROMPT], early, use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text == text[: text.index(stop)]


def _run_to_end(engine, request_id: str, prompt: str, params: SamplingParams) -> list[int]:
    engine.add_request(request_id, prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
    return list(final.outputs[0].token_ids)


def test_a_reused_request_id_gets_its_own_penalty_history(llm):
    # A finished request's id may be reused; the penalty state kept between steps must not carry over.
    # The first "q" samples one token (so its only step saw an empty output, as the next "q"'s first
    # step does) from a prompt made of the tokens the second "q" would pick without a penalty: a stale
    # prompt mask would penalize exactly those.
    engine = llm.llm_engine
    fresh = LLM(device="cpu", num_gpu_blocks_override=64, max_model_len=256).llm_engine
    prompt = [int(t) for t in llm.get_tokenizer().encode("another one")]
    plain = _run_to_end(fresh, "plain", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    penalized = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=3.0)
    _run_to_end(engine, "q", plain, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                                  repetition_penalty=3.0))
    assert _run_to_end(engine, "q", prompt, penalized) == _run_to_end(fresh, "other", prompt, penalized)


def test_stop_token_ids_end_the_completion(llm):
    (full,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    stop_id = full.outputs[0].token_ids[3]
    first = full.outputs[0].token_ids.index(stop_id)
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id]),
                          use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == full.outputs[0].token_ids[: first + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id
    # min_tokens holds the stop back until enough tokens exist.
    (late,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id],
                                                    min_tokens=first + 2), use_tqdm=False)
    assert len(late.outputs[0].token_ids) > first + 1


def test_too_long_prompt_is_refused_and_the_engine_keeps_serving(llm):
    # The prompt's index: which of a list was refused, which the message alone did not say.
    with pytest.raises(ValueError, match=r"^prompts\[1\]: .*maximum context length is 256"):
        llm.generate(["ok", "word " * 300], SamplingParams(max_tokens=8), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    (out,) = llm.generate(["ok"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("prompts, message", [
    (["ok", 5], r"^prompts\[1\]: a prompt must be a string, a list of token ids or a dict; got int$"),
    ([["a"]], r"^a list prompt holds token ids \(integers\); item 0 is str 'a'$"),
    (["ok", [1, True]], r"^prompts\[1\]: a list prompt holds token ids \(integers\); item 1 is bool True$"),
    (["ok", {"prompt_token_ids": [3, 2.5]}], r"^prompts\[1\]: .*item 1 is float 2.5$"),
])
def test_a_prompt_of_the_wrong_type_is_named_and_nothing_runs(llm, prompts, message):
    with pytest.raises(TypeError, match=message):
        llm.generate(prompts, {"max_tokens": 2}, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    import numpy as np

    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for one in ([[np.int64(5), 6]], [np.int64(5), 6]):  # numpy's integers, in a list of prompts or as the one
        (out,) = llm.generate(one, params, use_tqdm=False)
        assert out.prompt_token_ids == [5, 6] and all(type(t) is int for t in out.prompt_token_ids)
        assert len(out.outputs[0].token_ids) == 2
    outs = llm.generate((p for p in ["a", [5, 6]]), params, use_tqdm=False)  # any iterable of prompts
    assert [o.prompt_token_ids[-2:] for o in outs][1] == [5, 6]


def test_a_prompt_past_the_context_gets_only_the_engines_error(llm):
    # The demo tokenizer's model_max_length is 2048: transformers used to log its own "Token indices
    # sequence length is longer than the specified maximum" warning before the engine's ValueError.
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # transformers' loggers do not propagate to the root logger
    logging.getLogger("transformers").addHandler(handler)
    try:
        with pytest.raises(ValueError, match="maximum context length is 256"):
            llm.generate(["hi " * 3000], SamplingParams(max_tokens=8), use_tqdm=False)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not [r for r in records if "Token indices sequence length" in r.getMessage()]


def test_prompt_logprobs_cover_the_prompt_once_whatever_n(llm):
    # With n = 2 each child computed the prompt and both lists were appended: 2 * len - 1 entries. Only the
    # first child asks for them now; the others may start from the prefix it cached.
    children = llm.llm_engine.input_processor.process("r", PROMPT, SamplingParams(n=3, prompt_logprobs=1, max_tokens=2))
    assert [c.sampling_params.prompt_logprobs for c in children] == [1, None, None]
    for n in (1, 2):
        (out,) = llm.generate([PROMPT], SamplingParams(n=n, max_tokens=2, prompt_logprobs=1, seed=3), use_tqdm=False)
        lps = out.prompt_logprobs
        assert len(lps) == len(out.prompt_token_ids) and lps[0] is None
        assert all(tid in pos and 1 <= len(pos) <= 2 for tid, pos in zip(out.prompt_token_ids[1:], lps[1:],
                                                                           strict=True))


def test_prompt_logprobs_in_slices_equal_the_whole(llm, monkeypatch):
    # The logits of prompt positions are made PROMPT_LOGPROB_ROWS at a time (a whole chunk's float32 logits are
    # not in the memory profile): slices of 3 rows give what one slice gives.
    from deepserve.runner import model_runner

    prompt = PROMPT * 3
    params = SamplingParams(max_tokens=1, prompt_logprobs=2, seed=3)
    (whole,) = llm.generate([prompt], params, use_tqdm=False)
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROB_ROWS", 3)
    model, rows = llm.llm_engine.core.runner.model, []
    head = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda h: rows.append(h.shape[0]) or head(h))
    (sliced,) = llm.generate([prompt], params, use_tqdm=False)
    assert max(rows) == 3 and sum(rows) == len(whole.prompt_token_ids) - 1 + 1  # the prompt's slices, the sample
    assert len(whole.prompt_token_ids) > 7 and sliced.prompt_logprobs[0] is None
    for got, want in zip(sliced.prompt_logprobs[1:], whole.prompt_logprobs[1:], strict=True):
        assert got.keys() == want.keys()  # the same tokens (target and top 2) at the same ranks
        assert all(got[t].rank == want[t].rank and got[t].logprob == pytest.approx(want[t].logprob, abs=1e-5)
                   for t in want)  # the LM head's product sums in another order for 3 rows than for 30


def test_unknown_llm_argument_is_named():
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(max_num_seq=4)


def test_chat_applies_the_template(llm):
    (out,) = llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=4), use_tqdm=False)
    tok = llm.get_tokenizer()
    prompt_text = tok.decode(out.prompt_token_ids)
    assert "<｜User｜>Hi!" in prompt_text and prompt_text.endswith("<｜Assistant｜>")
    assert prompt_text.count("<｜begin▁of▁sentence｜>") == 1


def test_cli_generate_prints_json(capsys):
    rc = main(["generate", "Hello", "--max-tokens", "4", "--json", "--device", "cpu",
               "--num-gpu-blocks-override", "64", "--max-model-len", "128"])
    assert rc == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["prompt"] == "Hello" and len(record["token_ids"]) <= 4


def test_cli_reports_bad_flags_as_errors(capsys):
    rc = main(["generate", "Hello", "--max-model-len", "999999", "--device", "cpu"])
    assert rc == 2
    assert "--max-model-len" in capsys.readouterr().err


def test_cli_hf_overrides_replace_config_fields():
    import argparse

    from deepserve.entrypoints.cli import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--hf-overrides", '{"num_hidden_layers": 8}', "--load-format", "dummy"])
    config = engine_args_from(ns, "deepseek-v3").create_engine_config()
    assert config.model.hf_config.num_hidden_layers == 8  # the preset has 61
    with pytest.raises(SystemExit):
        parser.parse_args(["--hf-overrides", "[8]"])


def test_swap_space_is_validated_and_refused_under_pipeline_parallelism():
    from deepserve.config import CacheConfig, EngineArgs

    with pytest.raises(ValueError, match=r"swap_space \(--swap-space\) must be >= 0"):
        CacheConfig(swap_space=-1.0)
    with pytest.raises(ValueError, match="--swap-space"):
        EngineArgs(device="cpu", swap_space=1.0, pipeline_parallel_size=2).create_engine_config()


def test_start_up_phases_are_timed():
    import time

    from deepserve import LLM

    test_start = time.monotonic()
    time.sleep(0.5)
    test_age = time.monotonic() - test_start
    llm = LLM(device="cpu")
    phases = llm.llm_engine.core.startup_s
    # The demo model has a tokenizer: structured output's warm-up comes first (DEEPSERVE_GRAMMAR_WARMUP).
    assert list(phases) == ["grammar_warmup", "load", "kv_cache_sizing", "kv_cache_and_graphs", "process_age_at_load"]
    assert all(v >= 0 for v in phases.values()) and phases["load"] > 0
    # The process's age when loading began: older than this test was before it built the engine (the
    # /proc clock ticks are 10 ms).
    assert phases["process_age_at_load"] >= test_age - 0.02


def test_reset_prefix_cache_makes_the_next_run_compute_its_prompts_in_full(llm):
    prompt = list(range(1, 70))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine = llm.llm_engine
    llm.generate([prompt], params, use_tqdm=False)
    before = engine.stats()
    second = llm.generate([prompt], params, use_tqdm=False)
    hits = engine.stats().prefix_cache_hits_total - before.prefix_cache_hits_total
    assert hits >= 64  # the 4 full blocks of 16 tokens came from the cache
    assert llm.reset_prefix_cache()
    before = engine.stats()
    third = llm.generate([prompt], params, use_tqdm=False)
    assert engine.stats().prefix_cache_hits_total == before.prefix_cache_hits_total
    assert third[0].outputs[0].token_ids == second[0].outputs[0].token_ids  # greedy: same tokens either way


def test_reset_prefix_cache_is_refused_while_a_request_is_unfinished(llm):
    engine = llm.llm_engine
    engine.add_request("held", list(range(1, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    assert not llm.reset_prefix_cache()
    engine.abort_request("held")
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.reset_prefix_cache()


def test_trust_remote_code_is_accepted_and_said_once_to_have_no_effect(caplog):
    import logging

    from deepserve.config import EngineArgs, note_trust_remote_code
    from deepserve.entrypoints.cli import build_parser

    note_trust_remote_code.cache_clear()
    with caplog.at_level(logging.INFO, logger="deepserve.config"):
        llm = LLM(device="cpu", num_gpu_blocks_override=16, max_model_len=64, trust_remote_code=True)
        EngineArgs(trust_remote_code=True)
    assert llm.engine_args.trust_remote_code
    said = [r for r in caplog.records if "trust_remote_code has no effect" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert build_parser().parse_args(["serve", "--trust-remote-code"]).trust_remote_code


def test_chat_takes_tools_and_continue_final_message_as_the_server_does(llm):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {}}}}]
    (out,) = llm.chat([{"role": "user", "content": "Paris?"}], {"max_tokens": 2}, use_tqdm=False, tools=tools)
    assert "### get_weather" in out.prompt
    conversation = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "The answer is"}]
    (out,) = llm.chat(conversation, SamplingParams(max_tokens=2), use_tqdm=False, add_generation_prompt=False,
                      continue_final_message=True)
    assert out.prompt.endswith("The answer is")
    # The server's checks and words: the pair, a custom template, a malformed tool.
    with pytest.raises(ValueError, match="set add_generation_prompt to false"):
        llm.chat(conversation, use_tqdm=False, continue_final_message=True)
    with pytest.raises(ValueError, match="a chat template cannot be supplied.*the model's own is used"):
        llm.chat(conversation, use_tqdm=False, chat_template="{{ messages }}")
    with pytest.raises(ValueError, match=r"^tools\.0\.function"):
        llm.chat(conversation, use_tqdm=False, tools=[{"type": "function", "function": {}}])


def test_sampling_params_may_be_a_dict_and_a_bad_one_is_named(llm):
    (out,) = llm.generate("Hello", {"max_tokens": 2, "ignore_eos": True}, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match=r"^sampling_params: .*unknown field\(s\) \['max_token'\]"):
        llm.generate("Hello", {"max_token": 2}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^sampling_params\[1\]: "):
        llm.generate(["a", "b"], [{"max_tokens": 2}, {"max_tokens": 2, "n": 0}], use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        llm.generate("Hello", 5, use_tqdm=False)


def test_bad_engine_arguments_are_refused_naming_the_field():
    from deepserve.config import CacheConfig, EngineArgs

    with pytest.raises(TypeError, match="seed must be an integer, got None"):
        EngineArgs(seed=None)
    assert EngineArgs(hf_overrides='{"num_hidden_layers": 1}').hf_overrides == {"num_hidden_layers": 1}
    with pytest.raises(ValueError, match=r"hf_overrides .* must be a JSON object .*, got list"):
        EngineArgs(hf_overrides="[1]")
    with pytest.raises(ValueError, match="hf_overrides .* must be a JSON object"):
        EngineArgs(hf_overrides="{a: 1}")
    for gib in (0, -1, float("nan")):  # 0 and -1 used to leave a 16-token cache
        with pytest.raises(ValueError, match=r"cpu_kv_cache_gib \(--cpu-kv-cache-gib\) must be > 0"):
            CacheConfig(cpu_kv_cache_gib=gib)
    with pytest.raises(ValueError, match="'bogus' is not supported; use one of fp8, awq, gptq, or none"):
        EngineArgs(quantization="bogus", device="cpu").create_engine_config()
