"""The per-shard index file: where each sample's members are in a WebDataset tar shard.

A sample is the run of consecutive tar members sharing a key (webdataset's `base_plus_ext`).
Its members' data offsets and sizes come from the shard's **index** (`NAME.tar.idx`), never
from scanning tar headers in every process:

- `make_shards.py` writes the index beside each shard it writes (`ShardWriter`);
- a shard without one (written by others) gets it built once per machine, in `data.cache_dir`,
  by the first process that needs it (under a file lock; written to a temporary name, then
  renamed), and every other process on the machine reads that file (`index_for`);
- a shard without random access (`pipe:` commands, http(s) and s3 URLs, `.tar.gz`) is first copied whole
  into the node's cache, its index built next to the copy (cache.py); reader.py reads samples through both.

An index file: `MAGIC`, the header's length (8 bytes, little endian), the header (JSON: shard
size, sample count, member extensions, why the archive ends early if it does), zero padding to
8 bytes, then one record per sample of int64s: a flag (1 + the column of a member that occurs
twice, or 0), then (data offset, size) per extension column, offset -1 where the sample has no
such member. A process reads a shard's index whole once (the first time it reads from the shard: `check_index`, a
damaged index is built again, never trusted) and then one record per sample, tens of bytes per ~100 KB.
A member's name is data: it gives a sample its key and extension, and is never a path.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline import atomic
from pipeline.remote.retry import node_cache_dir

from . import tario

MAGIC = b"VITIDX01"
INDEX_SUFFIX = ".idx"
INDEX_FORMAT = 1


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


def index_for(path: str, shard: str, cache_dir: str | None) -> str:
    """The index file of the local tar `path`: beside it when it is there and sound for the file
    (`check_index`), else in the cache, built once per machine (a damaged one is built again)."""
    size = os.path.getsize(path)
    beside = path + INDEX_SUFFIX
    if index_matches(beside, size):
        return beside
    folder = Path(cache_dir or default_cache_dir()) / "index"
    folder.mkdir(parents=True, exist_ok=True)
    st = os.stat(path)
    # Keyed by where the shard is and what it is: a rewritten shard gets a new index.
    name = hashlib.sha256(f"{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = folder / (name + INDEX_SUFFIX)
    if index_matches(str(cached), size):
        return str(cached)
    with open(folder / (name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build per shard per machine; the others wait, then read it
        if not index_matches(str(cached), size):
            write_index(cached, build_index(path, shard))
    return str(cached)


def index_matches(index_path: str, shard_bytes: int) -> bool:
    """Does `index_path` hold a whole, sound index of a shard of this size? A damaged one is rebuilt
    (an index is a cache of the shard's headers)."""
    try:
        check_index(index_path, shard_bytes)
    except (OSError, ValueError):
        return False
    return True



def default_cache_dir() -> str:
    return node_cache_dir(None)
