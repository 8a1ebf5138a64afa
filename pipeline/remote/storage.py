"""Remote reads that never turn a network fault into a bad sample: http(s) and s3 objects fetched whole
into a local file, retried, resumed by range, and checked against dataset.json before anyone reads them.

    fetch("s3://bucket/data/train-000003.tar", tmp, Expected(bytes=..., sha256=...), RetryPolicy())

- A **transient** fault (a 5xx or 429/408 status, S3 throttling, a refused or reset connection, a body
  that ends early with or without a Content-Length, no byte for `timeout_s`) is retried with exponential
  backoff and jitter, at most `attempts` times per byte range and within `total_s` seconds per object;
  each retry asks for the bytes still missing (an HTTP Range from where the copy stopped), never from
  byte 0 again. Each retry is logged: one line on stderr.
- A **permanent** fault (403, 404, any other 4xx, a copy whose size or sha256 differs from dataset.json's
  after a fresh download) or retries that run out raise `StorageError`: one line naming the URL and the
  status, and the run stops (a network fault is never counted as a bad sample and replaced).
- Large objects of known size (dataset.json's `bytes`) come in `part_bytes` ranges, `parallel` at once.

The caller (data/cache.py) writes to a temporary name and renames only a verified copy into the
node's cache: a bad copy never enters it.

Why urllib3 and boto3 rather than curl (webdataset's gopen): curl does not retry a connection closed
mid-body (exit 18), accepts a body cut short without a Content-Length, and has no stall timeout; and
a subprocess's failures reach us as an exit status. Here every fault is a Python exception we classify,
the range resume and the digest check are ours, and the tests drive real servers through a fault proxy.
"""

from __future__ import annotations

import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pipeline.remote import s3
from pipeline.remote.http import Opener, http_open
from pipeline.remote.retry import Permanent, RetryPolicy, StorageError, Transient, log


@dataclass(frozen=True)
class Expected:
    """What dataset.json says the object is (None where it does not say)."""
    bytes: int | None = None
    sha256: str | None = None


def opener(url: str) -> Opener:
    scheme = url.partition("://")[0].lower()
    if scheme in ("http", "https"):
        return http_open
    if scheme == "s3":
        return s3.s3_open
    raise StorageError(f"{url}: no reader for scheme '{scheme}://'")


# ----------------------------------------------------------------------------- fetching a whole object


class _Budget:
    """The object's deadline, shared by its ranges. `until`: a wall-clock deadline (time.time()) set by the
    caller when the budget is shared with other processes (data/cache.py: the fetch-ahead process and the
    readers of one rank spend one budget per shard); None: `total_s` from now."""

    def __init__(self, policy: RetryPolicy, until: float | None = None):
        left = policy.total_s if until is None else until - time.time()
        self.deadline = time.monotonic() + left

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _fetch_range(url: str, fd: int, start: int, end: int | None, size: int | None, policy: RetryPolicy,
                 budget: _Budget, open_range: Opener) -> int:
    """Write bytes [start, end) of `url` (to its end when `end` is None) into `fd` at their offsets, retrying
    transient faults from the first byte still missing. `size`: the object's size in dataset.json. Returns
    where the data ended."""
    pos, failures = start, 0
    while True:
        try:
            total, body = open_range(url, pos, end, policy)
            if total is not None and size is not None and total != size:  # another object than described
                body.close()
                raise Permanent(f"the object is {total} bytes, dataset.json says {size}")
            stop = end if end is not None else total  # where this range must end, when anyone says
            for chunk in body:
                if stop is not None and pos + len(chunk) > stop:
                    raise Permanent(f"sent more than the {stop} bytes expected")
                os.pwrite(fd, chunk, pos)
                pos += len(chunk)
                if budget.left() < 0:
                    raise Transient(f"still reading after retry_time_s={policy.total_s:g}")
            if stop is not None and pos < stop:  # a body cut short, with no Content-Length to tell urllib3
                raise Transient(f"body ended at byte {pos} of {stop}")
            return pos
        except Transient as e:
            failures += 1
            wait = policy.delay(failures)
            if failures >= policy.attempts or budget.left() < wait:
                spent = policy.total_s - budget.left()
                raise StorageError(f"{url}: {e} (gave up after {failures} attempts in {spent:.0f} s; "
                                   f"data.retry_attempts={policy.attempts}, data.retry_time_s={policy.total_s:g})"
                                   ) from None
            log(f"retry {failures}/{policy.attempts - 1} of {url} from byte {pos} in {wait:.1f} s: {e}")
            policy.waiting(wait, f"retry {failures}/{policy.attempts - 1} of {url}: {e}")
            time.sleep(wait)
        except Permanent as e:
            code = e.status.split()[1] if e.status.startswith("HTTP ") else ""
            raise StorageError(f"{url}: {e.status}", int(code) if code.isdigit() else None) from None


