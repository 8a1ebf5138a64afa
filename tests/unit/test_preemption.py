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
