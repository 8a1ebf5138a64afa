"""A rank whose DataLoader worker raised must exit, not hang. The workers block SIGTERM/SIGUSR1
(`preemption.block_in_worker`), and multiprocessing's exit handler ends daemonic children with SIGTERM
and then joins them with no timeout: before `reap_workers_at_exit`, a worker's exception re-raised in the
main process (seen: timm's RandAugment posterize on Pillow 13) left the rank waiting on its worker and
the worker waiting on its parent, for good. A real process, a real worker, a real exception."""

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import torch
    from pipeline.train.preemption import block_in_worker, reap_workers_at_exit

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


def test_a_worker_error_ends_the_process_with_exit_1_and_the_error_last():
    proc, took = _run(reap=True, timeout=60)
    assert proc is not None, "the process hung on its DataLoader worker at exit"
    assert proc.returncode == 1 and "got 1" in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "ValueError: the sample's transform failed", proc.stderr[-2000:]  # not "worker killed"


@pytest.mark.timeout(120)
def test_without_the_reaper_it_hangs():
    # The failure the reaper prevents, shown to exist: the same script without it does not end.
    proc, took = _run(reap=False, timeout=10)  # with the reaper it ends in about 4 s
    assert proc is None and took >= 10


# A rank waiting in the rendezvous: the main thread blocks inside torch's C++ TCPStore client (the port
# answers TCP but is no store, as when another job holds MASTER_PORT), where Python's signal handler
# cannot run until the call returns (here, after 60 s).
BLOCKED_IN_RENDEZVOUS = """
import socket, sys
from datetime import timedelta
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from pipeline.train.preemption import exit_at_once_on_signal, install_signal_handlers
install_signal_handlers()
import torch.distributed as dist
with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    with exit_at_once_on_signal("joining the process group"):
        Path(sys.argv[2]).write_text("joining")
        dist.TCPStore("127.0.0.1", taken.getsockname()[1], 2, False, timeout=timedelta(seconds=60))
"""


def test_a_signal_while_blocked_in_the_rendezvous_exits_75_at_once(tmp_path):
    marker = tmp_path / "joining"
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED_IN_RENDEZVOUS, str(ROOT), str(marker)],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.1)
    time.sleep(1.0)  # inside the C++ connect
    proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the signal was not acted on while the main thread was blocked in the rendezvous")
    assert proc.returncode == 75, err
    assert "preempted while joining the process group" in err
    assert time.monotonic() - started < 5
