"""What a shard folder holds: `dataset.json` (ours) or timm's `_info.json`, checked against the shards.

    info = read_dataset_info("data/digits")
    info.num_classes, info.class_names, info.splits["train"].shards, info.splits["train"].shard_counts

Every problem a user can cause (no dataset.json, a split that lists a shard that is not
there, a shard rewritten since dataset.json was written) is a `DataError` with one line
naming the file and what was expected, raised before any training starts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import atomic
from pipeline.remote import Expected, RetryPolicy, StorageError, storage
from pipeline.remote.names import UnsafeName, relative_name

from .bad import DataError

DATASET_JSON = "dataset.json"
TIMM_INFO_JSON = "_info.json"
FORMAT_NAME = "vit-pipeline-shards"
FORMAT_VERSION = 1


@dataclass
class SplitInfo:
    num_samples: int
    """Samples in the split (sum of shard_counts)."""
    shards: list[str]
    """Shard locations: absolute local paths, or URLs / 'pipe:' commands as written in the json."""
    shard_counts: list[int] = field(default_factory=list)
    """Samples per shard, in the order of `shards`."""
    shard_bytes: list[int | None] = field(default_factory=list)
    """Size of each shard file when dataset.json was written (None where unknown)."""
    shard_sha256: list[str | None] = field(default_factory=list)
    """Digest of each shard's bytes recorded by make_shards (None where unknown: remote shards indexed by others)."""


def expected_of(split: Any) -> dict[str, Expected]:
    """Shard -> what dataset.json says of it (size, sha256; what a remote copy is checked against), for a
    SplitInfo or anything with its shards, shard_bytes and shard_sha256 lists (the train stream)."""
    n = len(split.shards)
    sizes = list(split.shard_bytes or []) + [None] * n
    digests = list(split.shard_sha256 or []) + [None] * n
    return {s: Expected(sizes[i], digests[i]) for i, s in enumerate(split.shards)}


@dataclass
class DatasetInfo:
    num_classes: int
    class_names: list[str]
    splits: dict[str, SplitInfo]
    image_format: str = "jpg"
    label_key: str = "cls"
    """Where the shards keep the label (see DataConfig.label_key); written by make_shards."""
    path: str = ""
    """The folder (or json file) this was read from."""
    mixture: Any = None
    """With data.sources: the mixture (pipeline.data.mix.Mixture) this merged description stands for."""
    pixels: dict[str, Any] = field(default_factory=dict)
    """dataset.json's `channels`, `dtype`, `channel_names`, `mean`, `std` (docs/data.md); empty: 8-bit RGB."""

    def split(self, name: str) -> SplitInfo:
        if name not in self.splits:
            raise DataError(f"{self.path}: no split '{name}'; the data set has: {', '.join(sorted(self.splits))}")
        return self.splits[name]


# URL schemes of shard names the loaders read (cache.hold_copy through storage.fetch); see scheme_readable.
READABLE_SCHEMES = ("http", "https", "s3")
PIPE_SWITCH = "data.allow_pipe_shards=true"


def is_remote(location: str) -> bool:
    return "://" in location or location.startswith("pipe:")


def shard_scheme(location: str) -> str:
    """'' for a local path, 'pipe' for a `pipe:` command, else the URL's scheme ('https', 's3')."""
    if location.startswith("pipe:"):
        return "pipe"
    scheme, sep, _ = location.partition("://")
    return scheme.lower() if sep else ""


def scheme_readable(scheme: str) -> bool:
    """Can the loaders read shards named with this scheme ('' a local path; `pipe` aside: it is a switch)?
    The one place a new reader (s3) says it is there."""
    return scheme == "" or scheme in READABLE_SCHEMES


def pipes_allowed(allow_pipe_shards: bool) -> bool:
    """`pipe:` shard names run only where the operator said so; webdataset's own switch (WDS_SECURE=1,
    its `enforce_security`) refuses them whatever the config says."""
    from webdataset import utils as wds_utils

    return allow_pipe_shards and not wds_utils.enforce_security


def check_shard_names(info: DatasetInfo, allow_pipe_shards: bool) -> None:
    """Every shard name is one we can read, before anything runs: a `pipe:` command (a shell command
    written by whoever wrote the json) only with the opt-in, a URL only of a READABLE_SCHEMES scheme.
    DataError naming the json, the shard and the switch otherwise."""
    where = info.path if info.path.endswith(".json") else os.path.join(info.path, DATASET_JSON)
    for split_name, split in info.splits.items():
        for shard in split.shards:
            scheme = shard_scheme(shard)
            if scheme == "pipe" and not pipes_allowed(allow_pipe_shards):
                why = ("WDS_SECURE=1 is set (webdataset's switch that refuses them)" if allow_pipe_shards
                       else f"shell commands in a data set run only with {PIPE_SWITCH}, if you trust its author")
                raise DataError(f"{where}: split '{split_name}' names shard '{shard[:200]}', a shell command; "
                                f"not run: {why}")
            if scheme != "pipe" and not scheme_readable(scheme):
                raise DataError(f"{where}: split '{split_name}' names shard '{shard[:200]}': scheme '{scheme}://' "
                                f"is not one this pipeline reads (local paths, "
                                f"{', '.join(s + '://' for s in READABLE_SCHEMES)}); copy the shards to one of them")


