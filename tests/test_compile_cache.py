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


def test_packages_without_cached_bytecode_are_named(tmp_path, monkeypatch, caplog):
    import importlib
    import sys

    from deepserve import compile_cache

    for name, cached in (("fresh_pkg", False), ("cached_pkg", True)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("VALUE = 1\n")
        if cached:
            import py_compile

            py_compile.compile(str(tmp_path / name / "__init__.py"), cfile=importlib.util.cache_from_source(
                str(tmp_path / name / "__init__.py")))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # as PYTHONDONTWRITEBYTECODE=1: nothing written now
    for name in ("fresh_pkg", "cached_pkg"):
        monkeypatch.delitem(sys.modules, name, raising=False)
        importlib.import_module(name)
    assert compile_cache.packages_without_bytecode(("fresh_pkg", "cached_pkg", "not_imported")) == ["fresh_pkg"]
    with caplog.at_level("WARNING", logger="deepserve.compile_cache"):
        assert compile_cache.warn_if_imports_compile(("fresh_pkg", "cached_pkg")) == ["fresh_pkg"]
    message = caplog.records[-1].getMessage()
    assert "fresh_pkg" in message and f"compileall -q {tmp_path}" in message and "PYTHONDONTWRITEBYTECODE" in message
