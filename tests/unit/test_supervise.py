"""pipeline.supervise with stand-in processes (no torch): a launcher that forwards nothing, like the
`deepspeed` runner, starting two ranks that install their SIGTERM handler late and start a worker that
blocks the signal. Real processes and real signals; tests/integration/test_signals.py runs the real
launchers."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.supervise import DEFAULT_AFTER_S, catches, ranks

pytestmark = pytest.mark.slow  # every test starts real processes

ROOT = Path(__file__).resolve().parents[2]

# Named .../deepspeed so that signals.is_launcher takes it for the runner. Forwards nothing (no handler),
# exits with the highest code of its ranks, as DeepSpeed's launcher does.
LAUNCHER = """
import subprocess, sys
from pathlib import Path
procs = [subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2], str(r)]) for r in range(2)]
code = max(p.wait() for p in procs)
Path(sys.argv[2], "launcher").write_text(str(code))  # not reached when a signal killed it
sys.exit(code)
"""

# A rank: catches SIGTERM only after a slow start (a signal before would kill it), starts a worker that
# blocks SIGTERM, says which signal it got, exits 75 as the trainer does.
RANK = """
import multiprocessing, os, signal, sys, time
from pathlib import Path
out, rank = Path(sys.argv[1]), sys.argv[2]

def worker():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR1})
    while os.getppid() != 1 and Path(out, "rank" + rank).exists() is False:
        time.sleep(0.05)

time.sleep(1.0)  # importing torch
got = []
for sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, lambda s, f: got.append(s))
multiprocessing.Process(target=worker, daemon=True).start()
Path(out, "ready" + rank).write_text(str(os.getpid()))
while not got:
    time.sleep(0.05)