def is_url(location: str) -> bool:
    """A remote folder or object whose dataset.json the loaders read (http(s)://, s3://)."""
    return shard_scheme(location) in READABLE_SCHEMES


def resolve_shard(folder: Path | str, name: str, where: str = "") -> str:
    """A shard name from a json file -> where to open it. A relative name is relative to the json's folder (a
    local one or a URL prefix such as s3://bucket/data) and stays inside it: no '..', no empty parts, no
    backslashes (pipeline/remote/names.py). An absolute local path only from a local json (make_shards writes
    one for a shard outside the json's folder): a json read from a URL names shards under its prefix or by
    URL, never a file of this machine. DataError naming `where` (the json) otherwise."""
    if is_remote(name):
        return name  # a URL or a pipe: (check_shard_names decides on its scheme)
    remote_json = isinstance(folder, str) and is_url(folder)
    if name.startswith("/"):
        if remote_json:
            raise DataError(f"{where}: shard '{name[:200]}' is a path on this machine; a data set read from a URL "
                            f"names its shards relative to its prefix, or by URL")
        return name
    try:
        relative_name(name, where)
    except UnsafeName as e:
        raise DataError(f"{e}{'' if remote_json else ' (name a shard outside the folder by its absolute path)'}"
                        ) from None
    if remote_json:
        return folder.rstrip("/") + "/" + name
    return str(Path(folder) / name)


