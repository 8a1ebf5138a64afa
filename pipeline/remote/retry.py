"""How remote reads fail and retry: the fault classes every scheme's reader raises, the retry policy, and
`StorageError`, the one line a caller gets when an object cannot be had.

A reader (http.py, s3.py) raises `Transient` for a fault worth another attempt and `Permanent` for one no
retry mends; storage.py retries the first by `RetryPolicy` and turns what is left into `StorageError`.
A storage error is not bad data: the run stops with it, naming the URL (pipeline/data counts bad samples,
never network faults).
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from typing import Any

MAX_BACKOFF_S = 60.0  # the longest wait between two attempts, whatever the doubling reached


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

    @classmethod
    def from_config(cls, cfg: Any) -> RetryPolicy:
        return cls(attempts=cfg.retry_attempts, total_s=cfg.retry_time_s, backoff_s=cfg.retry_backoff_s,
                   timeout_s=cfg.read_timeout_s, part_bytes=max(1, int(cfg.range_mb * 2**20)),
                   parallel=max(1, cfg.range_parallel))

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
