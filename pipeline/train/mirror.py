"""Runs mirrored to a bucket: `run.remote: s3://bucket/runs/NAME` (docs/training.md, Runs in a bucket).

    REMOTE/checkpoints/step_0000400/...   every file of a complete local tag, then its complete.json last
                                          (with each file's sha256): a tag without complete.json in the
                                          bucket is a half upload and is never restored
    REMOTE/config.yaml, metrics.jsonl     after each tag, and at the end of the run
    REMOTE/model.safetensors              at the end of the run (the final export waits for the mirror)
    REMOTE/lock.json                      the job writing this prefix (remote_lock.py)

Uploads run in one background thread of rank 0 (`Mirror`): a checkpoint save hands the tag over and
training goes on; a tag counts as mirrored only once its complete.json is up. Retention applies in the
bucket as locally: after a tag is up, bucket tags older than it that the run directory no longer keeps
are deleted (complete.json first, so a half-deleted tag is never complete either): the bucket's newest
complete tag goes only once a newer one is complete there. Locally, the tag being uploaded is not pruned
(`protected`): on a link slower than the checkpoints, pruned under its upload, no tag would ever reach the
bucket complete. So from the first tag that reaches the bucket on, the bucket always holds a complete one,
for at most one tag beyond train.keep_last on the local disk while uploads lag the saves.

A failed upload is retried, with data.retry_backoff_s doubling up to MAX_WAIT_S, until it succeeds or the store has been
failing for data.retry_time_s (an outage's clock, reset by any success: a store gone for good does not cost
that long per queued tag; botocore's own retries are off so that this loop, its clock and its lines
govern an outage). An answer no retry changes (403 AccessDenied, 404 NoSuchBucket, wrong credentials:
`remote.s3.refusal`) is not retried: the store answers it every time. A failure is kept only while it is
current: a tag's until a newer tag goes up, the run's files' until they do. At the end the run waits for
every upload, and exits 0 when the bucket holds its final state (the last tag and the run's files), whatever
failed on the way; else 1 with the current failure (`raise_unless_up`, on every rank, said once by rank 0).

Pruning is housekeeping, never the run's failure: a bucket whose policy denies DeleteObject (retention,
write-once) keeps the old tags; the refusal is said once, counted (mirror/prunes_refused in MLflow), and
neither retried nor waited on. A pruning that failed for a transient fault is tried again at the next tag,
and after the run's files at the end (no newer tag will); given up, it is a warning.

A start whose run directory is behind the bucket restores the newest complete tag first (mirror_restore.py).

Multi-node runs whose run directory is a node-local disk are not mirrored whole: rank 0 uploads what its
own node's run directory holds (the whole tag on one node or on a shared file system).
"""

from __future__ import annotations

import atexit
import json
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.remote import RetryPolicy, file_sha256
from pipeline.remote.s3 import refusal
from pipeline.train import checkpoint as ckpt
from pipeline.train.lock import RunDirLocked
from pipeline.train.mirror_restore import checked_record, remote_tags, restore  # noqa: F401 (callers import them here)
from pipeline.train.remote_lock import (  # noqa: F401 (LOCK_OBJECT, RemoteLock: what callers import from here)
    LOCK_OBJECT,
    RemoteError,
    RemoteLock,
    client,
    error_code,
    log,
    split_remote,
)

RUN_FILES = ("config.yaml", "metrics.jsonl", "model.safetensors")  # uploaded at the end, when present
# The longest wait between two attempts of an upload: one thread of one process retries (not every rank's
# readers, as storage.py's 60 s cap allows for), and each second of it is one the bucket lags after an outage.
MAX_WAIT_S = 10.0


def _client() -> Any:
    return client()


# ----------------------------------------------------------------------------- uploads


