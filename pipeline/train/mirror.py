"""Runs mirrored to a bucket: `run.remote: s3://bucket/runs/NAME` (docs/training.md, Runs in a bucket).

    REMOTE/checkpoints/step_0000400/...   every file of a complete local tag, then its complete.json last
                                          (with each file's sha256): a tag without complete.json in the
                                          bucket is a half upload and is never restored
    REMOTE/config.yaml, metrics.jsonl     after each tag, and at the end of the run
    REMOTE/model.safetensors              at the end of the run (the final export waits for the mirror)
    REMOTE/lock.json                      the job writing this prefix (host, pid, Slurm job, lease end)

Uploads run in one background thread of rank 0 (`Mirror`): a checkpoint save hands the tag over and
training goes on; a tag counts as mirrored only once its complete.json is up. Retention applies in the
bucket as locally: after a tag is up, bucket tags older than it that the run directory no longer keeps
are deleted (complete.json first, so a half-deleted tag is never complete either).

A start whose run directory has no complete tag at least as new as the bucket's newest (a fresh node, a
requeue onto another machine) downloads that tag first (`restore`: every file checked against the size
and sha256 its complete.json records, through pipeline/remote/storage.py's retries), then resumes from it
exactly as from a local one.

The lock: the local one (lock.py) cannot see a job on another machine writing the same prefix. The
remote one is an object created with a conditional PUT (`If-None-Match: *`: S3 since 2024, SeaweedFS,
MinIO; the store refuses a second creator) holding a lease renewed every `RENEW_S` by a conditional
overwrite (`If-Match` on its ETag). A job killed without releasing it leaves a lease that ends within
`LEASE_S`; a later job takes over an ended lease (or its own Slurm job's, a requeue) with the same
conditional overwrite, so two jobs that race for it cannot both win.

Multi-node runs whose run directory is a node-local disk are not mirrored whole: rank 0 uploads what its
own node's run directory holds (the whole tag on one node or on a shared file system).
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pipeline import atomic
from pipeline.remote import Expected, RetryPolicy, fetch, file_sha256, s3
from pipeline.remote.names import UnsafeName, relative_name
from pipeline.train import checkpoint as ckpt
from pipeline.train.lock import RunDirLocked

LOCK_OBJECT = "lock.json"
LEASE_S = 600.0  # a lock not renewed for this long belongs to a dead job
RENEW_S = 60.0
RUN_FILES = ("config.yaml", "metrics.jsonl", "model.safetensors")  # uploaded at the end, when present


class RemoteError(ckpt.CheckpointError):
    """run.remote cannot be used: the message names the URL and what the store said (a CheckpointError:
    the command line prints it as one line and exits 1)."""


def log(message: str) -> None:
    print(f"mirror: {message}", file=sys.stderr, flush=True)


def _split(remote: str) -> tuple[str, str]:
    if not remote.startswith("s3://"):
        raise RemoteError(f"run.remote: expected s3://BUCKET/PREFIX, got '{remote}'")
    bucket, prefix = s3.split_url(remote)
    return bucket, prefix.strip("/")


def _client() -> Any:
    return s3.client("write")  # botocore's standard retries (uploads and small requests)


def _code(e: BaseException) -> str:
    return str(getattr(e, "response", {}).get("Error", {}).get("Code", "")) if hasattr(e, "response") else ""


# ----------------------------------------------------------------------------- the lock


class RemoteLock:
    """One job writes a run prefix at a time (see the module's docstring)."""

    def __init__(self, remote: str, lease_s: float = LEASE_S, renew_s: float = RENEW_S):
        self.remote = remote
        self.bucket, prefix = _split(remote)
        self.key = f"{prefix}/{LOCK_OBJECT}" if prefix else LOCK_OBJECT
        self.lease_s, self.renew_s = lease_s, renew_s
        self.etag: str | None = None
        self.lost = False  # another job took it over (our lease had ended): say so, and stop mirroring
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _me(self) -> dict[str, Any]:
        return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "expires": time.time() + self.lease_s}

    def _put(self, **condition: str) -> str:
        r = _client().put_object(Bucket=self.bucket, Key=self.key, Body=json.dumps(self._me()).encode(),
                                 ContentType="application/json", **condition)
        return str(r["ETag"])

    def take(self) -> None:
        from botocore.exceptions import ClientError

        try:
            self.etag = self._put(IfNoneMatch="*")
        except ClientError as e:
            if _code(e) not in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise RemoteError(f"run.remote {self.remote}: cannot create {self.key}: {e}") from None
            got = _client().get_object(Bucket=self.bucket, Key=self.key)
            holder, etag = json.loads(got["Body"].read() or b"{}"), str(got["ETag"])
            mine = os.environ.get("SLURM_JOB_ID")
            same_job = bool(mine) and holder.get("slurm_job_id") == mine  # a requeue of this job: its own lock
            if float(holder.get("expires", 0)) > time.time() and not same_job:
                job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
                raise RunDirLocked(
                    f"run.remote {self.remote} is being written by another job (host {holder.get('host', '?')}, "
                    f"pid {holder.get('pid', '?')}{job}, since {holder.get('since', '?')}; lease until "
                    f"{time.strftime('%H:%M:%S', time.localtime(float(holder.get('expires', 0))))}): one job per "
                    f"run prefix. Wait for it to end (a killed job's lease ends within {self.lease_s:.0f} s), "
                    f"or use another run.remote") from None
            try:
                self.etag = self._put(IfMatch=etag)  # the lease ended: take it over, unless another job just did
            except ClientError as e2:
                raise RunDirLocked(f"run.remote {self.remote}: another job took {self.key} over at the same "
                                   f"moment ({_code(e2)}); one job per run prefix") from None
            why = (f"an earlier attempt of this Slurm job, {mine}: a requeue takes its own lock at once"
                   if same_job else "its lease had ended")
            log(f"took over {self.remote}/{LOCK_OBJECT} from host {holder.get('host', '?')}, pid "
                f"{holder.get('pid', '?')} ({why})")
        self._thread = threading.Thread(target=self._renew, name="remote-lock", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        while not self._stop.wait(self.renew_s):
            try:
                self.etag = self._put(IfMatch=self.etag or "*")
            except ClientError as e:
                if _code(e) == "PreconditionFailed":
                    self.lost = True
                    log(f"lost the lock on {self.remote}: another job took it over; this job's uploads stop")
                    return
                log(f"renewing the lock on {self.remote} failed ({_code(e) or e}); retrying")
            except BotoCoreError as e:
                log(f"renewing the lock on {self.remote} failed ({e}); retrying")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.etag is not None and not self.lost:
            try:
                _client().delete_object(Bucket=self.bucket, Key=self.key)
            except Exception as e:  # noqa: BLE001 - the lease ends by itself
                log(f"could not release {self.remote}/{LOCK_OBJECT} ({e}); its lease ends within {self.lease_s:.0f} s")
            self.etag = None


# ----------------------------------------------------------------------------- uploads


class Mirror:
    """The background uploader of one run directory (rank 0)."""

    def __init__(self, remote: str, run_dir: Path, lock: RemoteLock | None = None):
        self.remote = remote.rstrip("/")
        self.bucket, self.prefix = _split(remote)
        self.run_dir = Path(run_dir)
        self.lock = lock
        self.mirrored: list[str] = []  # tags whose complete.json is up, in order
        self.error: str | None = None  # the first failure, re-raised by wait()
        self._jobs: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="run-mirror", daemon=True)
        self._thread.start()

    def key(self, *parts: str) -> str:
        return "/".join([p for p in (self.prefix, *parts) if p])

    def tag(self, tag: str) -> None:
        """Upload complete tag `tag` in the background (returns at once)."""
        self._jobs.put(("tag", tag))

    def files(self, names: tuple[str, ...] = RUN_FILES) -> None:
        self._jobs.put(("files", names))

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until everything handed over is up (True), or `timeout_s` passed (False); RemoteError if
        an upload failed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._jobs.all_tasks_done:  # queue.Queue's condition for join(), with a time limit
            while self._jobs.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._jobs.all_tasks_done.wait(left)
        if self.error:
            raise RemoteError(self.error)
        return True

    def _work(self) -> None:
        while True:
            kind, what = self._jobs.get()
            try:
                if self.lock is not None and self.lock.lost:
                    continue
                if kind == "tag":
                    self._upload_tag(what)
                else:
                    for name in what:
                        if (self.run_dir / name).is_file():
                            _client().upload_file(str(self.run_dir / name), self.bucket, self.key(name))
            except Exception as e:  # noqa: BLE001 - reported by wait(), at the final export
                self.error = self.error or f"run.remote {self.remote}: uploading {what} failed: {type(e).__name__}: {e}"
                log(self.error)
            finally:
                self._jobs.task_done()

    def _upload_tag(self, tag: str) -> None:
        tag_dir = ckpt.checkpoint_dir(self.run_dir) / tag
        try:
            record = json.loads((tag_dir / ckpt.COMPLETE_FILE).read_text())
            record["files"] = ckpt.recorded_files(tag_dir)  # names checked: only the tag's own files go up
            digests = {}
            for name in record["files"]:
                digests[name] = file_sha256(tag_dir / name)
                _client().upload_file(str(tag_dir / name), self.bucket, self.key("checkpoints", tag, name))
        except FileNotFoundError:
            log(f"{tag} was pruned locally before its upload ended; not mirrored")
            return
        # Last, and only now: the bucket's copy of the tag exists for restore from this PUT on.
        record["sha256"] = digests
        _client().put_object(Bucket=self.bucket, Key=self.key("checkpoints", tag, ckpt.COMPLETE_FILE),
                             Body=json.dumps(record).encode(), ContentType="application/json")
        self.mirrored.append(tag)
        for name in ("config.yaml", "metrics.jsonl"):  # small: a restored tag comes with what led to it
            if (self.run_dir / name).is_file():
                _client().upload_file(str(self.run_dir / name), self.bucket, self.key(name))
        self._prune(tag)

    def _prune(self, current: str) -> None:
        """Bucket tags older than `current` that the run directory no longer keeps (its retention ran)."""
        keep = set(ckpt.all_tags(self.run_dir))
        for tag in remote_tags(self.bucket, self.prefix):
            if ckpt.tag_step(tag) < ckpt.tag_step(current) and tag not in keep:
                _delete_tag(self.bucket, self.key("checkpoints", tag) + "/")


