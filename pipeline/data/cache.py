"""The node's cache of shards that cannot be read in place (`pipe:` commands, http(s) and s3 URLs, `.tar.gz`):
each is copied whole into `data.cache_dir` by the first process that needs it (a URL with retries, checked
against dataset.json: pipeline/remote/), decompressed, and its index built next to the copy, under a lock
per shard (`NAME.lock`): one fetch per shard per node, the others wait and reuse it.

The cache holds at most `data.cache_limit_gb`, less what its readers hold. A reader **holds** a copy while it
reads it (`hold_copy`): the copy's files stay open, with a shared `flock` on the tar file. Eviction (least
recently used first, when a new copy needs room) removes only copies that no process holds: it takes the
shard's lock and an exclusive `flock` on the copy without waiting, and skips the copy when either is taken.
So a copy is never taken from a reader that still needs it; one evicted while nobody held it is fetched
again when it is next needed (`hold_copy` under the shard's lock), never counted as a bad sample.

Why locks on the files rather than a reference count or a lease: the kernel drops a process's `flock`s when
it dies, however it dies (SIGKILL, the OOM killer), so no count is left behind to pin a copy for ever and no
lease has to run out; it holds across the rank, its loader workers and its fetch-ahead process alike. Why not
"unlink and keep reading" (POSIX keeps an open file's bytes): the disk a reader's open copy takes would be
invisible to the limit, and a copy another reader still holds would be fetched again beside it. What a hold
costs: the cache may exceed its limit by the copies held at that moment, which the readers keep small (a
train worker holds the shards of its current micro batch, an eval worker those of its current batch).
`data.cache_dir` must be on a file system with working `flock` (a node-local disk).
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline import atomic
from pipeline.remote import TRANSIENT_STATUS, Expected, RetryPolicy, StorageError, fetch

from .index import INDEX_SUFFIX, build_index, default_cache_dir, index_matches, write_index
from .info import is_remote

LOCK_SUFFIX = ".lock"


def needs_copy(shard: str) -> bool:
    return is_remote(shard) or shard.endswith((".gz", ".tgz"))


def cache_name(shard: str) -> str:
    return hashlib.sha256(shard.encode()).hexdigest()[:16] + ".tar"


@dataclass
class Held:
    """A cached copy a reader holds: the tar and its index open, a shared flock on the tar (eviction skips
    it) until `close()`. `identity`: (device, inode, size) of the copy, to tell a copy fetched again."""
    path: str
    index_path: str
    fd: int
    index_fd: int
    identity: tuple[int, int, int]

    def close(self) -> None:
        for fd in (self.fd, self.index_fd):
            if fd >= 0:
                os.close(fd)  # closing the last descriptor of the tar releases its flock
        self.fd = self.index_fd = -1


def _open_held(final: Path) -> Held | None:
    """The copy at `final`, held (under the shard's lock, so that no evictor is between the open and the
    flock); None when there is no whole copy there."""
    try:
        fd = os.open(final, os.O_RDONLY)
    except FileNotFoundError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)
    st = os.fstat(fd)
    try:
        index_fd = os.open(str(final) + INDEX_SUFFIX, os.O_RDONLY)
    except FileNotFoundError:
        os.close(fd)
        return None
    return Held(str(final), str(final) + INDEX_SUFFIX, fd, index_fd, (st.st_dev, st.st_ino, st.st_size))


def local_copy(shard: str, cache_dir: str | None, limit: int, expected: Expected | None = None,
               policy: RetryPolicy | None = None, budget_key: str | None = None) -> str:
    """Path of an uncompressed local copy of `shard` in the cache (with its index beside it), fetched if
    needed, not held (the fetch-ahead process: a copy ready for the readers). See `hold_copy`."""
    held = hold_copy(shard, cache_dir, limit, expected, policy, budget_key)
    held.close()
    return held.path


def hold_copy(shard: str, cache_dir: str | None, limit: int, expected: Expected | None = None,
              policy: RetryPolicy | None = None, budget_key: str | None = None,
              known: tuple[int, int, int] | None = None) -> Held:
    """The copy of `shard` in the cache, held (`Held`; the caller closes it), fetched first if it is not
    there (or was evicted). A remote shard is fetched with retries and checked against `expected`
    (dataset.json's size and digest) under a temporary name: only a verified copy is renamed into the cache
    (pipeline/remote). `budget_key`: callers that pass the same key (a rank's fetch-ahead process and its
    readers) share one retry budget (data.retry_time_s) per shard (see _shared_deadline). `known`: the
    identity of a copy this caller checked before: the same copy is not checked again."""
    folder = Path(cache_dir or default_cache_dir())
    folder.mkdir(parents=True, exist_ok=True)
    name = cache_name(shard)
    final = folder / name
    with open(folder / (name + LOCK_SUFFIX), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one fetch per shard per machine; others wait, then reuse it
        held = _open_held(final)
        if held is not None and (held.identity == known or (
                index_matches(held.index_path, held.identity[2]) and _sized_as(final, shard, expected))):
            os.utime(final)  # recently used
            return held
        if held is not None:
            held.close()
        tmp = folder / f"{name}.{os.getpid()}.tmp"
        record = folder / (name + BUDGET_SUFFIX)
        until = _shared_deadline(record, budget_key, policy) if budget_key and is_remote(shard) else None
        try:
            _fetch(shard, tmp, expected or Expected(), policy, until)
            _evict(folder, limit - tmp.stat().st_size)
            write_index(str(final) + INDEX_SUFFIX, build_index(str(tmp), shard))
            os.replace(tmp, final)
        except StorageError as e:
            if until is not None:  # spent (retries ran out, or a permanent fault): the next caller with
                # this key fails at once, with this line
                atomic.write_text(record, json.dumps({"key": budget_key, "until": min(until, time.time()),
                                                      "error": str(e), "status": e.status}))
            raise
        finally:
            tmp.unlink(missing_ok=True)
        record.unlink(missing_ok=True)  # fetched: a later failure of this shard starts a budget of its own
        held = _open_held(final)  # still under the shard's lock: no evictor can have taken it
        assert held is not None
        return held


BUDGET_SUFFIX = ".budget"  # beside a cached copy while its fetch is under way or has failed


def _shared_deadline(record: Path, key: str, policy: RetryPolicy | None) -> float:
    """The wall-clock end of `shard`'s retry budget for the callers sharing `key` (read under the shard's
    lock). Without it, the fetch-ahead process and the rank's reader, one after the other, would each spend
    data.retry_time_s on the same dead shard: twice the configured wait before the run stops. A record of
    another key (an earlier run on this node) is not ours: a new run starts a budget of its own. A budget
    already spent raises the StorageError it ended with, at once."""
    try:
        rec = json.loads(record.read_text())
    except (OSError, ValueError):
        rec = None
    if isinstance(rec, dict) and rec.get("key") == key and isinstance(rec.get("until"), (int, float)):
        if rec.get("error") and rec["until"] <= time.time():
            status = rec.get("status")
            # A permanent answer (403, 404: no retry would change it) is the same one line from every process
            # that meets it; only a budget spent on transient faults says so.
            permanent = isinstance(status, int) and 400 <= status < 500 and status not in TRANSIENT_STATUS
            raise StorageError(rec["error"] if permanent else f"{rec['error']} (retry budget already spent on "
                               f"this shard by another process of this rank)", status)
        return float(rec["until"])
    until = time.time() + (policy or RetryPolicy()).total_s
    atomic.write_text(record, json.dumps({"key": key, "until": until}))
    return until


def _sized_as(copy: Path, shard: str, expected: Expected | None) -> bool:
    """Is a cached copy the size dataset.json gives (free to check on every hit; the digest was checked when
    it was fetched)? A copy cut short by a cache from before copies were verified is fetched again. A
    gzipped shard's copy is decompressed: its size says nothing."""
    if expected is None or expected.bytes is None or shard.endswith((".gz", ".tgz")):
        return True
    return copy.stat().st_size == expected.bytes