def _load_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read '{path}': {e}") from None
    except json.JSONDecodeError as e:
        raise DataError(f"'{path}' is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise DataError(f"'{path}' must hold a JSON object")
    return data


def read_dataset_info(path: str | os.PathLike[str], check_files: bool = True, policy: RetryPolicy | None = None
                      ) -> DatasetInfo:
    """Read and check `PATH/dataset.json` (or timm's `PATH/_info.json`); `path` may also name the json file,
    and be a URL (s3://bucket/prefix, https://host/prefix): its dataset.json is read the same way, retried
    by `policy` (a run passes its data.retry_* settings: `dataset_info_of`; None: RetryPolicy's defaults)."""
    if isinstance(path, str) and is_url(path):
        return _read_remote_info(path, policy)
    path = Path(path)
    if path.is_file():
        folder, candidates = path.parent, [path]
    else:
        if not path.is_dir():
            raise DataError(f"data folder '{path}' does not exist; write shards there with "
                            f"`python launch/make_shards.py --source digits --out {path}`")
        folder, candidates = path, [path / DATASET_JSON, path / TIMM_INFO_JSON]
    for candidate in candidates:
        if candidate.is_file():
            data = _load_json(candidate)
            if candidate.name == TIMM_INFO_JSON:
                info = _parse_timm_info(data, folder, candidate)
            else:
                info = _parse_dataset_json(data, folder, candidate)
            if check_files:
                check_shards(info, str(candidate))
            return info
    raise DataError(
        f"no {DATASET_JSON} in '{path}': write shards with `python launch/make_shards.py --source folder:IMAGES "
        f"--out {path}`, or describe existing shards with `python launch/make_shards.py "
        f"--source 'shards:{path}/*.tar' --out {path}`")


def dataset_info_of(cfg: Any) -> DatasetInfo:
    """The data set a run's DataConfig names, read with the run's own retry settings (data.retry_*,
    data.read_timeout_s), as its shards are."""
    return read_dataset_info(cfg.path, policy=RetryPolicy.from_config(cfg))


def _read_remote_info(url: str, policy: RetryPolicy | None = None) -> DatasetInfo:
    """dataset.json (or _info.json) under the URL prefix `url`, fetched with pipeline/remote's retries. One GET
    (two for timm's layout): no LIST of the bucket."""
    base = url.rstrip("/")
    if base.endswith(".json"):
        folder, candidates = base.rsplit("/", 1)[0], [base]
    else:
        folder, candidates = base, [f"{base}/{DATASET_JSON}", f"{base}/{TIMM_INFO_JSON}"]
    for candidate in candidates:
        try:
            raw = storage.read_bytes(candidate, policy)
        except StorageError as e:
            if e.status == 404 and candidate != candidates[-1]:
                continue  # no dataset.json: perhaps timm's _info.json
            if e.status == 404:
                raise DataError(f"no {DATASET_JSON} at '{url}' ({e}); write shards there with `python "
                                f"launch/make_shards.py --source ... --out {base}`") from None
            raise DataError(f"cannot read the data set description: {e}") from None
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"'{candidate}' is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise DataError(f"'{candidate}' must hold a JSON object")
        if candidate.endswith(TIMM_INFO_JSON):
            return _parse_timm_info(data, folder, candidate)
        return _parse_dataset_json(data, folder, candidate)
    raise AssertionError("unreachable")


def _require(data: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in data:
        raise DataError(f"{where}: missing key '{key}'")
    if not isinstance(data[key], kind) or isinstance(data[key], bool) and kind is int:
        raise DataError(f"{where}: key '{key}' has the wrong type ({type(data[key]).__name__})")
    return data[key]


def _parse_dataset_json(data: dict[str, Any], folder: Path | str, where_path: Path | str) -> DatasetInfo:
    where = str(where_path)
    class_names = [str(c) for c in _require(data, "class_names", list, where)]
    num_classes = _require(data, "num_classes", int, where)
    if num_classes != len(class_names):
        raise DataError(f"{where}: num_classes is {num_classes} but class_names has {len(class_names)} entries")
    splits_raw = _require(data, "splits", dict, where)
    if not splits_raw:
        raise DataError(f"{where}: 'splits' is empty")
    splits = {}
    for name, raw in splits_raw.items():
        w = f"{where}: split '{name}'"
        if not isinstance(raw, dict):
            raise DataError(f"{w} must be an object")
        shards_raw = _require(raw, "shards", list, w)
        if not shards_raw:
            raise DataError(f"{w} lists no shards")
        shards, counts, sizes, digests = [], [], [], []
        for entry in shards_raw:
            if isinstance(entry, str):  # a bare name: count unknown
                raise DataError(f"{w}: shard entry '{entry}' has no num_samples; re-index with make_shards.py")
            if not isinstance(entry, dict):
                raise DataError(f"{w}: shard entries must be objects with name and num_samples")
            shards.append(resolve_shard(folder, str(_require(entry, "name", str, w)), where))
            counts.append(int(_require(entry, "num_samples", int, w)))
            sizes.append(entry.get("bytes"))
            digests.append(entry.get("sha256"))
        num_samples = _require(raw, "num_samples", int, w)
        if num_samples != sum(counts):
            raise DataError(f"{w}: num_samples is {num_samples} but its shards hold {sum(counts)} "
                            f"(sum of the shards' num_samples)")
        splits[name] = SplitInfo(num_samples, shards, counts, sizes, digests)
    pixels = {k: data[k] for k in ("channels", "dtype", "channel_names", "mean", "std") if k in data}
    return DatasetInfo(num_classes, class_names, splits, str(data.get("image_format", "jpg")),
                       str(data.get("label_key", "cls")), str(folder), pixels=pixels)


def _parse_timm_info(data: dict[str, Any], folder: Path | str, where_path: Path | str) -> DatasetInfo:
    """timm's wds layout: {"splits": {"train": {"num_samples", "filenames", "shard_lengths"}}, ...}."""
    where = str(where_path)
    splits_raw = _require(data, "splits", dict, where)
    splits = {}
    for name, raw in splits_raw.items():
        w = f"{where}: split '{name}'"
        files = list(_require(raw, "filenames", list, w))
        lengths = [int(n) for n in _require(raw, "shard_lengths", list, w)]
        if not files:
            raise DataError(f"{w} lists no shards")
        if len(files) != len(lengths):
            raise DataError(f"{w}: {len(files)} filenames but {len(lengths)} shard_lengths")
        num_samples = int(raw.get("num_samples", sum(lengths)))
        if num_samples != sum(lengths):
            raise DataError(f"{w}: num_samples is {num_samples} but shard_lengths sum to {sum(lengths)}")
        splits[name] = SplitInfo(num_samples, [resolve_shard(folder, str(f), where) for f in files], lengths,
                                 [None] * len(files))
    num_classes = data.get("num_classes")
    if num_classes is None:
        features = data.get("features", {})
        num_classes = features.get("label", {}).get("num_classes") if isinstance(features, dict) else None
    if not isinstance(num_classes, int) or num_classes < 1:
        raise DataError(f"{where}: no 'num_classes'; add it, or set model.num_classes and index the shards "
                        f"with `python launch/make_shards.py --source 'shards:{folder}/*.tar' --out {folder}`")
    class_names = [str(c) for c in data.get("class_names", range(num_classes))]
    if len(class_names) != num_classes:
        raise DataError(f"{where}: num_classes is {num_classes} but class_names has {len(class_names)} entries")
    return DatasetInfo(num_classes, class_names, splits, "jpg", "cls", str(folder))


def check_shards(info: DatasetInfo, where: str) -> None:
    """Every local shard exists and has the size recorded when the json was written."""
    for split_name, split in info.splits.items():
        for shard, size in zip(split.shards, split.shard_bytes or [None] * len(split.shards)):
            if is_remote(shard):
                continue
            try:
                actual = os.stat(shard).st_size
            except FileNotFoundError:
                raise DataError(f"{where}: split '{split_name}' lists shard '{shard}', which does not exist") from None
            except OSError as e:
                raise DataError(f"{where}: cannot stat shard '{shard}': {e}") from None
            if size is not None and actual != size:
                raise DataError(f"{where}: shard '{shard}' is {actual} bytes but the json says {size}: "
                                f"it was rewritten or truncated since; write the shards again")


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write, fsync, rename (`pipeline.atomic`): a crash leaves the old file or none, never half a file."""
    atomic.write_text(path, json.dumps(data, indent=1) + "\n")
