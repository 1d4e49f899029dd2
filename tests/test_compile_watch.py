"""compile_watch: kernel compiles after start-up, counted through Triton's own compile hooks.

On CPU, Triton's interpreter never compiles, so these tests call the hooks the watch installs the way
triton/runtime/jit.py's _call_hook does (keyword arguments, fn a JitFunctionInfo with module and name)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deepserve.compile_watch import CompileWatch, compiles_between

triton = pytest.importorskip("triton")
from triton import knobs  # noqa: E402


@pytest.fixture
def hooks(monkeypatch):
    """Triton's hook slots, restored after the test (they are process-wide)."""
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    return knobs.runtime


def _compile(runtime, name: str, module: str = "deepserve.kernels.fused_moe"):
    fn = SimpleNamespace(module=module, name=name, jit_function=None)
    skipped = runtime.jit_cache_hook(key="k", repr=name, fn=fn, compile={}, is_manual_warmup=False,
                                     already_compiled=False)
    runtime.jit_post_compile_hook(key="k", repr=name, fn=fn, compile={}, is_manual_warmup=False,
                                  already_compiled=False)
    return skipped


def test_counts_only_after_arm_and_names_the_kernels(hooks, caplog):
    watch = CompileWatch()
    assert watch.install() and watch.install()  # idempotent
    _compile(hooks, "_fused_moe_gemm_kernel")  # start-up: expected, not counted
    assert watch.snapshot()["triton_compiles"] == 0
    watch.arm()
    before = watch.snapshot()
    with caplog.at_level("WARNING", logger="deepserve.compile_watch"):
        for name in ("_fused_moe_gemm_kernel", "_fused_moe_gemm_kernel", "_moe_align_kernel"):
            assert not _compile(hooks, name)
    after = watch.snapshot()
    assert after["triton_compiles"] == 3 and after["triton_compile_s"] >= 0
    assert after["triton_kernels"] == {"deepserve.kernels.fused_moe._fused_moe_gemm_kernel": 2,
                                       "deepserve.kernels.fused_moe._moe_align_kernel": 1}
    delta = compiles_between(before, after)
    assert delta["triton_compiles"] == 3 and delta["triton_kernels"] == after["triton_kernels"]
    assert compiles_between(after, watch.snapshot())["triton_compiles"] == 0
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2  # once per kernel
    assert any("_moe_align_kernel" in m and "after start-up" in m for m in warned)


def test_chains_the_hooks_that_were_set_and_keeps_their_verdict(hooks):
    seen = []
    hooks.jit_cache_hook = lambda **kw: (seen.append(("pre", kw["fn"].name)), True)[1]  # True: skip compile
    hooks.jit_post_compile_hook = lambda **kw: seen.append(("post", kw["fn"].name))
    watch = CompileWatch()
    watch.install()
    watch.arm()
    assert _compile(hooks, "k1") is True  # the earlier hook's "skip" still reaches Triton
    assert seen == [("pre", "k1"), ("post", "k1")]
    assert watch.snapshot()["triton_compiles"] == 1


def test_rearming_starts_the_count_again(hooks):
    watch = CompileWatch()
    watch.install()
    watch.arm()
    _compile(hooks, "a")
    watch.arm()  # a second engine in the same process
    assert watch.snapshot()["triton_compiles"] == 0
