"""One ranged GET over http(s) (urllib3): the reader storage.py retries, and what every scheme's reader is.

An `Opener` is (url, start, end or None, policy) -> (the object's total size if the response says it, body
chunks from byte `start` on), raising `Transient` or `Permanent` (retry.py); s3.py is the other one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

from pipeline.remote.retry import Permanent, RetryPolicy, Transient, cause

CHUNK = 1 << 20  # bytes per read from a response body
TRANSIENT_STATUS = {408, 425, 429}  # and every 5xx

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


def http_open(url: str, start: int, end: int | None, policy: RetryPolicy) -> tuple[int | None, Body]:
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
        raise Transient(cause(e)) from None
    if r.status not in (200, 206):
        status = f"HTTP {r.status} {r.reason or ''}".strip()
        r.release_conn()
        if r.status in TRANSIENT_STATUS or r.status >= 500:
            raise Transient(status)
        raise Permanent(status)
    total = content_range_total(r.headers.get("Content-Range"))
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
            raise Transient(cause(e)) from None
        finally:
            r.release_conn()

    return total, body()


def content_range_total(value: str | None) -> int | None:
    """'bytes 0-99/1234' -> 1234 (None when absent or '*')."""
    if not value or "/" not in value:
        return None
    total = value.rsplit("/", 1)[1].strip()
    return int(total) if total.isdigit() else None