class Mirror:
    """The background uploader of one run directory (rank 0). Jobs (a tag, the run's files) go up in the
    order handed over, each retried (see the module's docstring); `failure` is the current one, or None."""

    def __init__(self, remote: str, run_dir: Path, lock: RemoteLock | None = None,
                 policy: RetryPolicy | None = None):
        self.remote = remote.rstrip("/")
        self.bucket, self.prefix = split_remote(remote)
        self.run_dir = Path(run_dir)
        self.lock = lock
        self.policy = policy or RetryPolicy()
        self.mirrored: list[str] = []  # tags whose complete.json went up, in order
        self.in_flight: str | None = None  # the tag being uploaded (retries included)
        self._failed: dict[str, str] = {}  # job kind ('tag', 'files') -> its current failure (`failure`)
        self._failing_since: float | None = None  # the outage's clock (monotonic), None while uploads succeed
        self._jobs: list[tuple[str, Any]] = []
        self._busy = False
        self._prune_due: str | None = None  # the tag whose bucket pruning failed, until a later one succeeds
        self.prunes_refused = 0  # prunings the store refused (a DELETE denied): mirror/prunes_refused
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="run-mirror", daemon=True)
        self._thread.start()

    @property
    def failure(self) -> str | None:
        """What the bucket lacks now: a tag given up until a newer tag goes up, the run's files until they do
        (a success of one kind does not stand for the other: the last tag and the files are both the end)."""
        with self._cond:
            return "; ".join(self._failed.values()) or None

    def key(self, *parts: str) -> str:
        return "/".join([p for p in (self.prefix, *parts) if p])

    def tag(self, tag: str) -> None:
        """Upload complete tag `tag` in the background (returns at once)."""
        self._put(("tag", tag))

    def files(self, names: tuple[str, ...] = RUN_FILES) -> None:
        """Upload the run's files after the tags handed over (the end of the run), then retry a pruning that
        failed for a transient fault (no newer tag will)."""
        self._put(("files", names))
        self._put(("prune", None))

    def _put(self, job: tuple[str, Any]) -> None:
        with self._cond:
            self._jobs.append(job)
            self._cond.notify_all()

    def protected(self) -> set[str]:
        """Tags the run directory must keep: the one being uploaded (retries included)."""
        with self._cond:
            return {self.in_flight} if self.in_flight else set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until everything handed over is up or given up (True), or `timeout_s` passed (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout_s)

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._jobs))
                kind, what = self._jobs.pop(0)
                self._busy = True
                self.in_flight = what if kind == "tag" else None
            try:
                self._attempt(kind, what)
            finally:
                with self._cond:
                    self._busy, self.in_flight = False, None
                    self._cond.notify_all()

    def _attempt(self, kind: str, what: Any) -> None:
        """One job ('tag', 'files', 'prune'), retried until it succeeds or the outage's clock passes
        data.retry_time_s; an answer no retry changes ends it at once."""
        done: set[str] = set()  # what of the job is up: a retry goes on from there
        failures, went_up = 0, 0
        while True:
            if self.lock is not None and self.lock.lost:
                self._set_failed(kind, f"run.remote {self.remote}: another job took the prefix's lock over; "
                                       f"{what} and what follows were not uploaded")
                return
            try:
                job = {"tag": self._upload_tag, "files": self._upload_files, "prune": self._prune_late}[kind]
                up = job(what, done)
                self._failing_since = None
                if up:  # a tag pruned before its turn clears nothing: the bucket holds nothing newer
                    self._set_failed(kind, None)
                return
            except Exception as e:  # noqa: BLE001 - any failure of the store or the network
                if len(done) > went_up:  # a file went up since the last failure: the store is not down
                    self._failing_since, went_up = None, len(done)
                failures += 1
                if not self._again(kind, what, e, failures):
                    return

    def _again(self, kind: str, what: Any, e: Exception, failures: int) -> bool:
        """After a job's `failures`-th failure `e`: wait and say True to retry it, or say why not and False.
        A pruning's failure is a warning only (it never is what the run failed at)."""
        refused = refusal(e)
        doing = "pruning the bucket's old tags" if kind == "prune" else f"uploading {what}"
        failure = f"run.remote {self.remote}: {doing} failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
        if kind == "prune" and refused:
            self._refused(refused)
            return False
        if kind != "prune":
            self._set_failed(kind, failure)
        if refused:
            log(f"{failure}; not retried: the store gives this answer ({refused}) every time (a bucket policy, "
                f"the credentials, the bucket's name)")
            return False
        now = time.monotonic()
        self._failing_since = self._failing_since or now
        wait = min(MAX_WAIT_S, self.policy.delay(failures))
        if now + wait - self._failing_since > self.policy.total_s:
            after = " (old tags stay in the bucket: not a failure of the run)" if kind == "prune" else ""
            log(f"{failure}; gave up after {failures} attempt(s): the store has been failing for "
                f"{now - self._failing_since:.0f} s (data.retry_time_s={self.policy.total_s:g}){after}")
            return False
        log(f"{failure}; retry {failures} in {wait:.1f} s")
        time.sleep(wait)
        return True

    def _refused(self, status: str) -> None:
        """The store refused a DELETE of pruning: said once, counted, never retried or waited on."""
        self.prunes_refused += 1
        if self.prunes_refused == 1:
            log(f"pruning refused: {self.remote} answers DELETE with {status} (a bucket policy without "
                f"s3:DeleteObject, retention or write-once): old tags stay in the bucket, train.keep_last applies "
                f"to the run directory only; not retried, not a failure of the run (counted: mirror/prunes_refused)")

    def _set_failed(self, kind: str, failure: str | None) -> None:
        with self._cond:
            if failure is None:
                self._failed.pop(kind, None)
            else:
                self._failed[kind] = failure

    def _upload_tag(self, tag: str, done: set[str]) -> bool:
        """Upload `tag` (what `done` lacks), complete.json last; False when the tag is gone locally."""
        tag_dir = ckpt.checkpoint_dir(self.run_dir) / tag
        try:
            record = json.loads((tag_dir / ckpt.COMPLETE_FILE).read_text())
            record["files"] = ckpt.recorded_files(tag_dir)  # names checked: only the tag's own files go up
            digests = record["sha256"] = {}  # of the files as they go up (a local record's own are not taken)
            for name in record["files"]:
                digests[name] = file_sha256(tag_dir / name)
                if name not in done:
                    _client().upload_file(str(tag_dir / name), self.bucket, self.key("checkpoints", tag, name))
                    done.add(name)
        except FileNotFoundError:  # not protected while it waited its turn: pruned by the local retention
            log(f"{tag} was pruned locally before it went up; a newer tag follows")
            return False
        if ckpt.COMPLETE_FILE not in done:  # (a retry after a later step failed does not count it twice)
            # Last, and only now: the bucket's copy of the tag exists for restore from this PUT on.
            _client().put_object(Bucket=self.bucket, Key=self.key("checkpoints", tag, ckpt.COMPLETE_FILE),
                                 Body=json.dumps(record).encode(), ContentType="application/json")
            done.add(ckpt.COMPLETE_FILE)
            with self._cond:
                self.mirrored.append(tag)
        for name in ("config.yaml", "metrics.jsonl"):  # small: a restored tag comes with what led to it
            if (self.run_dir / name).is_file():
                _client().upload_file(str(self.run_dir / name), self.bucket, self.key(name))
        self._prune_due = None if self._try_prune(tag) else tag
        return True

    def _upload_files(self, names: tuple[str, ...], done: set[str]) -> bool:
        for name in names:
            if name not in done and (self.run_dir / name).is_file():
                _client().upload_file(str(self.run_dir / name), self.bucket, self.key(name))
            done.add(name)
        log(f"{len(self.mirrored)} tag(s) and the run's files are in {self.remote}")
        return True

    def _try_prune(self, tag: str) -> bool:
        """Prune after `tag` went up; False when it failed for a fault worth another try (the next tag's)."""
        try:
            self._prune(tag)
        except Exception as e:  # noqa: BLE001 - the tag is up; pruning is housekeeping
            refused = refusal(e)
            if refused:
                self._refused(refused)
                return True
            log(f"pruning the bucket's tags older than {tag} failed ({type(e).__name__}: {e}); the next tag tries again")
            return False
        return True

    def _prune_late(self, *_: Any) -> bool:
        """The end of the run: a pruning of the last tag that failed for a transient fault (a store just back
        from an outage can fail a DELETE), retried as a job of its own after the run's files are up."""
        if self._prune_due:
            self._prune(self._prune_due)
            self._prune_due = None
        return True

    def _prune(self, current: str) -> None:
        """Bucket tags older than `current` that the run directory no longer keeps (its retention ran)."""
        keep = set(ckpt.all_tags(self.run_dir))
        for tag in remote_tags(self.bucket, self.prefix):
            if ckpt.tag_step(tag) < ckpt.tag_step(current) and tag not in keep:
                _delete_tag(self.bucket, self.key("checkpoints", tag) + "/")


