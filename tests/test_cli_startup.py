"""The CLI answers --help, --version and argument errors without importing torch or FastAPI: those
imports took ~25 s (10 s of CPU) on a cold 2-core machine, for a command that prints a few lines."""

from __future__ import annotations

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


def test_every_engine_flag_reaches_the_engine_args():
    # Each EngineArgs field that add_engine_args gives a flag is read by name: set them all to values
    # other than their defaults and every one must arrive (--decryption-key-file was once parsed and dropped).
    import dataclasses

    from deepserve.config import EngineArgs
    from deepserve.entrypoints.cli import _engine_args, build_parser

    ns = build_parser().parse_args([
        "generate", "--decryption-key-file", "/k", "--hf-overrides", '{"num_hidden_layers": 2}', "--seed", "7",
        "--quantization", "fp8", "--kv-cache-dtype", "fp8", "--swap-space", "3", "--enable-expert-parallel",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}', "--max-num-seqs", "5",
        "--no-async-scheduling", "--enforce-eager", "--load-format", "dummy", "--cpu-kv-cache-gib", "0.5", "hi"])
    args = _engine_args(ns, "some-model")
    assert (args.model, args.decryption_key_file, args.hf_overrides, args.seed) == (
        "some-model", "/k", {"num_hidden_layers": 2}, 7)
    assert (args.quantization, args.kv_cache_dtype, args.swap_space, args.enable_expert_parallel) == (
        "fp8", "fp8", 3, True)
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    assert (args.max_num_seqs, args.async_scheduling, args.enforce_eager, args.load_format) == (5, False, True, "dummy")
    assert args.cpu_kv_cache_gib == 0.5
    unflagged = {f.name for f in dataclasses.fields(EngineArgs) if not hasattr(ns, f.name)}
    assert unflagged == {"skip_tokenizer_init"}  # every other engine setting has a flag, and arrives


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
