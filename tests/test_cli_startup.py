"""The CLI answers --help, --version and argument errors without importing torch or FastAPI: those
imports took ~25 s (10 s of CPU) on a cold 2-core machine, for a command that prints a few lines."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

PROBE = """
import sys
from deepserve.entrypoints.cli import main
try:
    main({argv!r})
except SystemExit:
    pass
heavy = sorted(m for m in ("torch", "fastapi", "uvicorn", "transformers") if m in sys.modules)
print("HEAVY", ",".join(heavy))
"""


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["serve", "--help"], ["plan", "--help"],
                                  ["bench", "throughput", "--help"], ["generate", "--no-such-flag"],
                                  ["encrypt-model", "--help"], ["audit", "verify", "--help"], ["router", "--help"],
                                  ["bench", "serve", "--help"], ["run-batch", "--help"]])
def test_help_version_and_argument_errors_import_nothing_heavy(argv):
    done = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True,
                          timeout=120)
    assert "HEAVY " in done.stdout, done.stderr[-2000:]
    assert done.stdout.split("HEAVY ")[-1].strip() == "", done.stdout


# Every command whose function calls engine_args_from, with the positionals it needs.
ENGINE_COMMANDS = {("generate",): ["hi"], ("chat",): ["hi"], ("serve",): [], ("bench", "throughput"): [],
                   ("bench", "latency"): [], ("run-batch",): ["-i", "in.jsonl", "-o", "out.jsonl"]}


def _leaf_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from _leaf_parsers(sub, (*path, name))


def test_the_commands_with_engine_flags_are_the_engine_commands():
    from deepserve.entrypoints.cli import build_parser

    found = {path for path, p in _leaf_parsers(build_parser()) if p.get_default("_engine_dests")}
    assert found == set(ENGINE_COMMANDS)


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_every_engine_flag_reaches_the_engine_args(command):
    # Each EngineArgs field that add_engine_args gives a flag is read by name: set them all to values
    # other than their defaults and every one must arrive (--decryption-key-file was once parsed and dropped).
    import dataclasses

    from deepserve.config import EngineArgs
    from deepserve.entrypoints.cli import _engine_args, build_parser

    ns = build_parser().parse_args([
        *command, "--decryption-key-file", "/k", "--hf-overrides", '{"num_hidden_layers": 2}', "--seed", "7",
        "--quantization", "fp8", "--kv-cache-dtype", "fp8", "--swap-space", "3", "--enable-expert-parallel",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}', "--max-num-seqs", "5",
        "--no-async-scheduling", "--enforce-eager", "--load-format", "dummy", "--cpu-kv-cache-gib", "0.5",
        *ENGINE_COMMANDS[command]])
    ns.skip_tokenizer_init = True  # a same-named attribute that no engine flag set is not read
    args = _engine_args(ns, "some-model")
    assert (args.model, args.decryption_key_file, args.hf_overrides, args.seed) == (
        "some-model", "/k", {"num_hidden_layers": 2}, 7)
    assert (args.quantization, args.kv_cache_dtype, args.swap_space, args.enable_expert_parallel) == (
        "fp8", "fp8", 3, True)
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    assert (args.max_num_seqs, args.async_scheduling, args.enforce_eager, args.load_format) == (5, False, True, "dummy")
    assert args.cpu_kv_cache_gib == 0.5 and args.skip_tokenizer_init is False
    unflagged = {f.name for f in dataclasses.fields(EngineArgs)} - set(ns._engine_dests)
    assert unflagged == {"model", "skip_tokenizer_init"}  # every other engine setting has a flag, and arrives


@pytest.mark.parametrize("argv", [["bench", "serve", "--base-url", "http://x", "--model", "m", "--seed", "5"],
                                  ["plan", "deepseek-v3", "--max-model-len", "64", "-tp", "8"]])
def test_a_command_without_engine_flags_lends_none_of_its_own(argv):
    # bench serve's --seed seeds its dataset and plan's --max-model-len sizes a plan: same names as engine
    # fields, other meanings. Were either command to build an engine, they must not flow into it silently.
    from deepserve.entrypoints.cli import _engine_args, build_parser

    with pytest.raises(TypeError, match="add_engine_args"):
        _engine_args(build_parser().parse_args(argv), "m")


def test_help_states_each_default_once(monkeypatch):
    # Each flag of a DefaultsHelp command with a default states it exactly once: argparse's "(default: X)"
    # or the help's own words ("(default: the model's)"). Once, "tokenizer folder (default: the model's)
    # (default: None)"; then the word "default" used otherwise hid --enable-auto-tool-choice's; and argparse
    # shows nothing for a flag without help (bench throughput's --num-seqs).
    import re

    from deepserve.entrypoints.cli import DefaultsHelp, build_parser

    monkeypatch.setenv("COLUMNS", "200")
    parsers = {path: p for path, p in _leaf_parsers(build_parser()) if p.formatter_class is DefaultsHelp}
    assert set(ENGINE_COMMANDS) <= set(parsers)
    for path, parser in parsers.items():
        entries = [" ".join(e.split()) for e in re.split(r"\n(?=  -)", parser.format_help())]
        for action in parser._actions:
            if not action.option_strings or action.default is argparse.SUPPRESS:
                continue
            (entry,) = [e for e in entries if re.match(re.escape(action.option_strings[0]) + r"(?:[ ,]|$)", e)]
            said = len(re.findall(r"\(default", entry, re.IGNORECASE))
            assert said == 1 if action.default is not None else said <= 1, (path, entry)
            assert "(default: None)" not in entry, (path, entry)
    flat = {path: " ".join(p.format_help().split()) for path, p in parsers.items()}
    assert "--tokenizer PATH tokenizer folder (default: the model's) --dtype" in flat[("generate",)]
    assert "--model MODEL checkpoint folder (default: the built-in demo model)" in flat[("generate",)]
    assert "--port PORT TCP port to listen on (default: 8000)" in flat[("serve",)]
    assert "(the default when a request has tools); needs --tool-call-parser (default: False)" in flat[("serve",)]
    assert "--num-seqs NUM_SEQS W1's number of requests (default: 256)" in flat[("bench", "throughput")]


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_generate_and_chat_on_a_shape_preset_get_the_vocabulary_tokenizer(tmp_path, monkeypatch, capsys, command):
    # Once it loaded the whole preset and then refused: "text prompts need a tokenizer" (serve had the fix).
    # chat also needs the tokenizer's chat template (DeepSeek's turn markers).
    import json

    from deepserve.entrypoints.cli import main

    monkeypatch.setenv("DEEPSERVE_CACHE_DIR", str(tmp_path))
    overrides = ('{"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, '
                 '"num_key_value_heads": 4}')
    assert main([command, "--model", "deepseek-llm-7b", "--load-format", "dummy", "--device", "cpu",
                 "--dtype", "float32", "--max-model-len", "128", "--hf-overrides", overrides, "--max-tokens", "3",
                 "--json", "Hello"]) == 0
    (out,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(out["token_ids"]) == 3 and out["finish_reason"] == "length"
    want = "Hello" if command == "generate" else "<｜User｜>Hello<｜Assistant｜>"
    assert out["prompt"].endswith(want), out["prompt"]


@pytest.mark.parametrize("argv", [["--log-level", "DEBUG", "serve"], ["serve", "--log-level", "DEBUG"],
                                  ["run-batch", "-i", "a", "-o", "b", "--log-level", "DEBUG"]])
def test_log_level_before_or_after_the_command(argv):
    from deepserve.entrypoints.cli import build_parser

    assert build_parser().parse_args(argv).log_level == "DEBUG"
    assert build_parser().parse_args(["serve"]).log_level is None  # the default: INFO for serve, chosen in main


@pytest.mark.parametrize("words", [["generate", "{}", "Hello"], ["chat", "{}"]])
@pytest.mark.parametrize("model", ["folder", "deepseek-v3"])
def test_a_model_given_as_the_first_prompt_is_refused_naming_the_flag(tmp_path, monkeypatch, capsys, words, model):
    # serve and run-batch take the model positionally; `generate ./demo "Hello"` once answered both words as
    # prompts with the built-in demo model, as if it had worked. Refused before anything loads.
    import deepserve.entrypoints.llm as llm
    from deepserve.entrypoints.cli import main

    monkeypatch.setattr(llm, "LLM", lambda **_: pytest.fail("loaded a model"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    assert main([w.format(model) for w in words]) == 2
    err = capsys.readouterr().err
    assert err.startswith("deepserve: error: ") and f"pass the model with --model {model}" in err, err


def test_with_model_given_a_prompt_that_names_a_folder_is_a_prompt(tmp_path, monkeypatch):
    from deepserve.entrypoints.cli import build_parser, refuse_model_as_prompt

    monkeypatch.chdir(tmp_path)
    ns = build_parser().parse_args(["generate", "--model", "m", ".", "deepseek-v3"])
    refuse_model_as_prompt(ns, ns.prompts[0])  # --model says which is the model: nothing to refuse
    refuse_model_as_prompt(build_parser().parse_args(["generate", "Hello"]), "Hello")


@pytest.mark.parametrize("command", [["serve"], ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl"]])
def test_serve_and_run_batch_take_the_model_positionally_or_as_model_flag(command, capsys):
    # As vLLM's serve: `serve ./demo` and `serve --model ./demo` (once "unrecognized arguments: --model").
    from deepserve.entrypoints.cli import build_parser

    parse = build_parser().parse_args
    assert parse([*command, "./demo"]).model == "./demo"
    assert parse([*command, "--model", "./demo"]).model == "./demo"
    assert parse([*command, "./demo", "--model", "demo/"]).model in ("./demo", "demo/")  # the same folder twice
    assert parse(command).model is None  # the built-in demo model
    for argv in ([*command, "./demo", "--model", "./other"], [*command, "--model", "./other", "./demo"]):
        with pytest.raises(SystemExit) as exit_info:
            parse(argv)
        assert exit_info.value.code == 2
        assert "two models given" in capsys.readouterr().err