def remote_tags(bucket: str, prefix: str) -> list[str]:
    """Tag folders under PREFIX/checkpoints/ in the bucket, complete or not, newest first (one LIST)."""
    c = _client()
    base = f"{prefix}/checkpoints/" if prefix else "checkpoints/"
    found = []
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base, Delimiter="/"):
        for p in page.get("CommonPrefixes", []):
            name = p["Prefix"][len(base):].strip("/")
            if ckpt.is_tag(name):  # anything else under checkpoints/ is not ours to restore or prune
                found.append(name)
    return sorted(found, key=ckpt.tag_step, reverse=True)


def _delete_tag(bucket: str, base: str) -> None:
    c = _client()
    c.delete_object(Bucket=bucket, Key=base + ckpt.COMPLETE_FILE)  # first: a half-deleted tag is not complete
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base):
        for obj in page.get("Contents", []):
            c.delete_object(Bucket=bucket, Key=obj["Key"])


def _remote_record(bucket: str, key: str) -> dict[str, Any] | None:
    from botocore.exceptions import ClientError

    try:
        record = json.loads(_client().get_object(Bucket=bucket, Key=key)["Body"].read())
    except ClientError as e:
        if _code(e) in ("NoSuchKey", "404"):
            return None
        raise
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("files"), dict) else None


