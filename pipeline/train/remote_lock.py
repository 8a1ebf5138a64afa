"""The remote lock of a run prefix (run.remote): one job writes it at a time.

The local lock (lock.py) cannot see a job on another machine writing the same prefix. The remote one is an
object, REMOTE/lock.json, created with a conditional PUT (`If-None-Match: *`: S3 since 2024, SeaweedFS,
MinIO; the store refuses a second creator) holding a lease renewed every `RENEW_S` by a conditional
overwrite (`If-Match` on its ETag). A job killed without releasing it leaves a lease that ends within
`LEASE_S`; a later job takes over an ended lease (or its own Slurm job's, a requeue) with the same
conditional overwrite, so two jobs that race for it cannot both win. Also here: what mirror.py and this
module share (the prefix's bucket and key, the client, the error).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from typing import Any

from pipeline.remote import s3
from pipeline.train import checkpoint as ckpt
from pipeline.train.lock import RunDirLocked

LOCK_OBJECT = "lock.json"
LEASE_S = 600.0  # a lock not renewed for this long belongs to a dead job
RENEW_S = 60.0


class RemoteError(ckpt.CheckpointError):
    """run.remote cannot be used: the message names the URL and what the store said (a CheckpointError:
    the command line prints it as one line and exits 1)."""


def log(message: str) -> None:
    print(f"mirror: {message}", file=sys.stderr, flush=True)


def split_remote(remote: str) -> tuple[str, str]:
    """'s3://bucket/runs/a/' -> ('bucket', 'runs/a'); RemoteError for another scheme."""
    if not remote.startswith("s3://"):
        raise RemoteError(f"run.remote: expected s3://BUCKET/PREFIX, got '{remote}'")
    bucket, prefix = s3.split_url(remote)
    return bucket, prefix.strip("/")


def client() -> Any:
    # botocore's standard retries for a blip (3 attempts, a few seconds); an outage is the mirror's own retry
    # loop's (its clock, its log lines): 10 attempts here would hide up to two minutes of it in one call.
    return s3.client("write", attempts=3)


def error_code(e: BaseException) -> str:
    """The S3 error code of a botocore ClientError ('PreconditionFailed', 'NoSuchKey'), else ''."""
    return str(getattr(e, "response", {}).get("Error", {}).get("Code", "")) if hasattr(e, "response") else ""


class RemoteLock:
    """One job writes a run prefix at a time (see the module's docstring)."""

    def __init__(self, remote: str, lease_s: float = LEASE_S, renew_s: float = RENEW_S):
        self.remote = remote
        self.bucket, prefix = split_remote(remote)
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
        r = client().put_object(Bucket=self.bucket, Key=self.key, Body=json.dumps(self._me()).encode(),
                                 ContentType="application/json", **condition)
        return str(r["ETag"])

    def take(self) -> None:
        from botocore.exceptions import ClientError

        try:
            self.etag = self._put(IfNoneMatch="*")
        except ClientError as e:
            if error_code(e) not in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise RemoteError(f"run.remote {self.remote}: cannot create {self.key}: {e}") from None
            got = client().get_object(Bucket=self.bucket, Key=self.key)
            holder, etag = self._holder(got["Body"].read()), str(got["ETag"])
            mine = os.environ.get("SLURM_JOB_ID")
            same_job = bool(mine) and holder.get("slurm_job_id") == mine  # a requeue of this job: its own lock
            if holder["expires"] > time.time() and not same_job:
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
                                   f"moment ({error_code(e2)}); one job per run prefix") from None
            why = (f"an earlier attempt of this Slurm job, {mine}: a requeue takes its own lock at once"
                   if same_job else "its lease had ended")
            log(f"took over {self.remote}/{LOCK_OBJECT} from host {holder.get('host', '?')}, pid "
                f"{holder.get('pid', '?')} ({why})")
        self._thread = threading.Thread(target=self._renew, name="remote-lock", daemon=True)
        self._thread.start()

    def _holder(self, raw: bytes) -> dict[str, Any]:
        """The lock object's content, checked: RemoteError saying what the object is and how to clear it when
        it is not a lock this pipeline wrote (damaged, or written by something else)."""
        try:
            holder = json.loads(raw or b"{}")
            if not isinstance(holder, dict):
                raise ValueError(f"a JSON {type(holder).__name__}, not an object")
            holder["expires"] = float(holder.get("expires", 0))
        except (ValueError, TypeError) as e:
            raise RemoteError(
                f"run.remote {self.remote}: s3://{self.bucket}/{self.key} cannot be read as a lock ({type(e).__name__}: "
                f"{' '.join(str(e).split())[:120]}): it is the lock that says which job writes this run prefix "
                f"(one at a time). If no job is writing it, delete it (aws s3 rm s3://{self.bucket}/{self.key}) "
                f"and start again") from None
        return holder

    def _renew(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        while not self._stop.wait(self.renew_s):
            try:
                self.etag = self._put(IfMatch=self.etag or "*")
            except ClientError as e:
                if error_code(e) == "PreconditionFailed":
                    self.lost = True
                    log(f"lost the lock on {self.remote}: another job took it over; this job's uploads stop")
                    return
                log(f"renewing the lock on {self.remote} failed ({error_code(e) or e}); retrying")
            except BotoCoreError as e:
                log(f"renewing the lock on {self.remote} failed ({e}); retrying")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.etag is not None and not self.lost:
            try:
                client().delete_object(Bucket=self.bucket, Key=self.key)
            except Exception as e:  # noqa: BLE001 - the lease ends by itself
                self._end_lease(e)
            self.etag = None

    def _end_lease(self, refused: Exception) -> None:
        """The DELETE of the lock failed (a bucket that denies DeleteObject does every time): overwrite it with a
        lease that has ended, so that the next start takes it over at once instead of waiting out LEASE_S."""
        try:
            ended = {**self._me(), "expires": 0.0, "released": True}
            client().put_object(Bucket=self.bucket, Key=self.key, Body=json.dumps(ended).encode(),
                                ContentType="application/json", IfMatch=self.etag or "*")
            log(f"released {self.remote}/{LOCK_OBJECT} by ending its lease (its DELETE failed: {error_code(refused) or refused})")
        except Exception as e:  # noqa: BLE001 - the lease ends by itself
            log(f"could not release {self.remote}/{LOCK_OBJECT} ({e}); its lease ends within {self.lease_s:.0f} s")
