"""Compiled-kernel caches go under DEEPSERVE_CACHE_DIR unless the user pointed them elsewhere."""

from __future__ import annotations

import os

import pytest

from deepserve.compile_cache import configure_compile_caches

VARIABLES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


@pytest.fixture(autouse=True)
def unset_cache_variables(monkeypatch):
    # set, then delete: monkeypatch then restores each variable's state from before the test, whatever
    # configure_compile_caches writes into os.environ
    for variable in VARIABLES:
        monkeypatch.setenv(variable, "placeholder")
        monkeypatch.delenv(variable)


def test_caches_default_under_deepserve_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPSERVE_CACHE_DIR", str(tmp_path))
    chosen = configure_compile_caches()
    assert chosen == {"TRITON_CACHE_DIR": str(tmp_path / "triton"),
                      "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton") and (tmp_path / "inductor").is_dir()


def test_users_own_cache_dirs_win(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPSERVE_CACHE_DIR", str(tmp_path / "ours"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "theirs"))
    chosen = configure_compile_caches()
    assert chosen["TRITON_CACHE_DIR"] == str(tmp_path / "theirs")
    assert chosen["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "ours" / "inductor")


def test_unwritable_cache_dir_leaves_the_defaults(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("DEEPSERVE_CACHE_DIR", str(blocker))
    assert configure_compile_caches() == {}
    assert "TRITON_CACHE_DIR" not in os.environ