# ----------------------------------------------------------------------------- restore


def checked_record(record: dict[str, Any], source: str) -> tuple[dict[str, int], dict[str, str]]:
    """(file name -> size, file name -> sha256) of a bucket's complete.json, every name checked before any
    is joined to a local folder (pipeline/remote/names.py: relative, no '..', inside the tag's folder), every
    size a byte count and every digest hex: RemoteError naming `source` otherwise, before anything is written."""
    files, digests = record["files"], record.get("sha256", {})
    if not isinstance(digests, dict):
        raise RemoteError(f"{source}: 'sha256' is not an object of file names and digests; nothing was restored")
    try:
        for name in files:
            relative_name(name, source)
    except UnsafeName as e:
        raise RemoteError(str(e)) from None
    for name, size in files.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise RemoteError(f"{source}: the size of {name!r} is {size!r}, not a byte count; nothing was restored")
        digest = digests.get(name)
        if digest is not None and not (isinstance(digest, str) and len(digest) == 64
                                       and all(c in "0123456789abcdef" for c in digest)):
            raise RemoteError(f"{source}: the sha256 of {name!r} is {str(digest)[:80]!r}, not 64 hex digits; "
                              f"nothing was restored")
    return dict(files), {k: v for k, v in digests.items() if k in files}