def _ranges(size: int | None, policy: RetryPolicy) -> list[tuple[int, int | None]]:
    if size is None or size <= policy.part_bytes or policy.parallel <= 1:
        return [(0, size)]
    return [(a, min(a + policy.part_bytes, size)) for a in range(0, size, policy.part_bytes)]


def _download(url: str, out: Path, expected: Expected, policy: RetryPolicy, budget: _Budget) -> None:
    open_range = opener(url)
    ranges = _ranges(expected.bytes, policy)
    with open(out, "wb") as f:
        if expected.bytes is not None:
            f.truncate(expected.bytes)  # parts land at their offsets
        fd = f.fileno()
        if len(ranges) == 1:
            end = _fetch_range(url, fd, *ranges[0], expected.bytes, policy, budget, open_range)
        else:
            with ThreadPoolExecutor(min(policy.parallel, len(ranges)), thread_name_prefix="range-get") as pool:
                ends = list(pool.map(lambda r: _fetch_range(url, fd, *r, expected.bytes, policy, budget, open_range),
                                     ranges))
            end = ends[-1]
        f.truncate(end)


def file_sha256(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _mismatch(out: Path, expected: Expected) -> str | None:
    """Why the copy is not the object dataset.json describes (None: it is, as far as it says)."""
    size = out.stat().st_size
    if expected.bytes is not None and size != expected.bytes:
        return f"copy is {size} bytes, dataset.json says {expected.bytes}"
    if expected.sha256 is not None:
        digest = file_sha256(out)
        if digest != expected.sha256:
            return f"sha256 {digest[:16]}... differs from dataset.json's {expected.sha256[:16]}..."
    return None


DIGEST_TRIES = 2  # whole downloads before a copy that does not match dataset.json is called permanent


def fetch(url: str, out: Path, expected: Expected = Expected(), policy: RetryPolicy | None = None,
          until: float | None = None) -> None:
    """Download `url` to the local file `out` and check it against `expected`; StorageError (one line,
    naming the URL) when it cannot be had. `out` is a temporary name: the caller renames a good copy.
    `until`: the wall-clock end of a retry budget shared with other processes (see _Budget)."""
    policy = policy or RetryPolicy()
    budget = _Budget(policy, until)
    for attempt in range(1, DIGEST_TRIES + 1):
        _download(url, out, expected, policy, budget)
        why = _mismatch(out, expected)
        if why is None:
            return
        if attempt < DIGEST_TRIES:
            log(f"downloading {url} again: {why}")
    raise StorageError(f"{url}: {why} after {DIGEST_TRIES} downloads (the object was rewritten since dataset.json "
                       f"was written, or the store serves other bytes; write dataset.json again)")


def read_bytes(url: str, policy: RetryPolicy | None = None) -> bytes:
    """A small object (dataset.json) in memory, with the same retries."""
    import tempfile

    fd, name = tempfile.mkstemp(prefix="vit-pipeline-get-")
    os.close(fd)
    try:
        fetch(url, Path(name), Expected(), policy)
        return Path(name).read_bytes()
    finally:
        os.unlink(name)

