"""How remote reads fail and retry: the fault classes every scheme's reader raises, the retry policy, and
`StorageError`, the one line a caller gets when an object cannot be had.

A reader (http.py, s3.py) raises `Transient` for a fault worth another attempt and `Permanent` for one no
retry mends; storage.py retries the first by `RetryPolicy` and turns what is left into `StorageError`.
A storage error is not bad data: the run stops with it, naming the URL (pipeline/data counts bad samples,
never network faults).
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

MAX_BACKOFF_S = 60.0  # the longest wait between two attempts, whatever the doubling reached
BEACON = ".storage-retrying-"  # + the job, in the node's cache folder: see RetryPolicy.waiting


def node_cache_dir(cache_dir: str | None) -> str:
    """data.cache_dir, or the default: this user's folder of shard copies in the node's temporary folder."""
    return cache_dir or os.path.join(tempfile.gettempdir(), f"vit-pipeline-shards-{os.getuid()}")


def storage_beacon(cache_dir: str | None) -> str:
    """The file through which a node's readers tell its ranks' watchdogs that they wait on storage: one per job
    (the ranks of a job share MASTER_ADDR:MASTER_PORT, which pipeline.dist exports before any reader process
    starts), so that another job's outage in a shared cache folder never holds this job's watchdog back."""
    job = f"{os.environ.get('MASTER_ADDR', '')}-{os.environ.get('MASTER_PORT', '')}"
    return os.path.join(node_cache_dir(cache_dir), BEACON + "".join(c if c.isalnum() or c in ".-" else "_" for c in job))


class StorageError(RuntimeError):
    """A remote object could not be had: a permanent status, or retries ran out. The message is one line
    naming the URL and the status; the run stops. `status`: the HTTP status of a permanent failure (404:
    no such object), else None."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class Transient(Exception):
    """A fault worth another attempt (the message says what happened)."""


class Permanent(Exception):
    """A fault no retry mends: `status` as the server said it (e.g. 'HTTP 404 Not Found')."""

    def __init__(self, status: str):
        super().__init__(status)
        self.status = status


@dataclass(frozen=True)
class RetryPolicy:
    """How remote reads retry (DataConfig's retry_* and range_* keys; see `from_config`)."""
    attempts: int = 10
    total_s: float = 900.0
    backoff_s: float = 1.0
    timeout_s: float = 60.0
    part_bytes: int = 64 << 20
    parallel: int = 4
    beacon: str | None = None  # storage_beacon(data.cache_dir) for a run's readers; None: nobody to tell

    @classmethod
    def from_config(cls, cfg: Any) -> RetryPolicy:
        return cls(attempts=cfg.retry_attempts, total_s=cfg.retry_time_s, backoff_s=cfg.retry_backoff_s,
                   timeout_s=cfg.read_timeout_s, part_bytes=max(1, int(cfg.range_mb * 2**20)),
                   parallel=max(1, cfg.range_parallel), beacon=storage_beacon(getattr(cfg, "cache_dir", None)))

    def waiting(self, wait_s: float, what: str) -> None:
        """A reader is about to wait `wait_s` before its next attempt, within its budget: a rank waiting on it is
        making progress (pipeline/train/watchdog.py), not hung. Says so through the beacon, a file every process
        of the node reaches (the rank, its loader workers, its fetch-ahead process, the other ranks of the node):
        its mtime moved to when that attempt will have answered or timed out, its text to what is retried. A
        wall-clock time, shared by processes; never moved back by another reader's shorter wait."""
        if not self.beacon:
            return
        until = time.time() + wait_s + self.timeout_s
        try:
            if os.path.exists(self.beacon):
                until = max(until, os.stat(self.beacon).st_mtime)
            with open(self.beacon, "w") as f:
                f.write(what[:500])
            os.utime(self.beacon, (until, until))
        except OSError:
            pass  # no cache folder yet, a read-only one: the watchdog then knows nothing, as before

    def delay(self, failures: int) -> float:
        """Seconds to wait after the `failures`-th failure: doubling from backoff_s, capped, with jitter
        (half to all of it: ranks that failed together do not come back together)."""
        return min(MAX_BACKOFF_S, self.backoff_s * 2 ** (failures - 1)) * random.uniform(0.5, 1.0)


def cause(e: BaseException) -> str:
    """The innermost reason of a urllib3/botocore error, on one line."""
    reason = getattr(e, "reason", None) or getattr(e, "__context__", None)
    text = f"{type(e).__name__}: {e}"
    if isinstance(reason, BaseException) and str(reason) and str(reason) not in text:
        text += f" ({type(reason).__name__}: {reason})"
    return " ".join(text.split())[:300]


def log(message: str) -> None:
    print(f"storage: {message}", file=sys.stderr, flush=True)