time.sleep(float(os.environ.get("CHECKPOINT_S", "0.5")))  # the checkpoint
Path(out, "rank" + rank).write_text(signal.Signals(got[0]).name)
sys.exit(75)
"""


@pytest.fixture
def job(tmp_path):
    (tmp_path / "deepspeed").write_text(LAUNCHER)
    (tmp_path / "rank.py").write_text(RANK)

    def start(*, direct: bool = False) -> subprocess.Popen:
        command = ([sys.executable, str(tmp_path / "rank.py"), str(tmp_path), "0"] if direct else
                   [sys.executable, str(tmp_path / "deepspeed"), str(tmp_path / "rank.py"), str(tmp_path)])
        return subprocess.Popen([sys.executable, "-m", "pipeline.supervise", *command], cwd=ROOT,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)

    yield start
    for proc in psutil.process_iter():  # nothing of ours left behind if a test failed half-way
        try:
            if str(tmp_path) in " ".join(proc.cmdline()):
                proc.kill()
        except psutil.Error:
            pass


def wait_for(path: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def launcher_of(proc: subprocess.Popen) -> psutil.Process:
    deadline = time.monotonic() + 10
    while not (children := psutil.Process(proc.pid).children()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return children[0]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_before_the_ranks_catch_it_reaches_them_once_they_do_and_the_code_is_theirs(job, tmp_path, sig):
    proc = job()
    launcher = launcher_of(proc)
    time.sleep(0.3)  # the ranks exist and do not catch the signal yet: sent now, it would kill them
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 75, err
    assert {p.name: p.read_text() for p in tmp_path.glob("rank?")} == {"rank0": sig.name, "rank1": sig.name}
    assert (tmp_path / "launcher").read_text() == "75", "the launcher got the signal"
    assert not launcher.is_running(), "the launcher outlived the supervisor"
    assert f"supervise: {sig.name}: passing it to the ranks" in err


def test_a_signal_to_the_supervisors_group_reaches_the_launcher_not(job, tmp_path):
    # tini -g, Ctrl-C's SIGINT, `kill -TERM -PGID`: the job runs in a session of its own, so only the
    # supervisor gets it; the launcher, signalled, would exit at once and leave the ranks orphaned.
    proc = job()
    launcher = launcher_of(proc)
    wait_for(tmp_path / "ready0"), wait_for(tmp_path / "ready1")
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 75, err
    assert (tmp_path / "launcher").read_text() == "75", "the launcher got the signal"
    assert not launcher.is_running()


def test_ctrl_c_checkpoints_and_a_second_one_kills_at_once(job, tmp_path):
    proc = job()
    wait_for(tmp_path / "ready0"), wait_for(tmp_path / "ready1")
    rank_pids = [int((tmp_path / f"ready{r}").read_text()) for r in (0, 1)]
    assert sorted(ranks(proc.pid)) == sorted(rank_pids)  # not the launcher, not the workers
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)  # two signals that arrive together are one (a pending signal is a bit, not a count)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert "(Ctrl-C again to kill them now)" in err and "second interrupt: killing the job now" in err, err
    assert proc.returncode == 128 + signal.SIGKILL  # the launcher's end; nothing saved
    assert not list(tmp_path.glob("rank?"))
    assert not [p for p in rank_pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_ranks_orphaned_by_a_killed_launcher_are_waited_for_and_their_75_is_the_code(job, tmp_path):
    proc = job()
    launcher = launcher_of(proc)
    wait_for(tmp_path / "ready0"), wait_for(tmp_path / "ready1")
    launcher.kill()  # the OOM killer picks the launcher: its ranks are reparented to the supervisor
    time.sleep(0.5)
    assert proc.poll() is None, "the supervisor ended with ranks still running"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 75, err
    assert {p.name: p.read_text() for p in tmp_path.glob("rank?")} == {"rank0": "SIGTERM", "rank1": "SIGTERM"}


def test_a_command_that_is_not_a_launcher_is_the_rank(job, tmp_path):
    proc = job(direct=True)
    wait_for(tmp_path / "ready0")
    assert catches(int((tmp_path / "ready0").read_text()), signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 75, err
    assert (tmp_path / "rank0").read_text() == "SIGTERM"


def test_usage():
    run = [sys.executable, "-m", "pipeline.supervise"]
    assert subprocess.run(run, cwd=ROOT, capture_output=True).returncode == 2
    helped = subprocess.run([*run, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert helped.returncode == 0 and "python -m pipeline.supervise deepspeed" in helped.stdout
    missing = subprocess.run([*run, "no-such-launcher"], cwd=ROOT, capture_output=True, text=True)
    assert missing.returncode == 2 and "cannot start 'no-such-launcher'" in missing.stderr
    assert subprocess.run([*run, "sh", "-c", "exit 7"], cwd=ROOT).returncode == 7


def test_a_shell_around_the_launcher_is_left_alone_and_a_command_without_handler_gets_the_signal_late(job, tmp_path):
    # `docker run IMAGE bash -c "make_shards ... && deepspeed ..."`: the shell does not catch SIGTERM; it
    # must not be killed while its ranks checkpoint, nor in what it does after them, and it ends with their 75.
    launch = f"{sys.executable} {tmp_path / 'deepspeed'} {tmp_path / 'rank.py'} {tmp_path}"
    # The ranks' checkpoint outlasts DEFAULT_AFTER_S, after which a shell without ranks under it is signalled;
    # once they have ended, this one has none under it for a second (it once got the signal in that gap).
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.supervise", "sh", "-c",
                             f"{launch}; code=$?; sleep 1; echo shell saw $code; exit $code"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "CHECKPOINT_S": str(DEFAULT_AFTER_S + 2)})
    wait_for(tmp_path / "ready0"), wait_for(tmp_path / "ready1")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert "shell saw 75" in out, err  # the shell lived to see its ranks' code
    assert proc.returncode == 75, err
    assert (tmp_path / "launcher").read_text() == "75"
    # A command with no handler at all (make_shards.py): the signal's default action, a few seconds late.
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.supervise", sys.executable, "-c", "import time; time.sleep(60)"],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert 4 < time.monotonic() - started < 10