def _fetch(shard: str, out: Path, expected: Expected, policy: RetryPolicy | None, until: float | None = None
           ) -> None:
    """Copy (and gunzip) `shard` to `out`; OSError with the cause (exit status, stderr) on failure, StorageError
    for a URL that cannot be had. A `pipe:` name runs here, so only names `info.check_shard_names` let
    through reach this. dataset.json's size and digest are of the stored bytes (before a gunzip)."""
    raw = out.with_suffix(".raw")
    try:
        if shard.startswith("pipe:"):
            from webdataset import utils as wds_utils

            if wds_utils.enforce_security:  # webdataset's switch holds here too
                raise OSError("pipe: shards are refused: WDS_SECURE=1 is set")
            with open(raw, "wb") as f:
                p = subprocess.run(shard[5:], shell=True, stdout=f, stderr=subprocess.PIPE)
            if p.returncode != 0:
                err = p.stderr.decode(errors="replace").strip().splitlines()
                raise OSError(f"command '{shard[5:]}' exited with status {p.returncode}"
                              + (f": {err[-1]}" if err else ""))
        elif is_remote(shard):
            fetch(shard, raw, expected, policy, until)  # retried, resumed by range, verified (pipeline/remote)
        else:
            shutil.copyfile(shard, raw)
        with open(raw, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
        if gz:
            try:
                with gzip.open(raw, "rb") as src, open(out, "wb") as f:
                    shutil.copyfileobj(src, f, 1 << 20)
            except (EOFError, gzip.BadGzipFile) as e:
                raise OSError(f"gzip stream is broken ({e})") from None
        else:
            os.replace(raw, out)
    finally:
        raw.unlink(missing_ok=True)


def _evict(folder: Path, budget: int) -> None:
    """Delete the least recently used copies (and their indexes) until the others fit in `budget` bytes,
    skipping every copy in use: one whose shard's lock is taken (being fetched or opened) or that a reader
    holds (its shared flock). Neither is waited for: the cache exceeds its limit by what is held."""
    files = []
    for p in folder.glob("*.tar"):
        try:
            files.append((p.stat().st_mtime, p.stat().st_size, p))
        except FileNotFoundError:
            continue  # evicted by another process meanwhile
    total = sum(size for _, size, _ in files)
    for _, size, p in sorted(files):
        if total <= budget:
            break
        if _evict_one(p):
            total -= size


def _evict_one(copy: Path) -> bool:
    """Remove `copy` and its index if no process uses it (True), without waiting for anyone."""
    lock = os.open(str(copy) + LOCK_SUFFIX, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody fetching or opening it now
        fd = os.open(copy, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no reader holds it
            copy.unlink()
            Path(str(copy) + INDEX_SUFFIX).unlink(missing_ok=True)
            return True
        finally:
            os.close(fd)
    except (BlockingIOError, FileNotFoundError):
        return False
    finally:
        os.close(lock)  # releases the shard's lock
