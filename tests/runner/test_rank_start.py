"""runner/rank_start.py: ranks forked from the fork server run under the environment their parent has
when it starts them (not the server's, fixed at its start), import deepserve's switches under it, see
the starting process as their parent, and the server imports no deepserve module."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deepserve.runner.rank_start import rank_context, start_rank

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the fork server is Linux's default here")


def report(path: str) -> None:
    """A rank's target: what it sees, written to `path`."""
    import multiprocessing as mp

    from deepserve.layers import fusion

    with open(path, "w") as f:
        json.dump({"marker": os.environ.get("DEEPSERVE_TEST_MARKER"), "elementwise": fusion.TRITON_ELEMENTWISE,
                   "parent": mp.parent_process().pid}, f)


def _run(tmp_path, monkeypatch, name: str, env: dict[str, str]) -> dict:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    path = tmp_path / f"{name}.json"
    proc = start_rank(rank_context(), "tests.runner.test_rank_start.report", (str(path),), name)
    proc.join(120)
    assert proc.exitcode == 0
    return json.loads(path.read_text())


def test_each_rank_gets_its_parents_environment_at_its_start(tmp_path, monkeypatch):
    monkeypatch.delenv("DEEPSERVE_RANK_START_METHOD", raising=False)
    assert rank_context().get_start_method() == "forkserver"
    first = _run(tmp_path, monkeypatch, "first", {"DEEPSERVE_TEST_MARKER": "one",
                                                   "DEEPSERVE_TRITON_ELEMENTWISE": "1"})
    # The server is running now, with the environment above; the next rank must not get that one.
    second = _run(tmp_path, monkeypatch, "second", {"DEEPSERVE_TEST_MARKER": "two",
                                                     "DEEPSERVE_TRITON_ELEMENTWISE": "0"})
    assert (first["marker"], first["elementwise"]) == ("one", True)
    assert (second["marker"], second["elementwise"]) == ("two", False)
    assert first["parent"] == second["parent"] == os.getpid()


def test_spawn_is_the_other_method_and_a_wrong_one_is_named(monkeypatch):
    monkeypatch.setenv("DEEPSERVE_RANK_START_METHOD", "spawn")
    assert rank_context().get_start_method() == "spawn"
    monkeypatch.setenv("DEEPSERVE_RANK_START_METHOD", "fork")
    with pytest.raises(ValueError, match="DEEPSERVE_RANK_START_METHOD must be one of forkserver, spawn"):
        rank_context()


def test_the_target_is_unpickled_before_the_environment_is_applied_so_it_imports_no_switch():
    # Unpickling a rank's target imports deepserve.runner.rank_start (and the deepserve package) under the
    # server's environment: none of that may read a switch at import or pull in a module that does.
    code = ("import sys, deepserve.runner.rank_start\n"
            "print([m for m in sys.modules if m.startswith(('deepserve.layers', 'deepserve.kernels', "
            "'deepserve.models', 'deepserve.runner.worker', 'deepserve.runner.model_runner'))])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr[-2000:]
