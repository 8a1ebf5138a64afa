"""A rank whose DataLoader worker raised must exit, not hang. The workers block SIGTERM/SIGUSR1
(`signals.block_in_worker`), and multiprocessing's exit handler ends daemonic children with SIGTERM
and then joins them with no timeout: before `reap_workers_at_exit`, a worker's exception re-raised in the
main process (seen: timm's RandAugment posterize on Pillow 13) left the rank waiting on its worker and
the worker waiting on its parent, for good. A real process, a real worker, a real exception."""

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import torch
    from pipeline.signals import block_in_worker, reap_workers_at_exit

    class Failing(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield 1
            raise ValueError("the sample's transform failed")

    if {reap}:
        reap_workers_at_exit()
    for x in torch.utils.data.DataLoader(Failing(), num_workers=1, worker_init_fn=block_in_worker):
        print("got", int(x), flush=True)
""")


def _run(reap: bool, timeout: float) -> tuple[subprocess.CompletedProcess | None, float]:
    began = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-c", SCRIPT.format(reap=reap)], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - began
    return proc, time.monotonic() - began


@pytest.mark.slow
def test_a_worker_error_ends_the_process_with_exit_1_and_the_error_last():
    proc, took = _run(reap=True, timeout=60)
    assert proc is not None, "the process hung on its DataLoader worker at exit"
    assert proc.returncode == 1 and "got 1" in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "ValueError: the sample's transform failed", proc.stderr[-2000:]  # not "worker killed"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_without_the_reaper_it_hangs():
    # The failure the reaper prevents, shown to exist: the same script without it does not end.
    proc, took = _run(reap=False, timeout=7)  # with the reaper it ends in about 4 s
    assert proc is None and took >= 7



PIDS = textwrap.dedent("""
    import os
    import torch

    class Pids(torch.utils.data.IterableDataset):  # in a module: the fork server's workers import it
        def __iter__(self):
            while True:
                yield os.getpid()
""")
RANK = textwrap.dedent("""
    import time
    from pids import Pids
    import torch
    from pipeline.signals import WorkerInit, worker_context

    it = iter(torch.utils.data.DataLoader(Pids(), num_workers=2, multiprocessing_context=worker_context(),
                                          worker_init_fn=WorkerInit("train")))
    print(*sorted({int(next(it)) for _ in range(8)}), flush=True)
    time.sleep(600)
""")


@pytest.mark.slow
def test_workers_of_the_fork_server_end_when_their_rank_is_killed(tmp_path):
    # The workers' parent is the fork server, not the rank: torch's own check (its parent's pid) cannot see
    # the rank go. A rank killed outright (SIGKILL, or the hang watchdog's os._exit) must not leave them.
    (tmp_path / "pids.py").write_text(PIDS)
    rank = subprocess.Popen([sys.executable, "-c", RANK], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])})
    workers: list[psutil.Process] = []
    try:
        pids = [int(p) for p in rank.stdout.readline().split()]
        assert len(pids) == 2 and rank.pid not in pids
        workers = [psutil.Process(p) for p in pids]
        assert {w.name() for w in workers} == {"train-worker"}  # WorkerInit's process name
        assert all(w.ppid() != rank.pid for w in workers)  # children of the fork server
        rank.kill()
        rank.wait()
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"workers {[w.pid for w in alive]} outlived their rank"
    finally:
        rank.kill()
        for w in workers:  # after a failure: leave nothing behind
            with contextlib.suppress(psutil.NoSuchProcess):
                w.kill()


LEAVE = textwrap.dedent("""
    import atexit, sys, threading, time
    from pipeline.signals import exit_without_teardown  # first, as the launch scripts import it
    import torch  # what the teardown would collect

    out = open(sys.argv[1], "w")  # buffered, never closed: written out only by the teardown
    out.write("lost")
    def later():
        time.sleep(0.3)
        open(sys.argv[2], "w").write("thread")
    threading.Thread(target=later).start()  # non-daemon: joined before the atexit handlers
    atexit.register(lambda: open(sys.argv[3], "w").write("atexit"))
    print("said", end="")  # no newline: flushed at the end
    exit_without_teardown(3)
""")


@pytest.mark.slow
def test_exit_without_teardown_runs_threads_and_atexit_then_leaves_with_its_code(tmp_path):
    """The launch scripts end with exit_without_teardown: what Python's exit does up to its teardown still
    happens (non-daemon threads joined, atexit handlers, stdout flushed), the exit code is kept, and the
    teardown is skipped (a file object left open is not flushed: the proof it did not run)."""
    files = [tmp_path / n for n in ("open", "thread", "atexit")]
    p = subprocess.run([sys.executable, "-c", LEAVE, *map(str, files)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 3 and p.stdout == "said", (p.returncode, p.stdout, p.stderr)
    assert files[1].read_text() == "thread" and files[2].read_text() == "atexit"
    assert files[0].read_text() == ""
