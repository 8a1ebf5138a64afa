"""Where a data set may send the job: a dataset.json names its shards, and whoever wrote it (a data set
downloaded from someone else, a shared bucket others can write) must not be able to make the job fetch from
anywhere else than where the data set is. Followed as written, a shard named `http://169.254.169.254/...`
reads the cloud's metadata endpoint (credentials), `http://10.0.0.7:8500/...` a service on the cluster
network, `s3://other-team/...` another team's bucket with the job's own credentials.

The rule (`check_origins`): a shard resolves under its data set's own location, or is refused in one line:

    dataset.json at                    its shards may be
    s3://BUCKET/PREFIX                 s3://BUCKET/PREFIX/...        (the same bucket and prefix)
    http(s)://HOST[:PORT]/PATH         http(s)://HOST[:PORT]/...     (the same origin)
    a local folder                     local paths                   (relative ones inside the folder: info.py)

unless the run config names the other place in `data.allowed_origins`: an origin (`https://cdn.example.org`,
`s3://shared-bucket`) or a prefix under one (`s3://shared-bucket/datasets`), matched part by part, never as a
string prefix (`s3://shared` does not allow `s3://shared-bucket`). A local json naming URLs is the same case:
its URLs are somewhere else than its folder.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

from .bad import DataError
from .info import DATASET_JSON, is_url, shard_scheme

DEFAULT_PORTS = {"http": 80, "https": 443}
SWITCH = "data.allowed_origins"


def origin(url: str) -> str:
    """'HTTPS://Host:443/a/b' -> 'https://host'; 's3://bucket/a' -> 's3://bucket' (the user part, a default port
    and letter case are not part of where a request goes)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "s3":
        return f"s3://{parts.netloc}"
    port = parts.port
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"  # an IPv6 literal
    return f"{scheme}://{host}" + (f":{port}" if port and port != DEFAULT_PORTS.get(scheme) else "")


def _parts(url: str) -> tuple[str, list[str]]:
    """(origin, path parts without empty ones): what `within` compares."""
    return origin(url), [p for p in urlsplit(url).path.split("/") if p]


def within(url: str, base: str) -> bool:
    """Is `url` at or under `base` (an origin, or a prefix under one), part by part?"""
    (o, parts), (base_o, base_parts) = _parts(url), _parts(base)
    return o == base_o and parts[:len(base_parts)] == base_parts and ".." not in parts


def home(location: str) -> str | None:
    """Where a data set's own shards may be: its bucket and prefix for s3://, its origin for http(s)://, None
    for a local json (no URL is its own)."""
    if not is_url(location):
        return None
    folder = location.rstrip("/")
    if folder.endswith(".json"):
        folder = folder.rsplit("/", 1)[0]
    return folder if shard_scheme(folder) == "s3" else origin(folder)


def check_origins(info: Any, allowed: list[str] | tuple[str, ...]) -> None:
    """Every URL shard of `info` (each source's, for a mixture) under its data set's own location or an
    allowed one; DataError naming the json, the shard and the switch otherwise."""
    mixture = getattr(info, "mixture", None)
    for one in ([s.info for s in mixture.sources] if mixture is not None else [info]):
        own = home(one.path)
        where = one.path if one.path.endswith(".json") else os.path.join(one.path, DATASET_JSON)
        for split_name, split in one.splits.items():
            for shard in split.shards:
                if not is_url(shard) or (own is not None and within(shard, own)):
                    continue
                if any(within(shard, base) for base in allowed):
                    continue
                mine = f"its own shards are under {own}" if own else "it is a local file: its shards are local"
                raise DataError(f"{where}: split '{split_name}' names shard '{shard[:200]}' at {origin(shard)}, "
                                f"outside the data set's location ({mine}); not fetched: a data set cannot send the "
                                f"job to another host or bucket. If you trust it, add '{origin(shard)}' to {SWITCH}")
