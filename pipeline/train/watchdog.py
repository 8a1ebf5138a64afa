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

A rank waiting on storage that is still retrying within data.retry_time_s is not hung: every reader of
the node (this rank, its loader workers and fetch-ahead process, the node's other ranks, which wait for it
in a collective) moves a beacon file's time to when its next attempt will have answered
(`RetryPolicy.waiting`, pipeline/remote/retry.py), and the watchdog counts from there. Said once per wait,
with the retry it is on. When the budget runs out the reader raises its StorageError, and the run stops
with that error's code (1) and line, dist.timeout_s before any peer's watchdog could speak. The beacon is
per node (data.cache_dir); a rank on another node, waiting for this one in a collective, hears of the wait
through the job's rendezvous store (pipeline/train/storage_wait.py).

The process group's timeout is set a minute past the longest the watchdog may wait (`process_group_timeout_s`:
dist.timeout_s after a storage wait of up to data.retry_time_s + data.read_timeout_s), so that the watchdog,
which says where, speaks before the collective raises, and a collective never ends a wait the watchdog allows.
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
from pipeline.train.storage_wait import StorageWaits

ERRORS_DIR = "errors"  # RUN_DIR/errors/: the same folder as DeepSpeed's tracebacks (ds_compat)
PG_TIMEOUT_MARGIN_S = 60.0
# The least a loader's start is given before its first batch (Watchdog.beat's starts_loader): its workers are
# fresh processes that import torch and the pipeline (5-30 s on a loaded node) and read their shards' indexes.
LOADER_START_S = 120.0


def process_group_timeout_s(timeout_s: float, storage_wait_s: float = 0.0) -> float:
    """The collectives' own timeout: after the longest the watchdog may wait (`timeout_s` past a storage wait of
    up to `storage_wait_s`; a loader's start at least LOADER_START_S), so that a hang is reported by the watchdog
    and a peer's storage wait, or its loader's start, is waited on."""
    return max(timeout_s, LOADER_START_S) + storage_wait_s + PG_TIMEOUT_MARGIN_S


class Watchdog:
    """`beat(phase, step)` whenever the rank makes progress; `stop()` at the end. A daemon thread."""

    def __init__(self, limit_s: float, rank: int, run_dir: Path, grace_s: float = 5.0,
                 storage: StorageWaits | None = None):
        self.limit_s, self.rank, self.run_dir, self.grace_s = limit_s, rank, Path(run_dir), grace_s
        self.storage = storage  # readers retrying storage: this node's (its beacon) and the other nodes'
        self._told: float | None = None  # the mark for which "waiting on storage" was said
        self._mark = ("setup", 0, time.monotonic(), limit_s)  # one tuple: assigned atomically, read whole
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._thread.start()

    def beat(self, phase: str, step: int, starts_loader: bool = False) -> None:
        """Progress: `phase` at `step` from now. `starts_loader`: what follows starts a loader's workers (fresh
        processes importing torch and the pipeline, reading their shards' indexes) before its first batch, so
        it is given max(dist.timeout_s, LOADER_START_S) until the next progress: a small dist.timeout_s
        would otherwise call that start a hang."""
        self._mark = (phase, step, time.monotonic(), self._limit(starts_loader))

    def touch(self, starts_loader: bool = False) -> None:
        """Progress within the current phase (an eval batch; an eval loader starting its workers)."""
        phase, step, _, _ = self._mark
        self._mark = (phase, step, time.monotonic(), self._limit(starts_loader))

    def _limit(self, starts_loader: bool) -> float:
        return max(self.limit_s, LOADER_START_S) if starts_loader else self.limit_s

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        every = min(1.0, self.limit_s / 10)
        while not self._stop.wait(every):
            if self.storage is not None:
                self.storage.share()  # this node's wait, for the other nodes' watchdogs
            phase, step, since, limit = self._mark
            waited = time.monotonic() - since
            if waited <= self.limit_s:
                continue
            storage = self.storage.wait() if self.storage is not None else None
            if storage is not None and storage[0] <= self.limit_s:
                self._say_storage(phase, step, since, waited, storage[1])
                continue
            if waited <= limit:  # a loader's start, within its allowance (a storage wait in it is still said)
                continue
            self._fire(phase, step, waited if storage is None else min(waited, storage[0]), limit)

    def _say_storage(self, phase: str, step: int, since: float, waited: float, what: str) -> None:
        if self._told == since:
            return
        self._told = since
        print(f"watchdog: rank {self.rank}: no progress for {waited:.0f} s in {phase} at step {step}, but storage is "
              f"being retried within data.retry_time_s ({what}): waiting on it, not hung", file=sys.stderr, flush=True)

    def _fire(self, phase: str, step: int, waited: float, limit: float) -> None:
        path = self.write_stacks(phase, step, waited)
        allowed = "" if limit == self.limit_s else f"; a loader's start is given {limit:g} s"
        print(f"error: rank {self.rank} hung: no progress for {waited:.0f} s in {phase} at step {step} "
              f"(dist.timeout_s={self.limit_s:g}{allowed}); every thread's stack: {path}; exiting with "
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
