"""The watchdog: a rank that makes no progress for `dist.timeout_s` ends the job, saying where it is.

A rank stuck in a collective, a loader or a save waits, on GPUs, for NCCL's timeout (10-30 minutes)
and then dies with a line from deep inside the library that names neither the rank's step nor its
phase. The trainer instead marks progress (`beat(phase, step)`) at every micro batch, every eval batch
and around each save and export; a thread checks the time since the last mark. Past the limit it
writes every thread's Python stack (faulthandler) to RUN_DIR/errors/hang-rank<R>-<time>.txt, prints one
line naming the rank, the step and the phase, and exits with ExitCode.HUNG (76).

Every rank runs one, so in a hang each rank that can still run writes its own stacks: the peers
waiting in a collective and the rank stuck elsewhere fire within a second or two of each other (their
marks are as close as the ranks are in step), and each waits `grace_s` before leaving so that the
launcher does not kill a peer before it has written. A rank that cannot run at all (SIGSTOP, a
machine gone) writes nothing: its peers' files show that they waited for it.

The process group's timeout is set a minute longer (`process_group_timeout_s`), so that the watchdog,
which says where, speaks before the collective raises.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import threading
import time
from pathlib import Path

from pipeline.exit_codes import ExitCode

ERRORS_DIR = "errors"  # RUN_DIR/errors/: the same folder as DeepSpeed's tracebacks (ds_compat)
PG_TIMEOUT_MARGIN_S = 60.0


def process_group_timeout_s(timeout_s: float) -> float:
    """The collectives' own timeout: after the watchdog's, so that a hang is reported by the watchdog."""
    return timeout_s + PG_TIMEOUT_MARGIN_S


class Watchdog:
    """`beat(phase, step)` whenever the rank makes progress; `stop()` at the end. A daemon thread."""

    def __init__(self, limit_s: float, rank: int, run_dir: Path, grace_s: float = 5.0):
        self.limit_s, self.rank, self.run_dir, self.grace_s = limit_s, rank, Path(run_dir), grace_s
        self._mark = ("setup", 0, time.monotonic())  # one tuple: assigned atomically, read whole
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._thread.start()

    def beat(self, phase: str, step: int) -> None:
        self._mark = (phase, step, time.monotonic())

    def touch(self) -> None:
        """Progress within the current phase (an eval batch)."""
        phase, step, _ = self._mark
        self._mark = (phase, step, time.monotonic())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        every = min(1.0, self.limit_s / 10)
        while not self._stop.wait(every):
            phase, step, since = self._mark
            if time.monotonic() - since > self.limit_s:
                self._fire(phase, step, time.monotonic() - since)

    def _fire(self, phase: str, step: int, waited: float) -> None:
        path = self.write_stacks(phase, step, waited)
        print(f"error: rank {self.rank} hung: no progress for {waited:.0f} s in {phase} at step {step} "
              f"(dist.timeout_s={self.limit_s:g}); every thread's stack: {path}; exiting with "
              f"{int(ExitCode.HUNG)}", file=sys.stderr, flush=True)
        time.sleep(self.grace_s)  # the peers' watchdogs fire about now: let them write before we go
        sys.stdout.flush()
        os._exit(ExitCode.HUNG)

    def write_stacks(self, phase: str, step: int, waited: float) -> Path:
        folder = self.run_dir / ERRORS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"hang-rank{self.rank}-{time.strftime('%Y%m%d-%H%M%S')}.txt"
        with path.open("w") as f:
            f.write(f"rank {self.rank} on {socket.gethostname()} (pid {os.getpid()}): no progress for "
                    f"{waited:.0f} s in {phase} at step {step}\n\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)  # from this thread: every thread's stack
        return path
