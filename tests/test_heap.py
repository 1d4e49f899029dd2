"""deepserve/heap.py: the start-up heap leaves Python's garbage collection, later cyclic garbage does not."""

from __future__ import annotations

import gc
import weakref

import pytest

from deepserve.heap import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture
def unfrozen():
    assert gc.get_freeze_count() == 0, "an earlier test left objects frozen"
    yield
    gc.unfreeze()


def test_zero_turns_it_off(monkeypatch, unfrozen):
    monkeypatch.setenv("DEEPSERVE_GC_FREEZE", "0")
    assert freeze_startup_heap("test") == 0
    assert gc.get_freeze_count() == 0


def test_on_by_default(monkeypatch, unfrozen):
    monkeypatch.delenv("DEEPSERVE_GC_FREEZE", raising=False)
    assert freeze_startup_heap("test") > 1000
    assert gc.get_freeze_count() > 1000


def test_on_collects_start_up_garbage_then_freezes_the_rest(monkeypatch, unfrozen, caplog):
    monkeypatch.setenv("DEEPSERVE_GC_FREEZE", "1")
    garbage, kept = Node(), Node()
    dead = weakref.ref(garbage)
    del garbage
    with caplog.at_level("INFO", logger="deepserve.heap"):
        frozen = freeze_startup_heap("test")
    assert dead() is None  # start-up's cyclic garbage was collected first, not frozen
    assert frozen > 1000 and gc.get_freeze_count() > 1000  # this interpreter's imports
    assert not any(o is kept for o in gc.get_objects())  # frozen: in no generation the collector walks
    assert "test: " in caplog.text and "start-up objects kept out of garbage collection" in caplog.text


def test_cycles_made_after_the_freeze_are_still_collected(monkeypatch, unfrozen):
    monkeypatch.setenv("DEEPSERVE_GC_FREEZE", "1")
    freeze_startup_heap("test")
    later = Node()
    dead = weakref.ref(later)
    del later
    gc.collect()
    assert dead() is None


def test_the_frozen_heap_is_unfrozen_at_exit():
    # At exit the frozen objects go back to the collector, so the interpreter's last collections free them
    # (left frozen, Triton's nanobind bindings printed "leaked instances" on every server stop).
    import os
    import subprocess
    import sys

    code = ("import atexit, gc\n"
            "from deepserve.heap import freeze_startup_heap\n"
            "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count()))\n"
            "assert freeze_startup_heap('test') > 0 and gc.get_freeze_count() > 0\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "DEEPSERVE_GC_FREEZE": "1"})
    assert out.returncode == 0, out.stderr
    assert "frozen at exit: 0" in out.stdout  # atexit runs the last registered first: the unfreeze, then the print


def _generate_watching_the_freeze(monkeypatch, flag: str) -> list[int]:
    """The demo model's generate, recording gc.get_freeze_count() at each engine step."""
    from deepserve import LLM, SamplingParams

    monkeypatch.setenv("DEEPSERVE_GC_FREEZE_GENERATE", flag)
    llm = LLM(device="cpu", num_gpu_blocks_override=64, max_model_len=128)
    seen, step = [], llm.llm_engine.step

    def watched():
        seen.append(gc.get_freeze_count())
        return step()

    monkeypatch.setattr(llm.llm_engine, "step", watched)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    return seen


def test_generate_freezes_the_heap_only_while_it_runs(monkeypatch, unfrozen):
    # DEEPSERVE_GC_FREEZE_GENERATE=1: every step runs with the start-of-call heap frozen, and the call leaves
    # it unfrozen; a cycle that existed before the call and died in it is freed once it returns.
    before = Node()
    dead = weakref.ref(before)
    seen = _generate_watching_the_freeze(monkeypatch, "1")
    assert len(seen) >= 3 and all(count > 1000 for count in seen)
    assert gc.get_freeze_count() == 0
    del before
    gc.collect()
    assert dead() is None


def test_generate_leaves_the_heap_alone_when_off_or_frozen_already(monkeypatch, unfrozen):
    assert set(_generate_watching_the_freeze(monkeypatch, "0")) == {0}
    monkeypatch.setenv("DEEPSERVE_GC_FREEZE", "1")
    kept = Node()
    freeze_startup_heap("test")  # a serving process: its freeze outlives any generate
    seen = _generate_watching_the_freeze(monkeypatch, "1")
    assert all(count > 1000 for count in seen) and gc.get_freeze_count() > 1000
    assert not any(o is kept for o in gc.get_objects())  # still frozen: generate did not unfreeze it
