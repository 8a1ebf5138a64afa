"""One atomic write for every file the pipeline writes whole: a crash leaves the old file or none,
never half of one.

The data go to a temporary name beside the target that is unique per process and call (two writers,
or a rank and its helper, never share one), are fsynced, renamed over the target (atomic on POSIX),
and the directory is fsynced so that the rename itself survives a power loss.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary path beside `path` for a writer that needs a file name (safetensors);
    when the block ends without an error the file becomes `path`; on an error it is removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp, open(tmp, "xb") as f:
        f.write(data)


def write_text(path: str | Path, text: str) -> None:
    write_bytes(path, text.encode())


def fsync_dir(folder: str | Path) -> None:
    """Make the renames in `folder` durable (best effort: some file systems refuse a directory fsync)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