def _delete_tag(bucket: str, base: str) -> None:
    c = _client()
    c.delete_object(Bucket=bucket, Key=base + ckpt.COMPLETE_FILE)  # first: a half-deleted tag is not complete
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base):
        for obj in page.get("Contents", []):
            c.delete_object(Bucket=bucket, Key=obj["Key"])


# ----------------------------------------------------------------------------- the trainer's hooks

_active: dict[str, tuple[RemoteLock, Mirror]] = {}  # run dir -> its lock and mirror (rank 0 of a job)
_outcome: dict[str, str | None] = {}  # run dir -> the failure current when its mirror was drained


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
    policy = RetryPolicy.from_config(cfg.data)
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        restore(remote, Path(run_dir), policy)
    except BaseException as e:
        lock.release()
        if isinstance(e, Exception) and not isinstance(e, RemoteError):
            raise RemoteError(f"run.remote {remote}: restoring from the bucket failed: {e}") from None
        raise
    _active[key] = (lock, Mirror(remote, Path(run_dir), lock, policy))
    _outcome.pop(key, None)
    # A run that stops early (preemption, an error) exits without `drain`: the tags handed over still go
    # up, then the lock is released, before the process ends.
    atexit.register(_drain, key)


def drain(run_dir: Path, timeout_s: float | None = None) -> bool:
    """Rank 0, before the run exits (the end, a preemption): wait up to `timeout_s` for what was handed over;
    once it is up or given up, release the lock and return True (also when run.remote is unset). The failure
    then current, if any, is logged and kept for `raise_unless_up`."""
    return _drain(str(Path(run_dir).resolve()), timeout_s)


