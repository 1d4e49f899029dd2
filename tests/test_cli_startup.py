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
