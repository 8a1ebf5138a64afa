"""pipeline.signals: a signal during the rendezvous, with a real process blocked in torch's C++
store client and a real SIGTERM."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# A rank waiting in the rendezvous: the main thread blocks inside torch's C++ TCPStore client (the port
# answers TCP but is no store, as when another job holds MASTER_PORT), where Python's signal handler
# cannot run until the call returns (here, after 60 s).
BLOCKED_IN_RENDEZVOUS = """
import socket, sys
from datetime import timedelta
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from pipeline.signals import exit_at_once_on_signal, install_signal_handlers
install_signal_handlers()
import torch.distributed as dist
with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    with exit_at_once_on_signal("joining the process group"):
        Path(sys.argv[2]).write_text("joining")
        dist.TCPStore("127.0.0.1", taken.getsockname()[1], 2, False, timeout=timedelta(seconds=60))
"""


@pytest.mark.slow
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


# Two gloo ranks: only rank 1's clock says a timed checkpoint is due; both must hear "save" at that step.
AGREE = """
import sys
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
rank = int(sys.argv[3])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
from pipeline.train.preemption import Preemption
p = Preemption(every=2)
print(p.check(3, save_due=True), p.check(4, save_due=rank == 1), p.check(6, save_due=False), flush=True)
# As pipeline.commands._shutdown: a rank that tears gloo down while its peer is still in the last
# all-reduce can make that peer abort ("terminate called without an active exception", seen once in CI).
dist.barrier()
dist.destroy_process_group()
# Even so, about 1 exit in 100 of this script aborted the same way inside the interpreter's own exit,
# in no Python frame (2026-11-27: 3 of about 320 pairs of ranks, 2 to 4 such loops side by side on
# 2 cores; once in a fresh-clone CI run). Leaving with os._exit (no interpreter teardown): 0 of 240,
# 2 loops side by side. What this test checks is printed above; the teardown is not its subject.
sys.stdout.flush()
import os
os._exit(0)
"""


@pytest.mark.slow
def test_a_timed_checkpoint_is_agreed_so_every_rank_saves_the_same_step(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", AGREE, str(ROOT), str(tmp_path / "store"), str(r)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        # step 3 is not an agreement step (every=2); at 4 rank 1's due wins for both; at 6 nobody is due
        assert out.strip() == "(False, False) (False, True) (False, False)", out + err
