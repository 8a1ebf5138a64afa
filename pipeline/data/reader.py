"""Random access to the samples of WebDataset tar shards: a shard read in place through its index (index.py),
or a copy in the node's cache (cache.py) held while it is read.

Reading a sample is one `os.pread` from its first member's data to its last member's end (the tar headers
in between come along: 512 bytes per extra member).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from pipeline.remote import Expected, RetryPolicy, StorageError

from . import tario
from .cache import Held, hold_copy, needs_copy
from .index import index_for, read_header

MAX_OPEN = 128  # shards whose files (tar and index) a process keeps open, an LRU: within the usual 1,024 fds


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
    identity: tuple[int, int, int] | None = None
    """A cached copy's (device, inode, size) when it was last held: the same copy is not checked again."""

    @property
    def record_bytes(self) -> int:
        return 8 * (1 + 2 * len(self.exts))

    def close(self) -> None:
        for fd in (self.fd, self.index_fd):
            if fd >= 0:
                os.close(fd)  # for a cached copy, the last close releases the hold (its flock)
        self.fd = self.index_fd = -1


class Indexes:
    """Shard location -> ShardIndex (index found or built on first use; an LRU of open files), and the
    bytes this process read: `bytes_read` from shard files, `index_bytes_read` from index files.

    A cached copy is read only while held (cache.py): its files are open from the moment the cache hands it
    over, and it is held until `keep_only` or the LRU closes it; when it is needed again it is held again,
    fetched again if it was evicted meanwhile (a missing copy is never a bad sample)."""

    def __init__(self, cache_dir: str | None, cache_limit_gb: float, policy: RetryPolicy | None = None,
                 expected: dict[str, Expected] | None = None, budget_key: str | None = None):
        self.cache_dir = cache_dir
        self.limit = int(cache_limit_gb * 2**30)
        self.policy = policy  # how remote copies are retried (None: RetryPolicy's defaults)
        self.expected = expected or {}  # shard -> its size and digest in dataset.json: copies are checked
        self.budget_key = budget_key  # shared with the rank's fetch-ahead: one retry budget per shard (cache.py)
        self._known: dict[str, ShardIndex] = {}  # a few hundred bytes per shard the process has read from
        self._open: OrderedDict[str, ShardIndex] = OrderedDict()  # those whose files are open
        self.errors: dict[str, tario.ShardError] = {}
        self.bytes_read = 0
        self.index_bytes_read = 0

    def _hold(self, shard: str, known: tuple[int, int, int] | None = None) -> Held:
        """The shard's cached copy, held: fetched again if it is gone. ShardError for a copy that cannot be
        made (a pipe that fails, a broken gzip stream, not a tar); StorageError passes (a network fault)."""
        try:
            return hold_copy(shard, self.cache_dir, self.limit, self.expected.get(shard), self.policy,
                             self.budget_key, known)
        except OSError as e:
            raise tario.ShardError(tario.UNREADABLE_SHARD, shard, f"{type(e).__name__}: {e}") from None

    def get(self, shard: str) -> ShardIndex:
        """The index, or ShardError (unreadable_shard, with the cause) raised again on every call. A shard's
        header is read once per process; its files are kept open for the MAX_OPEN most recent shards (a
        cached copy's from here on: it is held)."""
        if shard in self.errors:
            raise self.errors[shard]
        if shard in self._known:
            return self._known[shard]
        held = None
        try:
            if needs_copy(shard):
                held = self._hold(shard)
                path, index_path = held.path, held.index_path  # checked whole by hold_copy (check_index)
            else:
                path = shard
                index_path = index_for(path, shard, self.cache_dir)
            header, body = read_header(index_path)  # index_for checked it whole (check_index)
        except tario.ShardError as e:
            self.errors[shard] = e
            raise
        except StorageError:
            raise  # a network fault is not a bad sample: the run stops, naming the URL (pipeline/remote)
        except (OSError, ValueError) as e:  # ValueError: a scheme webdataset's gopen does not know
            if held is not None:
                held.close()
            self.errors[shard] = tario.ShardError(tario.UNREADABLE_SHARD, shard, f"{type(e).__name__}: {e}")
            raise self.errors[shard] from None
        self.index_bytes_read += os.path.getsize(index_path)  # read whole once, by the check
        index = ShardIndex(path, index_path, int(header["samples"]), list(header["exts"]), header["truncated"], body)
        self._known[shard] = index
        if held is not None:
            index.fd, index.index_fd, index.identity = held.fd, held.index_fd, held.identity
            self._opened(shard, index)
        return index

    def _opened(self, shard: str, index: ShardIndex) -> None:
        self._open[shard] = index
        while len(self._open) > MAX_OPEN:
            self._open.popitem(last=False)[1].close()

    def _open_files(self, shard: str, index: ShardIndex) -> None:
        if shard in self._open:
            self._open.move_to_end(shard)
            return
        if needs_copy(shard):
            held = self._hold(shard, index.identity)
            if held.identity != index.identity:  # fetched again since: read its header (the same bytes when
                header, index.body = read_header(held.index_path)  # dataset.json has a digest)
                index.samples, index.exts, index.truncated = int(header["samples"]), list(header["exts"]), \
                    header["truncated"]
            index.fd, index.index_fd, index.identity = held.fd, held.index_fd, held.identity
        else:
            index.fd = os.open(index.path, os.O_RDONLY)
            index.index_fd = os.open(index.index_path, os.O_RDONLY)
        self._opened(shard, index)

    def keep_only(self, shards: Iterable[str]) -> None:
        """Release the cached copies this process holds other than those of `shards` (what the reader reads
        next): the rest of the cache is free to evict them. Shards read in place stay open (the LRU)."""
        keep = set(shards)
        for shard in [s for s in self._open if s not in keep and needs_copy(s)]:
            self._open.pop(shard).close()

    def load(self, shard: str, i: int) -> tario.RawSample:
        """Sample i of `shard`; SampleError(kind) when it cannot be had (the shard's own error included)."""
        try:
            index = self.get(shard)
            if i < index.samples:
                self._open_files(shard, index)
        except tario.ShardError as e:
            raise tario.SampleError(e.kind, str(e)) from None
        except OSError as e:
            raise tario.SampleError(tario.UNREADABLE_SHARD, f"'{shard}': {e}") from None
        if i >= index.samples:
            raise tario.SampleError(tario.TRUNCATED_TAR, f"'{shard}' has {index.samples} samples, dataset.json "
                                    f"more" + (f"; {index.truncated}" if index.truncated else ""))
        try:
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
