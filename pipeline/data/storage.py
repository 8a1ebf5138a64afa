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

The caller (index.local_copy) writes to a temporary name and renames only a verified copy into the
node's cache: a bad copy never enters it.

Why urllib3 and boto3 rather than curl (webdataset's gopen): curl does not retry a connection closed
mid-body (exit 18), accepts a body cut short without a Content-Length, and has no stall timeout; and
a subprocess's failures reach us as an exit status. Here every fault is a Python exception we classify,
the range resume and the digest check are ours, and the tests drive real servers through a fault proxy.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .info import BadDataError

CHUNK = 1 << 20  # bytes per read from a response body
MAX_BACKOFF_S = 60.0  # the longest wait between two attempts, whatever the doubling reached
TRANSIENT_STATUS = {408, 425, 429}  # and every 5xx


class StorageError(BadDataError):
    """A remote object could not be had: a permanent status, or retries ran out. The message is one line
    naming the URL and the status; the run stops (a BadDataError: the loaders' path to a clean stop).
    `status`: the HTTP status of a permanent failure (404: no such object), else None."""

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


@dataclass(frozen=True)
class Expected:
    """What dataset.json says the object is (None where it does not say)."""
    bytes: int | None = None
    sha256: str | None = None


def expected_of(split: Any) -> dict[str, Expected]:
    """Shard -> what dataset.json says of it, for a SplitInfo or anything with its shards, shard_bytes and
    shard_sha256 lists (the train stream)."""
    n = len(split.shards)
    sizes = list(split.shard_bytes or []) + [None] * n
    digests = list(split.shard_sha256 or []) + [None] * n
    return {s: Expected(sizes[i], digests[i]) for i, s in enumerate(split.shards)}


def log(message: str) -> None:
    print(f"storage: {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- one ranged GET per scheme


Body = Iterator[bytes]
Opener = Callable[[str, int, "int | None", RetryPolicy], "tuple[int | None, Body]"]
"""(url, start, end or None, policy) -> (the object's total size if the response says it, body chunks
from byte `start` on); raises Transient or Permanent."""

_pools: dict[int, Any] = {}  # per process: a pool made before a fork is not the child's to use


def _http_pool() -> Any:
    import urllib3

    pool = _pools.get(os.getpid())
    if pool is None:
        pool = _pools[os.getpid()] = urllib3.PoolManager(num_pools=16, maxsize=16)
    return pool


def _http_open(url: str, start: int, end: int | None, policy: RetryPolicy) -> tuple[int | None, Body]:
    import urllib3
    from urllib3.exceptions import HTTPError

    headers = {"Accept-Encoding": "identity"}  # the bytes dataset.json's digest is of, not a re-encoding
    if start or end is not None:
        headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
    try:
        r = _http_pool().request(
            "GET", url, headers=headers, preload_content=False, decode_content=False,
            # Our loop retries (with the range still missing); urllib3 follows redirects only.
            retries=urllib3.Retry(total=None, connect=0, read=0, status=0, other=0, redirect=5),
            timeout=urllib3.Timeout(connect=policy.timeout_s, read=policy.timeout_s))
    except HTTPError as e:
        raise Transient(_cause(e)) from None
    if r.status not in (200, 206):
        status = f"HTTP {r.status} {r.reason or ''}".strip()
        r.release_conn()
        if r.status in TRANSIENT_STATUS or r.status >= 500:
            raise Transient(status)
        raise Permanent(status)
    total = _content_range_total(r.headers.get("Content-Range"))
    if r.status == 200:
        length = r.headers.get("Content-Length")
        total = int(length) if length and length.isdigit() else None
    # A server that ignores Range sends the whole object: its bytes before `start` are skipped, and those
    # from `end` on are not taken.
    skip = start if r.status == 200 else 0
    left = None if end is None or r.status != 200 else end - start

    def body() -> Body:
        nonlocal skip, left
        try:
            # read1: what has arrived, not a full CHUNK, so that a stall keeps the bytes before it; urllib3 2
            # raises on a body shorter than its Content-Length.
            while chunk := r.read1(CHUNK, decode_content=False):
                if skip:
                    cut = min(skip, len(chunk))
                    chunk, skip = chunk[cut:], skip - cut
                if left is not None:
                    chunk, left = chunk[:left], left - min(left, len(chunk))
                if chunk:
                    yield chunk
                if left == 0:
                    return
        except HTTPError as e:
            raise Transient(_cause(e)) from None
        finally:
            r.release_conn()

    return total, body()


def _content_range_total(value: str | None) -> int | None:
    """'bytes 0-99/1234' -> 1234 (None when absent or '*')."""
    if not value or "/" not in value:
        return None
    total = value.rsplit("/", 1)[1].strip()
    return int(total) if total.isdigit() else None


def _cause(e: BaseException) -> str:
    """The innermost reason of a urllib3/botocore error, on one line."""
    reason = getattr(e, "reason", None) or getattr(e, "__context__", None)
    text = f"{type(e).__name__}: {e}"
    if isinstance(reason, BaseException) and str(reason) and str(reason) not in text:
        text += f" ({type(reason).__name__}: {reason})"
    return " ".join(text.split())[:300]


def opener(url: str) -> Opener:
    scheme = url.partition("://")[0].lower()
    if scheme in ("http", "https"):
        return _http_open
    if scheme == "s3":
        from .s3 import s3_open

        return s3_open
    raise StorageError(f"{url}: no reader for scheme '{scheme}://'")


# ----------------------------------------------------------------------------- fetching a whole object


class _Budget:
    """The object's deadline, shared by its ranges. `until`: a wall-clock deadline (time.time()) set by the
    caller when the budget is shared with other processes (index.local_copy: the fetch-ahead process and the
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

