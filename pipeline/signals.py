"""Signals, the bottom layer: the preemption flag and its handlers, and how helper processes treat signals.

A signal on any rank -> all ranks checkpoint at the same step boundary -> exit 75 -> requeue; the
agreement across ranks is `pipeline.train.preemption`, this module is what data/ and train/ both use
(the flag, `block_in_worker`, `WorkerInit`, the worker reaper, `worker_context`, `exit_at_once_on_signal`).

Slurm sends SIGUSR1 some minutes before the time limit (`#SBATCH --signal=USR1@300`) and SIGTERM on
`scancel`. `install_signal_handlers()` is the first thing the launchers do, before the config is read
and before DeepSpeed is imported: a signal during setup (imports, process group, checkpoint load,
fine-tune source) only raises the flag, and the trainer exits 75 at its first safe point instead of
dying with the default action (which Slurm counts as a failure and does not requeue).

However the job was started, the signal reaches this flag:
  - to a rank (srun, `kill`): the handler;
  - to the process group (Ctrl-C aside: `kill -TERM -PGID`, `timeout`, a container runtime): the handler
    in each rank; DataLoader workers block SIGTERM/SIGUSR1 (`block_in_worker`), else torch's
    worker handler dies on a SIGTERM not sent by its parent and the rank fails with "DataLoader worker
    killed by signal" instead of checkpointing;
  - to torchrun or to DeepSpeed's per-node launcher (deepspeed.launcher.launch): they pass SIGTERM on
    to the ranks (and give them 30 s before SIGKILL);
  - to the `deepspeed` runner, which forwards nothing and exits at once: each rank watches the launcher
    processes above it (`watch_launchers`) and takes the end of any of them for a SIGTERM. So no rank
    trains on, orphaned, after its launcher is gone.

The handler only sets a flag (nothing else is safe inside a signal handler); `received()` reads it.
`pipeline.train.preemption.Preemption.should_stop()` takes the max of the flag over all ranks so that
every rank stops at the same step even if only one got the signal. This module imports nothing heavy
at the top: installing the handlers takes microseconds.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import signal
import sys
import threading
import time
from typing import Any

from pipeline.exit_codes import ExitCode

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
# Command-line marks of the processes that start ranks: DeepSpeed's runner and per-node launcher, torchrun,
# and our own supervisor above them (pipeline/supervise.py).
LAUNCHER_MARKS = ("deepspeed.launcher", "/deepspeed", "torch.distributed.run", "/torchrun",
                  "torch.distributed.launch", "pipeline.supervise")
WATCH_EVERY_S = 1.0

_received: int | None = None  # the first signal seen by this process
_installed = False
_reaping = False
_exit_code: int | None = None  # set by exit_without_teardown


def _leave_without_teardown() -> None:
    """The last atexit handler (registered when this module is first imported, which the launch scripts do
    first: atexit runs last-registered first): after exit_without_teardown, leave with its code."""
    if _exit_code is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_code)


atexit.register(_leave_without_teardown)


def exit_without_teardown(code: int) -> None:
    """sys.exit(code), less the interpreter's teardown. Python's exit runs as usual up to its last step:
    non-daemon threads are joined, every atexit handler runs (MLflow's flush, the mirror's drain, the
    workers' reaper), stdout and stderr are flushed; then os._exit(code) instead of collecting and freeing
    every module's objects. With torch, timm and DeepSpeed imported that teardown took 1.2 to 1.7 s per
    process on the 2-core machine, after the run's last line, for nothing: every file a run writes is
    written whole and closed before (pipeline.atomic), and the run directory's lock is an flock the kernel
    drops. The launch scripts end with it; an exception that escapes them still exits the usual way."""
    global _exit_code
    _exit_code = int(code)
    sys.exit(_exit_code)


def _handle(signum: int, frame: Any) -> None:  # noqa: ARG001 - a signal handler's signature
    global _received
    if _received is None:
        _received = signum


def block_in_worker(worker_id: int = 0) -> None:  # noqa: ARG001 - DataLoader's worker_init_fn signature
    """DataLoader `worker_init_fn`: leave SIGTERM/SIGUSR1 pending in the worker instead of dying of them
    (torch's worker handler exits on a SIGTERM its parent did not send, and the rank then fails with
    "DataLoader worker killed by signal"). The rank decides what a signal means; its workers end when it
    shuts them down or dies (torch's worker watchdog)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)


class WorkerInit:
    """DataLoader `worker_init_fn`: `block_in_worker`, and a process name (`ps`, `top`, /proc/PID/comm)
    that says what the worker is: "train-worker", "eval-worker"."""

    def __init__(self, kind: str):
        self.kind = kind
        self.rank_pid = os.getpid()  # built in the rank; called in the worker

    def __call__(self, worker_id: int) -> None:
        block_in_worker(worker_id)
        _set_process_name(f"{self.kind}-worker")
        exit_with(self.rank_pid)


def exit_with(pid: int) -> None:
    """In a worker started from the fork server: end this process when process `pid` (its rank) ends.

    torch's worker watchdog compares os.getppid() with the parent it started with, which for a worker of
    the fork server is the server, not the rank; a rank that died by SIGKILL, os._exit (the hang
    watchdog's exit 76) or a signal would leave its workers, and with them the server and the pipes the
    job's stdout goes through, alive for good (seen: a launcher whose ranks were gone never saw EOF).
    A pidfd becomes readable when its process ends, whoever its parent is, and cannot name a reused pid."""

    def wait_and_exit() -> None:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:  # gone already
            os._exit(0)
        except (OSError, AttributeError):  # no pidfd (Linux < 5.3): poll the pid
            while _pid_alive(pid):
                time.sleep(WATCH_EVERY_S)
            os._exit(0)
        select.select([fd], [], [])
        os._exit(0)

    threading.Thread(target=wait_and_exit, name=f"exit-with-{pid}", daemon=True).start()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _set_process_name(name: str) -> None:
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # Linux only; the name is a courtesy
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


_server_started = False


def worker_context():
    """The multiprocessing context of every DataLoader worker and helper process a rank starts: forkserver.

    The default, fork, copies the rank as it is, other threads included (gloo's, the launcher watch, the
    queue feeders of the train loader, MLflow's): a thread that holds a lock at that instant (in libc's
    allocator, the interpreter or an extension) leaves it held in the child for good, and the child
    waits on it forever inside os.fork(). Its rank then waits for a batch that never comes while its
    peers wait for it in a collective (seen: one evaluation in a few dozen hung until gloo's timeout;
    tests/stress/preempt_resume.py). The fork server is a new interpreter (exec'd, one thread) that
    imports the data modules once; each worker is forked from it, not from the rank.

    The server starts with SIGTERM/SIGUSR1 blocked, and exec and fork keep a blocked mask: a signal to
    the process group leaves the server and its workers alone from their first instruction (the rank
    decides what it means). Each worker ends when its rank does, however the rank ends (`exit_with`), and
    the server when the rank and its workers are gone (it reads EOF from them)."""
    import multiprocessing
    from multiprocessing import forkserver

    global _server_started
    if not _server_started:
        # What the workers unpickle, imported once by the server instead of in every worker (timm's and
        # torchvision's transforms: seconds each, at every evaluation's new workers). Not __main__: a worker
        # runs the launch script again itself, which does nothing outside its main guard.
        # pipeline.fork_server, last, makes the server leave without the interpreter's teardown.
        multiprocessing.set_forkserver_preload(["pipeline.data", "timm.data", "PIL.Image", "pipeline.fork_server"])
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:
            forkserver.ensure_running()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        _server_started = True
    return multiprocessing.get_context("forkserver")


def reap_workers_at_exit() -> None:
    """Call in a process that starts DataLoader workers with `block_in_worker` (idempotent): at exit,
    SIGKILL its daemonic children. multiprocessing's own exit handler sends them SIGTERM, which they
    block, then joins them with no timeout: a rank leaving by an exception (a worker's error raised in
    the main process, before the loader shut its workers down) hung there for good, its workers waiting
    on a parent that waited on them. atexit runs last-registered first, so this runs before that handler
    (registered when multiprocessing.util was imported, before any loader exists)."""
    global _reaping
    if _reaping:
        return
    _reaping = True
    import multiprocessing
    import multiprocessing.util  # noqa: F401 (its exit handler registered before ours)

    def reap() -> None:
        # torch's SIGCHLD handler would report each killed worker as an error after the real one.
        with contextlib.suppress(ValueError):  # not the main thread: keep it
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for child in multiprocessing.active_children():
            if child.daemon:  # DataLoader workers; a non-daemonic child is joined as usual
                child.kill()
                child.join(timeout=5)

    atexit.register(reap)


def install_signal_handlers() -> None:
    """Catch SIGUSR1/SIGTERM from now on, and watch the launchers above this process (idempotent).
    Call before anything slow."""
    global _installed
    for sig in SIGNALS:
        signal.signal(sig, _handle)
    if not _installed:
        _installed = True
        watch_launchers()


def is_launcher(argv: list[str]) -> bool:
    """A Python process running a launcher (`python .../bin/deepspeed`, `python -m torch.distributed.run`,
    `python -m pipeline.supervise`) or the launcher's own script; not `timeout deepspeed ...` or a shell
    that names one."""
    head = " ".join(argv[:4])
    return bool(argv) and os.path.basename(argv[0]).startswith(("python", "deepspeed", "torchrun")) \
        and any(mark in head for mark in LAUNCHER_MARKS)


def _launchers() -> list[tuple[int, float, str]]:
    """(pid, start time, name) of the launcher processes above this one, nearest first (empty when this
    process was not started by one: srun, a shell, a test)."""
    import psutil

    found = []
    try:
        proc = psutil.Process(os.getpid()).parent()
        while proc is not None and proc.pid > 1:
            argv = proc.cmdline()
            if not is_launcher(argv):
                break
            found.append((proc.pid, proc.create_time(), " ".join(argv[:4])[-80:]))
            proc = proc.parent()
    except psutil.Error:
        pass  # a parent that ended while we looked: the watch below sees it
    return found


def watch_launchers(every_s: float = WATCH_EVERY_S) -> threading.Thread | None:
    """A daemon thread that raises the flag (as a SIGTERM would) when a launcher above us ends."""
    launchers = _launchers()
    if not launchers:
        return None
    import psutil

    def gone(pid: int, started: float) -> bool:
        try:
            proc = psutil.Process(pid)
            # A reused pid is another process; a zombie has ended (its parent has not reaped it yet).
            return proc.create_time() != started or proc.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            return True

    def watch() -> None:
        global _received
        while True:
            time.sleep(every_s)
            for pid, started, name in launchers:
                if gone(pid, started):
                    if _received is None:
                        _received = signal.SIGTERM
                        print(f"preemption: launcher {name} (pid {pid}) has ended: checkpointing at the next "
                              f"step boundary, then exiting", file=sys.stderr, flush=True)
                    return

    thread = threading.Thread(target=watch, name="watch-launchers", daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def exit_at_once_on_signal(what: str, every_s: float = 0.2):
    """While the block runs (joining the process group: nothing to save yet, and a rank may wait there
    for peers that are gone), a signal ends the process at once with 75 instead of at the next step.

    A thread watches: the main thread may be blocked inside C++ (torch's TCPStore client waiting on a
    rendezvous that never answers), where Python's handler cannot run until the call returns, so the
    flag stays down. The interpreter's C-level handler still writes the signal's number to the wakeup
    fd (`signal.set_wakeup_fd`), and the thread reads it."""
    done = threading.Event()
    read_fd = write_fd = None
    previous = -1
    if threading.current_thread() is threading.main_thread():  # set_wakeup_fd: main thread only
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def guard() -> None:
        while not done.is_set():
            got = b""
            if read_fd is not None:
                if select.select([read_fd], [], [], every_s)[0]:
                    got = os.read(read_fd, 64)
            else:
                done.wait(every_s)
            if _received is not None or any(signum in got for signum in SIGNALS):
                print(f"preempted while {what}: nothing to save; exiting with {int(ExitCode.PREEMPTED)}",
                      file=sys.stderr, flush=True)
                os._exit(int(ExitCode.PREEMPTED))

    thread = threading.Thread(target=guard, name="exit-on-signal", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if read_fd is not None:
            signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)


def received() -> int | None:
    """The first signal this process got (or that a launcher's end stands for), None before any."""
    return _received
