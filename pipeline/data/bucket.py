"""Shards in a bucket, for the writer (shards.py): writing under an s3:// prefix (`make_shards --out
s3://...`) and reading a remote shard once to index it (`make_shards --source shards:URL`). The transport is
pipeline/remote/."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pipeline.remote import StorageError, fetch, s3

from .bad import DataError
from .index import INDEX_SUFFIX
from .info import DATASET_JSON, is_url, shard_scheme


class BucketOut:
    """make_shards --out s3://bucket/prefix: a local staging folder, and uploads from it. A shard is visible
    under its key only once whole (a PUT is atomic); dataset.json goes up last, so no dataset.json in the
    bucket ever names a shard not yet there. Nothing LISTs or deletes in the bucket."""

    def __init__(self, url: str, overwrite: bool):
        if shard_scheme(url) != "s3":
            raise DataError(f"--out {url}: only s3:// prefixes are written to (http(s) is read-only)")
        self.url = url.rstrip("/")
        self.overwrite = overwrite

    def __enter__(self) -> BucketOut:
        try:
            if not self.overwrite and s3.exists(f"{self.url}/{DATASET_JSON}"):
                raise DataError(f"'{self.url}' already holds a {DATASET_JSON}; pass --overwrite to replace it")
        except s3.Permanent as e:
            raise DataError(f"cannot write to '{self.url}': {e}") from None
        self.staging = Path(tempfile.mkdtemp(prefix="vit-pipeline-upload-"))
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

    def upload(self, path: Path) -> None:
        """Put a staged file under the prefix, then drop the local copy (and its local index)."""
        try:
            s3.upload(str(path), f"{self.url}/{path.name}")
        except s3.Permanent as e:
            raise DataError(str(e)) from None
        path.unlink()
        Path(str(path) + INDEX_SUFFIX).unlink(missing_ok=True)  # readers index their cached copy


@contextlib.contextmanager
def readable_copy(shard: str) -> Iterator[str]:
    """A local file holding the shard: itself, or for an http(s)/s3 URL a copy fetched once with retries
    (pipeline/remote/storage.py) into a temporary file, removed after. `pipe:` names are streamed as before."""
    if not is_url(shard):
        yield shard
        return
    fd, name = tempfile.mkstemp(prefix="vit-pipeline-index-", suffix=".tar")
    os.close(fd)
    try:
        try:
            fetch(shard, Path(name))
        except StorageError as e:
            raise DataError(str(e)) from None
        yield name
    finally:
        os.unlink(name)
