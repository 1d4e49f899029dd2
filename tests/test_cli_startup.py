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
                                  ["bench", "serve", "--help"]])
def test_help_version_and_argument_errors_import_nothing_heavy(argv):
    done = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True,
                          timeout=120)
    assert "HEAVY " in done.stdout, done.stderr[-2000:]
    assert done.stdout.split("HEAVY ")[-1].strip() == "", done.stdout


# Every command whose function calls engine_args_from, with the positionals it needs.
ENGINE_COMMANDS = {("generate",): ["hi"], ("chat",): ["hi"], ("serve",): [], ("bench", "throughput"): [],
                   ("bench", "latency"): []}


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


def test_help_states_each_default_once():
    # argparse's defaults formatter appended "(default: None)" after help texts that already said what the
    # default is ("tokenizer folder (default: the model's) (default: None)").
    import contextlib
    import io

    from deepserve.entrypoints.cli import build_parser

    for argv in (["serve", "--help"], ["generate", "--help"], ["bench", "throughput", "--help"]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            build_parser().parse_args(argv)
        text = " ".join(out.getvalue().split())
        assert "(default: None)" not in text and "tokenizer folder (default: the model's)" in text
        assert "(default: the model's) (default" not in text


def test_generate_on_a_shape_preset_gets_the_vocabulary_tokenizer(tmp_path, monkeypatch, capsys):
    # Once it loaded the whole preset and then refused: "text prompts need a tokenizer" (serve had the fix).
    from deepserve.entrypoints.cli import main

    monkeypatch.setenv("DEEPSERVE_CACHE_DIR", str(tmp_path))
    overrides = ('{"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, '
                 '"num_key_value_heads": 4}')
    assert main(["generate", "--model", "deepseek-llm-7b", "--load-format", "dummy", "--device", "cpu",
                 "--dtype", "float32", "--max-model-len", "128", "--hf-overrides", overrides, "--max-tokens", "3",
                 "--json", "Hello"]) == 0
    assert '"Hello"' in capsys.readouterr().out
