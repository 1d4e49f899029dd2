"""--swap-space is checked against this machine's memory before anything loads: refused past 70 % (all of
the node's GPUs counted), warned past 40 %."""

from __future__ import annotations

import logging

import pytest

from deepserve.config import EngineArgs
from deepserve.host_memory import check_swap_space, total_host_memory_bytes

GIB = 2**30


def test_the_machine_memory_is_read():
    total = total_host_memory_bytes()
    assert total is not None and total > GIB  # every machine the tests run on has more than 1 GiB


def test_a_host_tier_past_seventy_percent_is_refused_counting_every_gpu_of_the_node():
    check_swap_space(16, 4, total=100 * GIB)  # 64 %: allowed
    with pytest.raises(ValueError, match=r"--swap-space \(swap_space\) 16 GiB per GPU x 5 GPU\(s\) .* 80% .* "
                                         r"use at most 14\.0 GiB"):
        check_swap_space(16, 5, total=100 * GIB)


def test_past_forty_percent_is_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="deepserve.host_memory"):
        check_swap_space(50, 1, total=100 * GIB)
        check_swap_space(10, 1, total=100 * GIB)
    assert len(caplog.records) == 1 and "50 GiB per GPU" in caplog.records[0].getMessage()


def test_the_engine_refuses_a_swap_space_larger_than_the_machine_before_loading():
    too_much = 2 * total_host_memory_bytes() / GIB
    with pytest.raises(ValueError, match=r"--swap-space \(swap_space\)"):
        EngineArgs(device="cpu", swap_space=too_much).create_engine_config()
    EngineArgs(device="cpu", swap_space=0.25).create_engine_config()  # a small tier is fine


@pytest.mark.parametrize(("text", "expected"), [("8589934592\n", 8 * GIB), ("max\n", None), ("garbage", None)])
def test_a_container_limit_below_the_physical_memory_wins(tmp_path, monkeypatch, text, expected):
    from deepserve import host_memory

    limit = tmp_path / "memory.max"
    limit.write_text(text)
    monkeypatch.setattr(host_memory, "_CGROUP_LIMITS", (str(tmp_path / "missing"), str(limit)))
    physical = host_memory.os.sysconf("SC_PAGE_SIZE") * host_memory.os.sysconf("SC_PHYS_PAGES")
    want = min(physical, expected) if expected else physical
    assert total_host_memory_bytes() == want
