"""A CPU rank's intra-op threads (runner/worker.py): the user's OMP_NUM_THREADS when set, even in a rank forked
from a fork server that imported torch under another environment; else the host's cores shared among the node's
ranks, as before."""

from __future__ import annotations

import json
import os
import sys

import pytest

from deepserve.runner import worker
from deepserve.runner.rank_start import rank_context, start_rank

# Distinct from every default share (cpu_count // ranks), so a test cannot pass by coincidence.
USER_THREADS = (os.cpu_count() or 1) + 1


def report_threads(path: str, local_world: int) -> None:
    """A rank's target: the thread count torch runs with once the rank has set it."""
    import torch

    worker.set_cpu_rank_threads(local_world)
    with open(path, "w") as f:
        json.dump({"threads": torch.get_num_threads()}, f)


def test_default_is_the_hosts_cores_shared_among_the_ranks(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = os.cpu_count() or 1
    assert [worker.cpu_rank_threads(n) for n in (1, 2, cores + 1)] == [cores, max(1, cores // 2), 1]


def test_omp_num_threads_is_honoured(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", str(USER_THREADS))
    assert worker.cpu_rank_threads(1) == worker.cpu_rank_threads(4) == USER_THREADS
    monkeypatch.setenv("OMP_NUM_THREADS", "3,2")  # OpenMP's nested form: the outer level
    assert worker.cpu_rank_threads(1) == 3
    cores = os.cpu_count() or 1
    for ignored in ("many", "0"):  # not a count: OpenMP ignores it; the rank takes its share, as with none
        monkeypatch.setenv("OMP_NUM_THREADS", ignored)
        assert worker.cpu_rank_threads(2) == max(1, cores // 2)


def test_worker_main_sets_the_users_count(monkeypatch):
    """The rank's own start (worker_main), stopped where it would join the process group: it used to set
    cpu_count // ranks whatever OMP_NUM_THREADS said."""
    calls = []

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setenv("OMP_NUM_THREADS", str(USER_THREADS))
    monkeypatch.setattr(worker.torch, "set_num_threads", calls.append)
    monkeypatch.setattr(worker, "init_group", stop)
    with pytest.raises(Stop):
        worker.worker_main(1, 2, 0, "gloo", 1.0, None, None, None, None, local_world=1)
    assert calls == [USER_THREADS]


@pytest.mark.skipif(sys.platform != "linux", reason="the fork server is Linux's default here")
def test_a_forked_rank_runs_with_the_users_count(tmp_path, monkeypatch):
    # Set after the fork server may have started (it imported torch under its own environment): the rank
    # applies the count itself.
    monkeypatch.setenv("OMP_NUM_THREADS", str(USER_THREADS))
    path = tmp_path / "threads.json"
    proc = start_rank(rank_context(), "tests.runner.test_cpu_threads.report_threads", (str(path), 1), "threads")
    proc.join(120)
    assert proc.exitcode == 0
    assert json.loads(path.read_text())["threads"] == USER_THREADS
