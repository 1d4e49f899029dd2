"""compile_watch: Triton kernel variants loaded after start-up, counted through Triton's kernel-load hook.

On CPU, Triton's interpreter never compiles or loads a binary, so these tests call the hook chain the way
triton/compiler/compiler.py's CompiledKernel._init_handles does: (module, function, name, metadata_group,
hash), positionally."""

from __future__ import annotations

import pytest

from deepserve.compile_watch import CompileWatch, compiles_between

triton = pytest.importorskip("triton")
from triton import knobs  # noqa: E402


@pytest.fixture
def chain(monkeypatch):
    """A fresh kernel-load hook chain for the test (the real one is process-wide)."""
    fresh = type(knobs.runtime.kernel_load_end_hook)(reversed=True)
    monkeypatch.setattr(knobs.runtime, "kernel_load_end_hook", fresh)
    return fresh


def _load(chain, name: str) -> None:
    chain(object(), object(), name, {}, "0123abcd")


def test_counts_only_after_arm_and_names_the_kernels(chain, caplog):
    watch = CompileWatch()
    assert watch.install() and watch.install()  # idempotent: one entry in the chain
    assert chain.calls == [watch._loaded]
    _load(chain, "_fused_moe_gemm_kernel")  # start-up: expected, not counted
    assert watch.snapshot()["triton_compiles"] == 0
    watch.arm()
    before = watch.snapshot()
    with caplog.at_level("WARNING", logger="deepserve.compile_watch"):
        for name in ("_fused_moe_gemm_kernel", "_fused_moe_gemm_kernel", "_moe_align_kernel"):
            _load(chain, name)
    after = watch.snapshot()
    assert after["triton_compiles"] == 3
    assert after["triton_kernels"] == {"_fused_moe_gemm_kernel": 2, "_moe_align_kernel": 1}
    delta = compiles_between(before, after)
    assert delta["triton_compiles"] == 3 and delta["triton_kernels"] == after["triton_kernels"]
    assert compiles_between(after, watch.snapshot()) == {"watching": True, "triton_compiles": 0,
                                                          "triton_kernels": {}, "dynamo_graphs": 0}
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2  # once per kernel
    assert any("_moe_align_kernel" in m and "after start-up" in m for m in warned)


def test_other_hooks_in_the_chain_still_run(chain):
    seen = []
    chain.add(lambda *args: seen.append(args[2]))
    watch = CompileWatch()
    watch.install()
    watch.arm()
    _load(chain, "k1")
    assert seen == ["k1"] and watch.snapshot()["triton_compiles"] == 1


def test_rearming_starts_the_count_again(chain):
    watch = CompileWatch()
    watch.install()
    watch.arm()
    _load(chain, "a")
    watch.arm()  # a second engine in the same process
    assert watch.snapshot()["triton_compiles"] == 0


def test_a_watch_that_could_not_install_says_so(monkeypatch):
    monkeypatch.setattr(knobs.runtime, "kernel_load_end_hook", None)  # a Triton without the hook chain
    watch = CompileWatch()
    assert not watch.install()
    watch.arm()
    assert watch.snapshot()["watching"] is False  # zero compiles here means "not counted", not "none"
