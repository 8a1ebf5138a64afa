"""One writer per run directory: a POSIX record lock on RUN_DIR/lock, held for the life of the job.

    holder = lock_run_dir(run_dir)      # rank 0, before anything is written into run_dir
    remove_if_unused(run_dir)           # a start that failed: the folders the lock made, if nothing else is there

The lock is `fcntl.lockf` on an open file: the kernel releases it when the process that holds it ends,
however it ends (SIGKILL, OOM, a node's job step torn down), so a lock left by a dead job never blocks
its requeue and there is nothing to clean up by hand. The file holds who took it (host, pid, Slurm job
id, torchrun run id, time) so that a second job can say who is writing.

"This job restarted" vs "another job": a held lock is our own previous attempt, still exiting, when
  - its Slurm job id is ours (a requeue keeps SLURM_JOB_ID), or
  - its torchrun run id is ours (TORCHELASTIC_RUN_ID, torchrun's --rdzv-id: one id for every worker-group
    restart of an elastic job; torchrun's default id "none" is shared by unrelated jobs and does not count), or
  - it names this host and a pid that no longer exists (an NFS lock whose lease outlives its holder).
Then we wait for it (up to `SAME_JOB_WAIT_S`); any other holder is another job: RunDirLocked at once.
On NFS the lock goes through the server's lock manager (NFSv4 leases; v3 needs lockd).

The lock is taken before the fine-tune source is read (the start-or-resume plan decides whether it is
read at all), so a start refused then would leave an empty RUN_DIR holding only `lock`: `remove_if_unused`
takes away what the lock created, and a refused `--from` leaves no run directory for the next start.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = "lock"
SAME_JOB_WAIT_S = 120.0

_held: dict[str, int] = {}  # run dir -> open file descriptor (closing it would release the lock)
_created: dict[str, list[Path]] = {}  # run dir -> the folders lock_run_dir made for it, deepest first


class RunDirLocked(RuntimeError):
    """Another job writes this run directory; the message names it and the holder."""


def _run_id() -> str | None:
    """torchrun's job id (--rdzv-id), None outside torchrun or when left at its shared default "none"."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return run_id if run_id and run_id != "none" else None


def _me() -> dict[str, object]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "torchelastic_run_id": _run_id(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _pid_gone(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # exists, another user's
        return False
    return False


def same_job(me: dict, holder: dict) -> bool:
    """Whether a held lock belongs to this job's previous attempt (see the module docstring)."""
    for key in ("slurm_job_id", "torchelastic_run_id"):
        if me.get(key) is not None and holder.get(key) == me[key]:
            return True
    return holder.get("host") == me["host"] and _pid_gone(holder.get("pid"))


def _describe(holder: dict) -> str:
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    if holder.get("torchelastic_run_id"):
        job += f", torchrun run id {holder['torchelastic_run_id']}"
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}{job}, since {holder.get('since', '?')}"


def _read_holder(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def lock_run_dir(run_dir: Path) -> dict[str, object]:
    """Take the run directory's lock for this process (idempotent); RunDirLocked if another job holds it."""
    run_dir = Path(run_dir)
    key = str(run_dir.resolve())
    if key in _held:
        return _read_holder(_held[key])
    created = [d for d in (run_dir, *run_dir.parents) if not d.exists()]  # deepest first
    me, deadline = _me(), time.monotonic() + SAME_JOB_WAIT_S
    while True:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_holder(fd)
            os.close(fd)
            if not same_job(me, holder) or time.monotonic() > deadline:
                raise RunDirLocked(f"{run_dir} is being written by another job ({_describe(holder)}): one job "
                                   f"per run directory. Wait for it to end, stop it, or use another run.dir "
                                   f"(the lock is {run_dir / LOCK_FILE}; it goes when its holder exits)") from None
            time.sleep(1.0)  # our own previous attempt (a requeue) is still exiting
            continue
        if _is_at_path(fd, run_dir / LOCK_FILE):
            break
        # The holder removed the file (remove_if_unused) between our open and our lock: a lock on an
        # unlinked file guards nothing. Lock the file now at the path (a new one if need be).
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    _held[key] = fd
    _created[key] = created
    return me


def _is_at_path(fd: int, path: Path) -> bool:
    try:
        at_path = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (at_path.st_dev, at_path.st_ino)


def remove_if_unused(run_dir: Path) -> None:
    """After a start that failed: when this process's lock_run_dir created RUN_DIR and nothing but the
    lock file is in it, remove the file (while still holding the lock: a job that opened it meanwhile
    finds it gone and locks a new one), release the lock, and remove the folders the lock created. In
    any other case nothing: the lock stays until the process ends."""
    run_dir = Path(run_dir)
    key = str(run_dir.resolve())
    if key not in _held or not _created.get(key):
        return
    try:
        if [p.name for p in run_dir.iterdir()] != [LOCK_FILE]:
            return  # the start wrote something (config.yaml, a restored tag): a run directory, kept
        os.unlink(run_dir / LOCK_FILE)
    except OSError:
        return
    os.close(_held.pop(key))
    for folder in _created.pop(key):  # deepest first; one another job wrote into meanwhile stays
        try:
            folder.rmdir()
        except OSError:
            break
