"""Remote storage, the bottom layer under data/ (shards, dataset.json) and train/mirror.py (runs in a bucket):
whole objects over http(s) and s3, fetched by byte ranges, retried, and checked against a size and digest.

    retry.py    the fault classes (Transient, Permanent), RetryPolicy, StorageError
    http.py     one ranged GET over http(s) (urllib3)
    s3.py       one ranged GET, a HEAD, a PUT over s3:// (boto3, imported on first use)
    storage.py  fetch (ranges, retries, the digest check), read_bytes, file_sha256

Nothing here knows what the bytes are: a network fault is a StorageError, never a bad sample.
"""

from pipeline.remote.http import TRANSIENT_STATUS
from pipeline.remote.retry import Permanent, RetryPolicy, StorageError, Transient
from pipeline.remote.storage import Expected, fetch, file_sha256, read_bytes

__all__ = ["TRANSIENT_STATUS", "Expected", "Permanent", "RetryPolicy", "StorageError", "Transient", "fetch",
           "file_sha256", "read_bytes"]
