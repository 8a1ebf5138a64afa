"""A storage wait on one node reaches the watchdogs of the others through the job's store (a real TCPStore,
in this process): pipeline/train/storage_wait.py. Two nodes are two beacons in two folders."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest

from tests.integration.runs import free_port

torch_dist = pytest.importorskip("torch.distributed")


@pytest.fixture()
def store_port():
    port = free_port()
    server = torch_dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5),
                                 wait_for_workers=False)
    yield port
    del server


def retrying(beacon, for_s: float, what: str) -> None:
    """What RetryPolicy.waiting does: the beacon's time moved to when the next attempt will have answered."""
    from pipeline.remote.retry import RetryPolicy

    RetryPolicy(timeout_s=0.0, beacon=str(beacon)).waiting(for_s, what)


def seen(waits):
    """The wait `waits` sees once the store has taken the other client's set (a TCPStore set is not answered:
    another connection's read can come first by a few milliseconds)."""
    for _ in range(100):
        wait = waits.wait()
        if wait is not None:
            return wait
        time.sleep(0.02)
    raise AssertionError("no wait seen in 2 s")


def test_a_wait_on_node_b_is_seen_by_node_a_as_the_seconds_it_holds_and_once(tmp_path, store_port) -> None:
    from pipeline.train.storage_wait import StorageWaits, job_store

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a = StorageWaits(str(tmp_path / "a" / "beacon"), job_store("127.0.0.1", store_port))
    b = StorageWaits(str(tmp_path / "b" / "beacon"), job_store("127.0.0.1", store_port))
    assert a.wait() is None and b.wait() is None  # nobody waits
    retrying(tmp_path / "b" / "beacon", 30.0, "retry 2/9 of s3://x/y.tar: HTTP 503")
    assert a.wait() is None  # not passed on yet: node b's watchdog has not ticked
    b.share()
    since, what = seen(a)
    assert -30.5 < since < -29.0 and what == f"retry 2/9 of s3://x/y.tar: HTTP 503, on node {os.uname()[1]}"
    since_b, what_b = b.wait()  # node b: its own beacon, not its own key read back
    assert since_b < -29.0 and what_b == "retry 2/9 of s3://x/y.tar: HTTP 503"
    b.share()  # the beacon did not move: nothing new is sent, and node a's count goes on from its first read
    time.sleep(0.2)
    assert a.wait()[0] > since + 0.1
    # A later watchdog (an elastic restart) does not take what was there before it as a new wait
    c = StorageWaits(str(tmp_path / "a" / "beacon"), job_store("127.0.0.1", store_port))
    assert c.wait() is None


def test_a_wait_that_is_over_is_not_passed_on(tmp_path, store_port) -> None:
    from pipeline.train.storage_wait import StorageWaits, job_store

    b = StorageWaits(str(tmp_path / "beacon"), job_store("127.0.0.1", store_port))
    retrying(tmp_path / "beacon", -5.0, "over")  # its time is past: nothing to pass on
    b.share()
    a = StorageWaits(str(tmp_path / "none"), job_store("127.0.0.1", store_port))
    assert a.wait() is None


SILENT_HOST = """
import sys, time
from datetime import timedelta
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
print("up", flush=True)
time.sleep(300)
"""


@pytest.mark.slow  # a process of its own that imports torch (the store's host, to be stopped)
def test_a_peers_watchdog_says_the_hang_when_the_stores_host_is_stopped(tmp_path, monkeypatch) -> None:
    """Rank 0 stopped (SIGSTOP) under TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the job's store lives in its process
    and holds a client's call for ever. Its peer's watchdog must still fire, dist.timeout_s plus at most one
    STORE_TIMEOUT_S after the last progress, and its later ticks must not wait on the store again."""
    import signal
    import subprocess
    import sys
    import threading

    from pipeline.train import storage_wait
    from pipeline.train.watchdog import Watchdog

    port = free_port()
    host = subprocess.Popen([sys.executable, "-c", SILENT_HOST, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout.readline().strip() == "up"
        waits = storage_wait.StorageWaits(str(tmp_path / "beacon"), storage_wait.job_store("127.0.0.1", port))
        assert waits.store is not None and waits.wait() is None  # the store answers: nobody waits
        os.kill(host.pid, signal.SIGSTOP)
        monkeypatch.setattr(storage_wait, "STORE_TIMEOUT_S", 1.0)
        fired = threading.Event()
        monkeypatch.setattr(Watchdog, "_fire", lambda self, *args: fired.set())
        start = time.monotonic()
        dog = Watchdog(1.0, rank=1, run_dir=tmp_path, storage=waits)
        try:
            assert fired.wait(20), "the watchdog sat in the stopped store and never fired"
            assert time.monotonic() - start < 1.0 + 1.0 + 1.5
            again = time.monotonic()  # the call still out: the next ones do not wait for it
            assert waits.wait() is None and time.monotonic() - again < 0.5
        finally:
            dog._stop.set()
    finally:
        os.kill(host.pid, signal.SIGCONT)
        host.kill()
        host.wait()
