"""`s3://bucket/key` objects through boto3: ranged GETs for storage.fetch, whole-object PUTs for make_shards
and the run mirror (pipeline/train/mirror.py).

Credentials and endpoint come from boto3's standard chain: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
(and AWS_SESSION_TOKEN), AWS_PROFILE with ~/.aws/config and ~/.aws/credentials, then instance or pod
roles; AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL point it at an S3-compatible store (MinIO, Ceph, R2,
SeaweedFS, GCS's interoperability endpoint). Nothing here LISTs a bucket: a shard is one GET per range.

Reads turn off botocore's own retries: storage.py retries every scheme alike (backoff with jitter, a
range resumed from the missing byte, one log line per retry, a bound in count and time).
"""

from __future__ import annotations

import os
from typing import Any

from pipeline.remote.http import Body, content_range_total
from pipeline.remote.retry import Permanent, RetryPolicy, Transient, cause

READ_CHUNK = 256 << 10  # a stalled read loses at most this much (StreamingBody.read fills its whole amount)
THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "RequestTimeout",
             "InternalError", "ServiceUnavailable", "RequestThrottled", "TooManyRequests"}

_clients: dict[tuple[int, str, float, int], Any] = {}  # per process (a client is not fork-safe) and purpose


def split_url(url: str) -> tuple[str, str]:
    """'s3://bucket/a/b.tar' -> ('bucket', 'a/b.tar')."""
    rest = url.split("://", 1)[1]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"'{url}' names no bucket (expected s3://BUCKET/KEY)")
    return bucket, key


def client(purpose: str = "read", timeout_s: float = 60.0, attempts: int = 10) -> Any:
    """A boto3 S3 client of this process. 'read': no retries of its own (storage.py retries); 'write':
    botocore's standard retries (make_shards' uploads)."""
    key = (os.getpid(), purpose, timeout_s, attempts)
    c = _clients.get(key)
    if c is None:
        try:
            import boto3
        except ImportError:
            raise Permanent("s3:// needs boto3: pip install 'vit-pipeline[s3]'") from None
        c = _clients[key] = boto3.session.Session().client("s3", config=client_config(purpose, timeout_s, attempts))
    return c


def client_config(purpose: str = "read", timeout_s: float = 60.0, attempts: int = 10) -> Any:
    """The botocore Config of `client(purpose, ...)`: a test's client against its own endpoint takes this one, so
    botocore retries there exactly what it retries here (a 'read' client: nothing, not even a RequestTimeout)."""
    from botocore.config import Config

    retries = {"total_max_attempts": 1} if purpose == "read" else {"mode": "standard", "total_max_attempts": attempts}
    return Config(retries=retries, connect_timeout=timeout_s, read_timeout=timeout_s, max_pool_connections=32)


def _status(e: Any) -> tuple[int, str]:
    response = getattr(e, "response", {}) or {}
    return (int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0),
            str(response.get("Error", {}).get("Code") or type(e).__name__))


def classify(e: BaseException) -> Exception:
    """A boto3/botocore/urllib3 error -> Transient or Permanent."""
    from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

    if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
        return Permanent(f"{e} (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or a role)")
    if isinstance(e, ClientError):
        status, code = _status(e)
        text = f"HTTP {status} {code}" if status else code
        if status >= 500 or status in (408, 429) or code in THROTTLED:
            return Transient(text)
        return Permanent(text)
    return Transient(cause(e))  # connection refused or reset, a body cut short, a read timeout


def refusal(e: BaseException) -> str | None:
    """'HTTP 403 AccessDenied' when `e`, or the error it wraps (boto3's S3UploadFailedError wraps the
    ClientError of a PutObject), is an answer of the store that no retry changes (Permanent); None for a
    fault worth another attempt. A bucket policy that denies DeleteObject, a write-once bucket, a missing
    bucket or wrong credentials answer the same every time: retrying them only delays the line that says so."""
    # By type: botocore raises its modeled subclasses of ClientError (AccessDenied, NoSuchKey, ...) for the codes
    # the service model names, so a name check misses the very answer (a 403 AccessDenied) it exists for.
    from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (ClientError, NoCredentialsError, PartialCredentialsError)):
            verdict = classify(e)
            return verdict.status if isinstance(verdict, Permanent) else None
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return None


def s3_open(url: str, start: int, end: int | None, policy: RetryPolicy) -> tuple[int | None, Body]:
    from botocore.exceptions import BotoCoreError, ClientError
    from urllib3.exceptions import HTTPError

    bucket, key = split_url(url)
    kwargs = {"Bucket": bucket, "Key": key}
    if start or end is not None:
        kwargs["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
    try:
        response = client("read", policy.timeout_s).get_object(**kwargs)
    except (BotoCoreError, ClientError, HTTPError, OSError) as e:
        raise classify(e) from None
    total = content_range_total(response.get("ContentRange"))
    if total is None and "Range" not in kwargs:
        total = response.get("ContentLength")
    stream = response["Body"]

    def body() -> Body:
        try:
            # StreamingBody raises IncompleteReadError when the body is shorter than its Content-Length.
            while chunk := stream.read(READ_CHUNK):
                yield chunk
        except (BotoCoreError, HTTPError, OSError) as e:
            raise classify(e) from None
        finally:
            stream.close()

    return total, body()


def exists(url: str) -> bool:
    """Does the object exist (one HEAD)? Permanent for a denied or failing request."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = split_url(url)
    try:
        client("write").head_object(Bucket=bucket, Key=key)
        return True
    except ClientError as e:
        if _status(e)[0] == 404:
            return False
        raise Permanent(f"HEAD {url}: {_status(e)}") from None
    except BotoCoreError as e:
        raise Permanent(f"HEAD {url}: {cause(e)}") from None


def upload(path: str, url: str) -> None:
    """Put the local file at `url`: visible under its key only once complete (S3 PUTs and multipart
    uploads are atomic), so a reader never sees half a shard. Retried by botocore (standard mode)."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = split_url(url)
    try:
        client("write").upload_file(path, bucket, key)
    except (BotoCoreError, ClientError) as e:
        status, code = _status(e)
        raise Permanent(f"PUT {url}: {f'HTTP {status} {code}' if status else cause(e)}") from None
