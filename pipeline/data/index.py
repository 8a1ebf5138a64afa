"""Random access to the samples of a WebDataset tar shard, through a per-shard index file.

A sample is the run of consecutive tar members sharing a key (webdataset's `base_plus_ext`).
Its members' data offsets and sizes come from the shard's **index** (`NAME.tar.idx`), never
from scanning tar headers in every process:

- `make_shards.py` writes the index beside each shard it writes (`ShardWriter`);
- a shard without one (written by others) gets it built once per machine, in `data.cache_dir`,
  by the first process that needs it (under a file lock; written to a temporary name, then
  renamed), and every other process on the machine reads that file;
- a shard without random access (`pipe:` commands, http(s) and s3 URLs, `.tar.gz`) is first copied whole
  into `data.cache_dir` (a URL with retries, checked against dataset.json: pipeline/remote/), decompressed,
  and its index built next to the copy, under the same lock (`local_copy`).

An index file: `MAGIC`, the header's length (8 bytes, little endian), the header (JSON: shard
size, sample count, member extensions, why the archive ends early if it does), zero padding to
8 bytes, then one record per sample of int64s: a flag (1 + the column of a member that occurs
twice, or 0), then (data offset, size) per extension column, offset -1 where the sample has no
such member. A process reads a shard's index whole once (the first time it reads from the shard: `check_index`, a
damaged index is built again, never trusted) and then one record per sample, tens of bytes per ~100 KB.

Reading a sample is one `os.pread` from its first member's data to its last member's end (the tar headers
in between come along: 512 bytes per extra member).
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline import atomic
from pipeline.remote import TRANSIENT_STATUS, Expected, RetryPolicy, StorageError, fetch

from . import tario
from .info import is_remote

MAGIC = b"VITIDX01"
INDEX_SUFFIX = ".idx"
INDEX_FORMAT = 1
MAX_OPEN = 128  # shards whose files (tar and index) a process keeps open, an LRU: within the usual 1,024 fds


# ----------------------------------------------------------------------------- the index file


@dataclass
class SampleMembers:
    """One sample while an index is built: {extension: (data offset, size)}."""
    key: str
    members: dict[str, tuple[int, int]]
    duplicate: str | None = None


def encode_index(samples: list[SampleMembers], shard_bytes: int, truncated: str | None = None) -> bytes:
    """The bytes of an index file for `samples` of a shard of `shard_bytes` bytes."""
    exts = sorted({e for s in samples for e in s.members})
    col = {e: i for i, e in enumerate(exts)}
    records = np.full((len(samples), 1 + 2 * len(exts)), -1, dtype="<i8")
    records[:, 0] = 0
    for i, s in enumerate(samples):
        for ext, (offset, size) in s.members.items():
            records[i, 1 + 2 * col[ext]:3 + 2 * col[ext]] = (offset, size)
        if s.duplicate is not None:
            records[i, 0] = 1 + col[s.duplicate]
    header = json.dumps({"format": INDEX_FORMAT, "shard_bytes": shard_bytes, "samples": len(samples),
                         "exts": exts, "truncated": truncated}).encode()
    header += b" " * (-(len(MAGIC) + 8 + len(header)) % 8)  # records start 8-byte aligned
    return MAGIC + len(header).to_bytes(8, "little") + header + records.tobytes()


def write_index(path: str | Path, data: bytes) -> None:
    """Write atomically (temporary name, then rename): a reader sees the whole index or none."""
    atomic.write_bytes(path, data)


def scan(path: str, shard: str) -> tuple[list[SampleMembers], str | None]:
    """Samples of the local tar file `path` from its headers (`shard` names it in messages), and why
    the archive ends early (or None). ShardError(unreadable_shard) if it is not a tar at all."""
    size = os.path.getsize(path)
    samples: list[SampleMembers] = []
    truncated = None
    with open(path, "rb") as raw:
        try:
            tar = tarfile.open(fileobj=raw, mode="r:")  # seekable: member data is skipped, not read
            for info in tar:
                tar.members = []  # not kept: the index is ours
                named = tario.member_key(info)  # the streamed reader's rule: the same sample numbers
                if named is None:
                    continue
                key, ext = named
                if info.offset_data + info.size > size:
                    truncated = f"member '{info.name}' ends at byte {info.offset_data + info.size} of {size}"
                    break
                if not samples or samples[-1].key != key:
                    samples.append(SampleMembers(key, {}))
                s = samples[-1]
                if ext in s.members:
                    s.duplicate = s.duplicate or ext
                s.members[ext] = (info.offset_data, info.size)
        except (tarfile.TarError, OSError, EOFError) as e:
            if not samples:
                raise tario.ShardError(tario.UNREADABLE_SHARD, shard, f"not a tar archive ({e})") from None
            truncated = str(e)
    return samples, truncated


def build_index(path: str, shard: str) -> bytes:
    samples, truncated = scan(path, shard)
    return encode_index(samples, os.path.getsize(path), truncated)


# ----------------------------------------------------------------------------- reading


@dataclass
class ShardIndex:
    """What a process knows of one shard: where to read it and its index's header."""
    path: str
    """The tar file read (the shard, or its local copy)."""
    index_path: str
    samples: int
    exts: list[str]
    truncated: str | None
    body: int
    """Byte offset of the first record in the index file."""
    fd: int = -1
    index_fd: int = -1

    @property
    def record_bytes(self) -> int:
        return 8 * (1 + 2 * len(self.exts))

    def close(self) -> None:
        for fd in (self.fd, self.index_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.index_fd = -1


def read_header(index_path: str) -> tuple[dict[str, Any], int]:
    """(header, byte offset of the records); ValueError when the file is not an index of ours."""
    with open(index_path, "rb") as f:
        head = f.read(len(MAGIC) + 8)
        if len(head) < len(MAGIC) + 8 or head[:len(MAGIC)] != MAGIC:
            raise ValueError(f"'{index_path}' is not a shard index")
        length = int.from_bytes(head[len(MAGIC):], "little")
        header = json.loads(f.read(min(length, 1 << 20)))  # UnicodeDecodeError, JSONDecodeError: ValueErrors
    if not isinstance(header, dict) or header.get("format") != INDEX_FORMAT:
        found = header.get("format") if isinstance(header, dict) else None
        raise ValueError(f"'{index_path}' has index format {found}, expected {INDEX_FORMAT}")
    return header, len(MAGIC) + 8 + length


def check_index(index_path: str, shard_bytes: int) -> tuple[dict[str, Any], int]:
    """(header, records' offset) of an index that fits a shard of `shard_bytes` bytes: its header's shard
    size, the file's length against its record count, and every record within the shard (a garbage
    offset would read gigabytes). ValueError saying what is wrong otherwise. Reads the whole index once:
    tens of bytes per sample."""
    header, body = read_header(index_path)
    samples, exts = header.get("samples"), header.get("exts")
    if header.get("shard_bytes") != shard_bytes:
        raise ValueError(f"'{index_path}' is the index of a shard of {header.get('shard_bytes')} bytes, not {shard_bytes}")
    if not isinstance(samples, int) or samples < 0 or not isinstance(exts, list):
        raise ValueError(f"'{index_path}': damaged header (samples={samples!r}, exts={exts!r})")
    width = 1 + 2 * len(exts)
    expected = body + samples * 8 * width
    actual = os.path.getsize(index_path)
    if actual != expected:
        raise ValueError(f"'{index_path}' is {actual} bytes; its header's {samples} records need {expected}")
    records = np.fromfile(index_path, dtype="<i8", offset=body).reshape(samples, width)
    offsets, sizes = records[:, 1::2], records[:, 2::2]
    present = offsets >= 0
    if (records[:, 0] < 0).any() or (records[:, 0] > len(exts)).any() or (
            present & ((sizes < 0) | (offsets + sizes > shard_bytes))).any():
        raise ValueError(f"'{index_path}' has records outside its shard of {shard_bytes} bytes")
    return header, body


class Indexes:
    """Shard location -> ShardIndex (index found or built on first use; an LRU of open files), and the
    bytes this process read: `bytes_read` from shard files, `index_bytes_read` from index files."""

    def __init__(self, cache_dir: str | None, cache_limit_gb: float, policy: RetryPolicy | None = None,
                 expected: dict[str, Expected] | None = None, budget_key: str | None = None):
        self.cache_dir = cache_dir
        self.limit = int(cache_limit_gb * 2**30)
        self.policy = policy  # how remote copies are retried (None: RetryPolicy's defaults)
        self.expected = expected or {}  # shard -> its size and digest in dataset.json: copies are checked
        self.budget_key = budget_key  # shared with the rank's fetch-ahead: one retry budget per shard (local_copy)
        self._known: dict[str, ShardIndex] = {}  # a few hundred bytes per shard the process has read from
        self._open: OrderedDict[str, ShardIndex] = OrderedDict()  # those whose files are open
        self.errors: dict[str, tario.ShardError] = {}
        self.bytes_read = 0
        self.index_bytes_read = 0

    def get(self, shard: str) -> ShardIndex:
        """The index, or ShardError (unreadable_shard, with the cause) raised again on every call. A shard's
        header is read once per process; its files are kept open for the MAX_OPEN most recent shards."""
        if shard in self.errors:
            raise self.errors[shard]
        if shard in self._known:
            return self._known[shard]
        try:
            path = (local_copy(shard, self.cache_dir, self.limit, self.expected.get(shard), self.policy,
                                 self.budget_key)
                    if needs_copy(shard) else shard)
            index_path = index_for(path, shard, self.cache_dir)
            header, body = read_header(index_path)  # index_for checked it whole (check_index)
        except tario.ShardError as e:
            self.errors[shard] = e
            raise
        except StorageError:
            raise  # a network fault is not a bad sample: the run stops, naming the URL (pipeline/remote)
        except (OSError, ValueError) as e:  # ValueError: a scheme webdataset's gopen does not know
            self.errors[shard] = tario.ShardError(tario.UNREADABLE_SHARD, shard, f"{type(e).__name__}: {e}")
            raise self.errors[shard] from None
        self.index_bytes_read += os.path.getsize(index_path)  # read whole once, by index_for's check
        index = ShardIndex(path, index_path, int(header["samples"]), list(header["exts"]), header["truncated"], body)
        self._known[shard] = index
        return index

    def _open_files(self, shard: str, index: ShardIndex) -> None:
        if shard in self._open:
            self._open.move_to_end(shard)
            return
        index.fd = os.open(index.path, os.O_RDONLY)
        index.index_fd = os.open(index.index_path, os.O_RDONLY)
        self._open[shard] = index
        while len(self._open) > MAX_OPEN:
            self._open.popitem(last=False)[1].close()

    def load(self, shard: str, i: int) -> tario.RawSample:
        """Sample i of `shard`; SampleError(kind) when it cannot be had (the shard's own error included)."""
        try:
            index = self.get(shard)
        except tario.ShardError as e:
            raise tario.SampleError(e.kind, str(e)) from None
        if i >= index.samples:
            raise tario.SampleError(tario.TRUNCATED_TAR, f"'{shard}' has {index.samples} samples, dataset.json "
                                    f"more" + (f"; {index.truncated}" if index.truncated else ""))
        try:
            self._open_files(shard, index)
            return self.read_sample(index, i)
        except OSError as e:
            raise tario.SampleError(tario.UNREADABLE_SHARD, f"'{shard}': {e}") from None

    def read_sample(self, index: ShardIndex, i: int) -> tario.RawSample:
        """Sample i with its members' bytes (files open); SampleError(duplicate_member) for an ambiguous one."""
        n = index.record_bytes
        record = np.frombuffer(os.pread(index.index_fd, n, index.body + i * n), dtype="<i8")
        self.index_bytes_read += n
        if record[0]:
            raise tario.SampleError(tario.DUPLICATE_MEMBER,
                                    f"sample {i} has two '.{index.exts[record[0] - 1]}' members")
        spans = {ext: (int(record[1 + 2 * c]), int(record[2 + 2 * c])) for c, ext in enumerate(index.exts)
                 if record[1 + 2 * c] >= 0}
        if not spans:
            return tario.RawSample(str(i), i, {})
        lo = min(o for o, _ in spans.values())
        hi = max(o + s for o, s in spans.values())
        data = os.pread(index.fd, hi - lo, lo)  # one read: the members and the headers between them
        self.bytes_read += len(data)
        return tario.RawSample(str(i), i, {ext: data[o - lo:o - lo + s] for ext, (o, s) in spans.items()})

    def close(self) -> None:
        for index in self._open.values():
            index.close()
        self._open.clear()


def index_for(path: str, shard: str, cache_dir: str | None) -> str:
    """The index file of the local tar `path`: beside it when it is there and sound for the file
    (`check_index`), else in the cache, built once per machine (a damaged one is built again)."""
    size = os.path.getsize(path)
    beside = path + INDEX_SUFFIX
    if _matches(beside, size):
        return beside
    folder = Path(cache_dir or default_cache_dir()) / "index"
    folder.mkdir(parents=True, exist_ok=True)
    st = os.stat(path)
    # Keyed by where the shard is and what it is: a rewritten shard gets a new index.
    name = hashlib.sha256(f"{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = folder / (name + INDEX_SUFFIX)
    if _matches(str(cached), size):
        return str(cached)
    with open(folder / (name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build per shard per machine; the others wait, then read it
        if not _matches(str(cached), size):
            write_index(cached, build_index(path, shard))
    return str(cached)


def _matches(index_path: str, shard_bytes: int) -> bool:
    """Does `index_path` hold a whole, sound index of a shard of this size? A damaged one is rebuilt
    (an index is a cache of the shard's headers)."""
    try:
        check_index(index_path, shard_bytes)
    except (OSError, ValueError):
        return False
    return True


# ----------------------------------------------------------------------------- the node's cache


def needs_copy(shard: str) -> bool:
    return is_remote(shard) or shard.endswith((".gz", ".tgz"))


def default_cache_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"vit-pipeline-shards-{os.getuid()}")


def cache_name(shard: str) -> str:
    return hashlib.sha256(shard.encode()).hexdigest()[:16] + ".tar"


def local_copy(shard: str, cache_dir: str | None, limit: int, expected: Expected | None = None,
               policy: RetryPolicy | None = None, budget_key: str | None = None) -> str:
    """Path of an uncompressed local copy of `shard` in the cache (with its index beside it), fetched
    if needed. A remote shard is fetched with retries and checked against `expected` (dataset.json's size
    and digest) under a temporary name: only a verified copy is renamed into the cache (pipeline/remote).
    `budget_key`: callers that pass the same key (a rank's fetch-ahead process and its readers) share one
    retry budget (data.retry_time_s) per shard (see _shared_deadline)."""
    folder = Path(cache_dir or default_cache_dir())
    folder.mkdir(parents=True, exist_ok=True)
    name = cache_name(shard)
    final = folder / name
    with open(folder / (name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one fetch per shard per machine; others wait, then reuse it
        if final.exists() and _matches(str(final) + INDEX_SUFFIX, final.stat().st_size) and _sized_as(
                final, shard, expected):
            os.utime(final)  # recently used
            return str(final)
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
    return str(final)


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
    """Delete the least recently used copies (and their indexes) until the others fit in `budget` bytes."""
    files = sorted(folder.glob("*.tar"), key=lambda p: p.stat().st_mtime)
    total = sum(p.stat().st_size for p in files)
    for p in files:
        if total <= budget:
            break
        total -= p.stat().st_size
        p.unlink(missing_ok=True)  # a process that has it open keeps reading it (POSIX)
        Path(str(p) + INDEX_SUFFIX).unlink(missing_ok=True)
