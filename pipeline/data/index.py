"""Random access to the samples of a WebDataset tar shard.

A shard is scanned once per process: its tar headers are read and each member's data is
skipped with a seek, which gives every sample (the run of consecutive members sharing a key,
as in webdataset's `base_plus_ext`) as {extension: (data offset, size)}. A sample is then read
as exactly its members' bytes (`os.pread`), so the bytes read per byte of sample consumed
("read amplification") are the sample bytes plus 512 per member header, once per process.

Shards without random access (`pipe:` commands, http(s) URLs, gzip-compressed tars) are first
copied whole into a local cache folder (`data.cache_dir`), decompressed, written atomically
(temporary file + rename, under a lock so that two workers on one machine fetch a shard once)
and evicted least recently used beyond `data.cache_limit_gb`.

Counters: `BYTES_READ[0]` is what this process has read from shard files (headers and data).
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from webdataset.tariterators import base_plus_ext

from . import tario
from .info import is_remote

BYTES_READ = [0]  # this process; a list so that importers see the same cell
MAX_OPEN = 64


@dataclass
class IndexedSample:
    key: str
    members: dict[str, tuple[int, int]] = field(default_factory=dict)
    duplicate: str | None = None
    """An extension that occurs twice in this sample (the sample is bad: which one is meant?)."""


@dataclass
class ShardIndex:
    path: str
    samples: list[IndexedSample]
    truncated: str | None = None
    """Why the archive ends early (its samples after that are missing), or None."""
    fd: int = -1


class _Counting:
    """A raw file that counts the bytes read through it (tarfile reads headers only, then seeks)."""

    def __init__(self, f):
        self.f = f

    def read(self, n: int = -1) -> bytes:
        b = self.f.read(n)
        BYTES_READ[0] += len(b)
        return b

    def seek(self, *a):
        return self.f.seek(*a)

    def tell(self) -> int:
        return self.f.tell()


def scan(path: str, shard: str) -> ShardIndex:
    """Index of the local tar file `path` (`shard` names it in messages)."""
    size = os.path.getsize(path)
    samples: list[IndexedSample] = []
    truncated = None
    with open(path, "rb", buffering=0) as raw:
        try:
            tar = tarfile.open(fileobj=_Counting(raw), mode="r:")  # seekable: member data is skipped
            for info in tar:
                tar.members = []  # not kept: the index is ours
                if not info.isreg():
                    continue
                key, ext = base_plus_ext(info.name)
                if key is None or os.path.basename(key).startswith("__"):
                    continue
                if info.offset_data + info.size > size:
                    truncated = f"member '{info.name}' ends at byte {info.offset_data + info.size} of {size}"
                    break
                if not samples or samples[-1].key != key:
                    samples.append(IndexedSample(key))
                s, ext = samples[-1], ext.lower()
                if ext in s.members:
                    s.duplicate = s.duplicate or ext
                s.members[ext] = (info.offset_data, info.size)
        except (tarfile.TarError, OSError, EOFError) as e:
            if not samples:
                raise tario.ShardError(tario.UNREADABLE_SHARD, shard, f"not a tar archive ({e})") from None
            truncated = str(e)
    return ShardIndex(path, samples, truncated)


def read_sample(index: ShardIndex, i: int) -> tario.RawSample:
    """Sample i with its members' bytes; SampleError(duplicate_member) for an ambiguous one."""
    s = index.samples[i]
    if s.duplicate:
        raise tario.SampleError(tario.DUPLICATE_MEMBER, f"sample '{s.key}' has two '.{s.duplicate}' members")
    if index.fd < 0:
        index.fd = os.open(index.path, os.O_RDONLY)
    members = {}
    for ext, (offset, size) in s.members.items():
        members[ext] = os.pread(index.fd, size, offset)
        BYTES_READ[0] += len(members[ext])
    return tario.RawSample(s.key, i, 0, 0, members)


# ----------------------------------------------------------------------------- per-process cache


class Indexes:
    """Shard location -> ShardIndex (scanned on first use; an LRU of open files)."""

    def __init__(self, cache_dir: str | None, cache_limit_gb: float):
        self.cache_dir = cache_dir
        self.limit = int(cache_limit_gb * 2**30)
        self._open: OrderedDict[str, ShardIndex] = OrderedDict()
        self.errors: dict[str, tario.ShardError] = {}

    def get(self, shard: str) -> ShardIndex:
        """The index, or ShardError (unreadable_shard, with the cause) raised again on every call."""
        if shard in self.errors:
            raise self.errors[shard]
        if shard in self._open:
            self._open.move_to_end(shard)
            return self._open[shard]
        try:
            path = local_copy(shard, self.cache_dir, self.limit) if needs_copy(shard) else shard
            index = scan(path, shard)
        except tario.ShardError as e:
            self.errors[shard] = e
            raise
        except (OSError, ValueError) as e:  # ValueError: a scheme webdataset's gopen does not know
            self.errors[shard] = tario.ShardError(tario.UNREADABLE_SHARD, shard, f"{type(e).__name__}: {e}")
            raise self.errors[shard] from None
        self._open[shard] = index
        while len(self._open) > MAX_OPEN:
            _, old = self._open.popitem(last=False)
            if old.fd >= 0:
                os.close(old.fd)
        return index

    def close(self) -> None:
        for index in self._open.values():
            if index.fd >= 0:
                os.close(index.fd)
        self._open.clear()


def needs_copy(shard: str) -> bool:
    return is_remote(shard) or shard.endswith((".gz", ".tgz"))


def default_cache_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"vit-pipeline-shards-{os.getuid()}")


def local_copy(shard: str, cache_dir: str | None, limit: int) -> str:
    """Path of an uncompressed local copy of `shard` in the cache, fetched if needed."""
    folder = Path(cache_dir or default_cache_dir())
    folder.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(shard.encode()).hexdigest()[:16] + ".tar"
    final = folder / name
    with open(folder / (name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one fetch per shard per machine; others wait, then reuse it
        if final.exists():
            os.utime(final)  # recently used
            return str(final)
        tmp = folder / f"{name}.{os.getpid()}.tmp"
        try:
            _fetch(shard, tmp)
            _evict(folder, limit - tmp.stat().st_size)
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
    return str(final)


def _fetch(shard: str, out: Path) -> None:
    """Copy (and gunzip) `shard` to `out`; OSError with the cause (exit status, stderr) on failure."""
    raw = out.with_suffix(".raw")
    try:
        if shard.startswith("pipe:"):
            with open(raw, "wb") as f:
                p = subprocess.run(shard[5:], shell=True, stdout=f, stderr=subprocess.PIPE)
            if p.returncode != 0:
                err = p.stderr.decode(errors="replace").strip().splitlines()
                raise OSError(f"command '{shard[5:]}' exited with status {p.returncode}"
                              + (f": {err[-1]}" if err else ""))
        elif is_remote(shard):
            from webdataset import gopen  # http(s), and whatever else webdataset knows

            with gopen(shard, "rb") as src, open(raw, "wb") as f:
                shutil.copyfileobj(src, f, 1 << 20)
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
    """Delete the least recently used copies until the others fit in `budget` bytes."""
    files = sorted(folder.glob("*.tar"), key=lambda p: p.stat().st_mtime)
    total = sum(p.stat().st_size for p in files)
    for p in files:
        if total <= budget:
            break
        total -= p.stat().st_size
        p.unlink(missing_ok=True)  # a process that has it open keeps reading it (POSIX)
