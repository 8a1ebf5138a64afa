"""The process at the top of a job, for whoever signals only the process it started.

    python -m pipeline.supervise deepspeed --num_gpus 8 launch/pretrain.py --config ...
    python -m pipeline.supervise torchrun --nproc-per-node 8 launch/pretrain.py --config ...

`kill PID`, `timeout`, a CI runner, Kubernetes (PID 1 of the container) and `docker stop` send SIGTERM
to one process: the one they started. The `deepspeed` runner has no handler for a local launch and
exits 143 at once (the ranks notice and checkpoint, but the caller sees 143; in a container the ranks
die with PID 1, mid-checkpoint, and as PID 1 without a handler the runner ignores SIGTERM until the
runtime's SIGKILL); torchrun exits 1. Put this in front of the launcher and:

  1. COMMAND starts in a session of its own: a signal to our process group (Ctrl-C, `kill -TERM -PGID`,
     `tini -g`) reaches only us, and we decide where it goes.
  2. SIGTERM or SIGUSR1 goes to every rank, and only to the ranks: a process started by a launcher
     (the runner, DeepSpeed's per-node launcher, torchrun; see signals.is_launcher) that is not one
     itself, or COMMAND itself when it is not a launcher. Launchers are left alone: signalled, the runner
     exits at once and DeepSpeed's launcher and torchrun SIGKILL the ranks after 30 s, which a large
     checkpoint can outlast. A rank gets the signal once it catches it (/proc/PID/status, SigCgt), so
     one still starting Python is not killed by the default action (the launch scripts install their
     handlers before anything slow); a process that never catches it (`make_shards.py`) gets it after
     DEFAULT_AFTER_S, unless ranks run under it (a shell: `bash -c "... && deepspeed ..."`).
  3. The ranks checkpoint at the next step boundary and exit 75; DeepSpeed's launcher and runner (or
     torchrun) exit with their ranks' code, and so do we. A Ctrl-C is taken as SIGTERM; a second one
     SIGKILLs the whole session (nothing is saved since the last checkpoint).
  4. We wait for COMMAND and for everything it leaves behind: as a child subreaper (or PID 1 in a
     container) we inherit, reap and wait for orphans, so a rank outliving a killed launcher still
     finishes its checkpoint before we exit. When COMMAND itself was killed by a signal and a process
     it left exited 75, we exit 75 (a checkpoint was written).

Multi-node: under Slurm, `srun` signals every task itself and this is not needed; the `deepspeed`
runner's pdsh launch has its own handler (it kills the remote ranks). This module imports nothing heavy.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

from pipeline.exit_codes import ExitCode
from pipeline.signals import is_launcher

POLL_S = 0.1
DEFAULT_AFTER_S = 5  # a process that does not catch the signal gets it (and its default action) after this
LEFT_AFTER_S = 30  # say what we are still waiting for once COMMAND has been gone this long
PR_SET_CHILD_SUBREAPER = 36


def _log(message: str) -> None:
    print(f"supervise: {message}", file=sys.stderr, flush=True)


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (Linux: the SigCgt mask in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except OSError:
        pass
    return False


def ranks(root: int) -> list[int]:
    """The ranks under `root` (the supervisor): the processes `root` or a launcher started that are not
    launchers themselves. So `COMMAND` is the rank when it is not a launcher; DataLoader workers (started
    by a rank) are not ranks; an orphaned rank, reparented to `root`, still is."""
    import psutil

    try:
        tree = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for proc in tree:
        try:
            if not is_launcher(proc.cmdline()) and (proc.ppid() == root or is_launcher(proc.parent().cmdline())):
                found.append(proc.pid)
        except (psutil.Error, AttributeError):  # ended while we looked, or no parent any more
            continue
    return found


class Supervisor:
    """Runs COMMAND, passes SIGTERM/SIGUSR1 to its ranks, exits with its code (see the module's docstring)."""

    def __init__(self, command: list[str]):
        self.command = command
        self.pending: int | None = None  # the signal the ranks are to get
        self.pending_since = 0.0
        self.delivered: set[int] = set()  # ranks that have it
        # Processes seen with a rank under them (a shell around the launcher), remembered: once its ranks
        # have ended, such a shell is about to exit with their code and must not get the late signal.
        self.wrappers: set[int] = set()
        self.interrupts = 0
        self.kill_now = False

    def _on_signal(self, signum: int, frame: object) -> None:  # noqa: ARG002 - a signal handler's signature
        if signum == signal.SIGINT:
            self.interrupts += 1
            self.kill_now = self.interrupts > 1
            signum = signal.SIGTERM
        if self.pending is None:
            self.pending, self.pending_since = signum, time.monotonic()
        elif signum != self.pending:  # SIGTERM after SIGUSR1: the ranks take the first; pass it on anyway
            self.pending = signum
            self.delivered.clear()

    def _deliver(self) -> None:
        import psutil

        found = ranks(os.getpid())
        for rank in found:
            try:
                self.wrappers.update(a.pid for a in psutil.Process(rank).parents())
            except psutil.Error:  # ended meanwhile
                pass
        late = time.monotonic() - self.pending_since >= DEFAULT_AFTER_S
        for pid in found:
            if pid in self.delivered:
                continue
            if not catches(pid, self.pending):
                # A rank still starting gets it once its handler is in place. One that never installs one
                # (not our trainer: `make_shards.py`, a shell) gets it after DEFAULT_AFTER_S, unless it
                # is a wrapper of ranks (`bash -c "... && deepspeed ..."`), which ends when they do.
                if not late or pid in self.wrappers:
                    continue
            try:
                os.kill(pid, self.pending)
                self.delivered.add(pid)
            except ProcessLookupError:
                pass

    @staticmethod
    def _descendants() -> list:
        import psutil

        return psutil.Process().children(recursive=True)

    def _kill_all(self) -> None:
        for proc in self._descendants():
            try:
                proc.kill()
            except Exception:  # psutil.Error: ended meanwhile
                pass

    def _describe_left(self) -> str:
        return "; ".join(f"pid {p.pid} {' '.join(p.cmdline())[:80]}" for p in self._descendants()) or "nothing"

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        if os.getpid() != 1:  # PID 1 inherits orphans anyway
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        try:
            child = subprocess.Popen(self.command, start_new_session=True)
        except OSError as e:
            _log(f"error: cannot start {self.command[0]!r}: {e.strerror}")
            return ExitCode.USAGE
        code: int | None = None  # COMMAND's exit code
        orphan_preempted = False
        announced = None
        ended, left_logged = 0.0, False
        while True:
            # Reap whatever has ended: COMMAND, and orphans we inherited as a subreaper.
            try:
                while True:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    exit_code = os.waitstatus_to_exitcode(status)
                    if pid == child.pid:
                        code = exit_code if exit_code >= 0 else 128 - exit_code
                        child.returncode = code
                        ended = time.monotonic()
                    elif exit_code == ExitCode.PREEMPTED:
                        orphan_preempted = True
            except ChildProcessError:  # no child left: COMMAND and all it started have ended
                break
            if self.kill_now:
                self.kill_now = False
                _log("second interrupt: killing the job now (nothing saved since its last checkpoint)")
                self._kill_all()
            if code is not None and not left_logged and time.monotonic() - ended > LEFT_AFTER_S:
                left_logged = True
                _log(f"{self.command[0]} ended with {code}; waiting for what it left: {self._describe_left()}")
            if self.pending is not None:
                if announced != self.pending:
                    announced = self.pending
                    _log(f"{signal.Signals(self.pending).name}: passing it to the ranks, which checkpoint at the "
                         f"next step boundary and exit {int(ExitCode.PREEMPTED)}"
                         + (" (Ctrl-C again to kill them now)" if self.interrupts else ""))
                self._deliver()
            time.sleep(POLL_S)
        if code is not None and code > 128 and orphan_preempted:
            return ExitCode.PREEMPTED  # COMMAND was killed, the ranks it left checkpointed
        return code if code is not None else ExitCode.ERROR


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return ExitCode.OK if argv else ExitCode.USAGE
    return Supervisor(argv).run()


if __name__ == "__main__":
    sys.exit(main())