def restore(remote: str, run_dir: Path, policy: RetryPolicy | None = None) -> str | None:
    """Download the bucket's newest complete tag into RUN_DIR/checkpoints when the run directory has no
    complete tag at least as new (and config.yaml, metrics.jsonl when missing); the tag restored, or None."""
    bucket, prefix = _split(remote)
    run_dir = Path(run_dir)
    local = ckpt.newest_complete_tag(run_dir)
    for tag in remote_tags(bucket, prefix):
        if local is not None and ckpt.tag_step(local) >= ckpt.tag_step(tag):
            return None  # the run directory is as new as the bucket
        base = f"{prefix}/checkpoints/{tag}/" if prefix else f"checkpoints/{tag}/"
        record = _remote_record(bucket, base + ckpt.COMPLETE_FILE)
        if record is None:
            log(f"skipping {remote}/checkpoints/{tag}: no {ckpt.COMPLETE_FILE} (its upload did not finish)")
            continue
        files, digests = checked_record(record, f"{remote}/checkpoints/{tag}/{ckpt.COMPLETE_FILE}")
        tag_dir = ckpt.checkpoint_dir(run_dir) / tag
        partial = tag_dir.with_name(f".{tag}.restoring")  # renamed into place whole: a killed restore leaves no tag
        shutil.rmtree(partial, ignore_errors=True)
        for name, size in files.items():
            out = partial / name  # a checked name: inside the tag's folder
            out.parent.mkdir(parents=True, exist_ok=True)
            fetch(f"s3://{bucket}/{base}{name}", out, Expected(size, digests.get(name)), policy)
        atomic.write_text(partial / ckpt.COMPLETE_FILE, json.dumps({"tag": tag, "files": files}))
        shutil.rmtree(tag_dir, ignore_errors=True)  # an incomplete local tag of that name
        os.replace(partial, tag_dir)
        atomic.fsync_dir(tag_dir.parent)
        for name in ("config.yaml", "metrics.jsonl"):
            if not (run_dir / name).exists():
                try:
                    fetch(f"s3://{bucket}/{prefix + '/' if prefix else ''}{name}", run_dir / f".{name}.restoring",
                          Expected(), policy)
                    os.replace(run_dir / f".{name}.restoring", run_dir / name)
                except Exception:  # noqa: BLE001 - uploaded at the end of a run only: often not there yet
                    (run_dir / f".{name}.restoring").unlink(missing_ok=True)
        log(f"restored {tag} from {remote} into {tag_dir}")
        return tag
    return None


# ----------------------------------------------------------------------------- the trainer's hooks

_active: dict[str, tuple[RemoteLock, Mirror]] = {}  # run dir -> its lock and mirror (rank 0 of a job)


def start(cfg: Any, run_dir: Path) -> None:
    """Rank 0, right after the local lock: take the remote lock, restore from the bucket if the run
    directory is behind it, start the uploader. Nothing when run.remote is unset."""
    remote = getattr(cfg.run, "remote", None)
    key = str(Path(run_dir).resolve())
    if not remote or key in _active:
        return
    lock = RemoteLock(remote)
    try:
        lock.take()
    except (RunDirLocked, RemoteError):
        raise
    except Exception as e:  # noqa: BLE001 - credentials, no such bucket, an unreachable endpoint: one line
        raise RemoteError(f"run.remote {remote}: cannot take {LOCK_OBJECT}: {type(e).__name__}: {e}") from None
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        restore(remote, Path(run_dir), RetryPolicy.from_config(cfg.data))
    except BaseException as e:
        lock.release()
        if isinstance(e, Exception) and not isinstance(e, RemoteError):
            raise RemoteError(f"run.remote {remote}: restoring from the bucket failed: {e}") from None
        raise
    _active[key] = (lock, Mirror(remote, Path(run_dir), lock))
    # A run that stops early (preemption, an error) exits without `finish`: the tags handed over still go
    # up, then the lock is released, before the process ends.
    atexit.register(_drain, key)


def drain(run_dir: Path, timeout_s: float | None = None) -> bool:
    """Rank 0, before a run that stops early exits (preemption): wait up to `timeout_s` for the tags handed
    over; once they are up, release the lock and return True (also when run.remote is unset). An upload
    that failed is logged (the local tag stays complete; the bucket lags it by a tag)."""
    return _drain(str(Path(run_dir).resolve()), timeout_s)


def _drain(key: str, timeout_s: float | None = None) -> bool:
    entry = _active.get(key)
    if entry is None:
        return True
    lock, mirror = entry
    try:
        if not mirror.wait(timeout_s):
            return False
    except RemoteError as e:
        log(str(e))
    _active.pop(key, None)
    lock.release()
    return True


def saved(run_dir: Path, tag: str) -> None:
    """Rank 0, after a tag is complete locally: upload it in the background."""
    entry = _active.get(str(Path(run_dir).resolve()))
    if entry is not None:
        entry[1].tag(tag)


def finish(run_dir: Path) -> None:
    """Rank 0, after the final export: upload the run's files, wait for every upload, release the lock."""
    entry = _active.pop(str(Path(run_dir).resolve()), None)
    if entry is None:
        return
    lock, mirror = entry
    mirror.files()
    try:
        mirror.wait()
        log(f"{len(mirror.mirrored)} tag(s) and the run's files are in {mirror.remote}")
    finally:
        lock.release()
