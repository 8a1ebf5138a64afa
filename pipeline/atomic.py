"""One atomic write for every file the pipeline writes whole: a crash leaves the old file or none,
never half of one.

The data go to a temporary name beside the target that is unique per process and call (two writers,
or a rank and its helper, never share one), are fsynced, renamed over the target (atomic on POSIX),
and the directory is fsynced so that the rename itself survives a power loss. The file gets the mode
the user's umask gives (0644 under 022), whatever the writer created its temporary file with.
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
        # The mode a plain open() would give under the user's umask: some writers create their file 0600
        # whatever the umask (safetensors' save_file), which would hide a run's weights from everyone else.
        os.chmod(tmp, 0o666 & ~umask())
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


def umask() -> int:
    """The process's umask: Linux says it in /proc/self/status; elsewhere it is set and restored at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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