def _drain(key: str, timeout_s: float | None = None) -> bool:
    entry = _active.get(key)
    if entry is None:
        return True
    lock, mirror = entry
    if not mirror.wait(timeout_s):
        return False
    _active.pop(key, None)
    _outcome[key] = mirror.failure
    if mirror.failure:
        log(f"{mirror.failure} (the bucket does not hold what this run handed over last)")
    lock.release()
    return True


def saved(run_dir: Path, tag: str) -> None:
    """Rank 0, after a tag is complete locally: upload it in the background."""
    entry = _active.get(str(Path(run_dir).resolve()))
    if entry is not None:
        entry[1].tag(tag)


def protected(run_dir: Path) -> set[str]:
    """Rank 0, at a save: the tags the local retention must keep for the mirror (Mirror.protected)."""
    entry = _active.get(str(Path(run_dir).resolve()))
    return entry[1].protected() if entry is not None else set()


def final_files(run_dir: Path) -> None:
    """Rank 0, after the final export: upload config, metrics and the weights after every tag."""
    entry = _active.get(str(Path(run_dir).resolve()))
    if entry is not None:
        entry[1].files()


def metrics(run_dir: Path) -> dict[str, float]:
    """Rank 0 of a mirrored run, at a log step: the mirror's figures for MLflow ({} elsewhere)."""
    entry = _active.get(str(Path(run_dir).resolve()))
    return {"mirror/prunes_refused": float(entry[1].prunes_refused)} if entry is not None else {}


def raise_unless_up(run_dir: Path, is_main: bool, group: Any = None) -> None:
    """Every rank, after the drain: RemoteError on every rank when the bucket does not hold the run's final
    state (rank 0's current failure, said once by rank 0), so that no rank outlives another's error."""
    failure = _outcome.get(str(Path(run_dir).resolve())) if is_main else None
    failed = torch.tensor([1 if failure else 0], dtype=torch.int32)
    if group is not None:  # the preemption's CPU group (None: one process)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if failed.item():
        raise RemoteError(failure or "run.remote: rank 0's uploads did not reach the bucket (its line says why)")
