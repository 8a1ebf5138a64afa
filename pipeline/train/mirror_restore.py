"""A run directory restored from its bucket (run.remote; mirror.py uploads, this reads back).

A start whose run directory has no complete tag at least as new as the bucket's newest (a fresh node, a
requeue onto another machine) downloads that tag first (`restore`), then resumes from it exactly as from a
local one. Everything in the bucket is data until checked (docs/data.md, Storage and trust): every name in
the tag's complete.json must stay inside the tag's folder, every size must be a byte count and agree with the
object the bucket really holds (one LIST, before anything is written or allocated: a record claiming 10^15
bytes would otherwise become a sparse file of that size), and every file is checked against the sha256 the
record gives, through pipeline/remote/storage.py's retries. A restore that fails leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from pipeline import atomic
from pipeline.remote import Expected, RetryPolicy, fetch
from pipeline.remote.names import UnsafeName, relative_name
from pipeline.train import checkpoint as ckpt
from pipeline.train.remote_lock import RemoteError, client, error_code, log, split_remote


def remote_tags(bucket: str, prefix: str) -> list[str]:
    """Tag folders under PREFIX/checkpoints/ in the bucket, complete or not, newest first (one LIST)."""
    base = f"{prefix}/checkpoints/" if prefix else "checkpoints/"
    found = []
    for page in client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base, Delimiter="/"):
        for p in page.get("CommonPrefixes", []):
            name = p["Prefix"][len(base):].strip("/")
            if ckpt.is_tag(name):  # anything else under checkpoints/ is not ours to restore or prune
                found.append(name)
    return sorted(found, key=ckpt.tag_step, reverse=True)


def _remote_record(bucket: str, key: str) -> dict[str, Any] | None:
    from botocore.exceptions import ClientError

    try:
        record = json.loads(client().get_object(Bucket=bucket, Key=key)["Body"].read())
    except ClientError as e:
        if error_code(e) in ("NoSuchKey", "404"):
            return None
        raise
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("files"), dict) else None


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


def check_sizes(bucket: str, base: str, files: dict[str, int], source: str) -> None:
    """Every file complete.json names is an object of the size it claims (one LIST of the tag): RemoteError
    naming the file otherwise, before anything is allocated. A claim is data: only the store's own size is
    a fact, and a download is never given room beyond it."""
    real: dict[str, int] = {}
    for page in client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base):
        for obj in page.get("Contents", []):
            real[obj["Key"][len(base):]] = int(obj["Size"])
    for name, size in files.items():
        if name not in real:
            raise RemoteError(f"{source}: it names {name!r}, which the bucket does not hold "
                              f"(s3://{bucket}/{base}{name}); nothing was restored")
        if real[name] != size:
            raise RemoteError(f"{source}: it says {name!r} is {size} bytes, the object s3://{bucket}/{base}{name} "
                              f"is {real[name]}; nothing was restored")


def restore(remote: str, run_dir: Path, policy: RetryPolicy | None = None) -> str | None:
    """Download the bucket's newest complete tag into RUN_DIR/checkpoints when the run directory has no
    complete tag at least as new (and config.yaml, metrics.jsonl when missing); the tag restored, or None."""
    bucket, prefix = split_remote(remote)
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
        source = f"{remote}/checkpoints/{tag}/{ckpt.COMPLETE_FILE}"
        files, digests = checked_record(record, source)
        check_sizes(bucket, base, files, source)
        _download_tag(bucket, base, tag, files, digests, run_dir, policy)
        _run_files(bucket, prefix, run_dir, policy)
        log(f"restored {tag} from {remote} into {ckpt.checkpoint_dir(run_dir) / tag}")
        return tag
    return None


def _download_tag(bucket: str, base: str, tag: str, files: dict[str, int], digests: dict[str, str],
                  run_dir: Path, policy: RetryPolicy | None) -> None:
    """The tag's files into a hidden folder, renamed into place whole (a killed restore leaves no tag); a
    failed one takes away what it made (the folder, and checkpoints/ when it created it)."""
    folder = ckpt.checkpoint_dir(run_dir)
    made = not folder.exists()
    tag_dir = folder / tag
    partial = tag_dir.with_name(f".{tag}.restoring")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        for name, size in files.items():
            out = partial / name  # a checked name: inside the tag's folder
            out.parent.mkdir(parents=True, exist_ok=True)
            fetch(f"s3://{bucket}/{base}{name}", out, Expected(size, digests.get(name)), policy)
        atomic.write_text(partial / ckpt.COMPLETE_FILE, json.dumps({"tag": tag, "files": files}))
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        if made:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    shutil.rmtree(tag_dir, ignore_errors=True)  # an incomplete local tag of that name
    os.replace(partial, tag_dir)
    atomic.fsync_dir(tag_dir.parent)


def _run_files(bucket: str, prefix: str, run_dir: Path, policy: RetryPolicy | None) -> None:
    for name in ("config.yaml", "metrics.jsonl"):
        if not (run_dir / name).exists():
            try:
                fetch(f"s3://{bucket}/{prefix + '/' if prefix else ''}{name}", run_dir / f".{name}.restoring",
                      Expected(), policy)
                os.replace(run_dir / f".{name}.restoring", run_dir / name)
            except Exception:  # noqa: BLE001 - uploaded at the end of a run only: often not there yet
                (run_dir / f".{name}.restoring").unlink(missing_ok=True)
