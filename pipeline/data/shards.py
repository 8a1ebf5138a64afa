"""Write WebDataset shards: `train-000000.tar` of `KEY.jpg|png` + `KEY.cls` (+ `KEY.src`, the file a folder's
sample came from), and a `dataset.json`.

Sources (sources.py; see `launch/make_shards.py`):

    folder:PATH   an ImageFolder tree (PATH/CLASS/*.jpg, or PATH/train/... and PATH/val/...)
    digits        scikit-learn's bundled 1,797 handwritten 8x8 digits, upscaled, PNG (the demo data)
    synthetic     generated, learnable images of any size and class count, JPEG (tests, benchmarks)
    shards:GLOB   shards written by others (img2dataset, timm): indexed in place, nothing copied

Each shard gets its sample index beside it (`train-000000.tar.idx`, index.py): readers never
scan its tar headers. Every shard is written through pipeline/atomic.py's `atomic_path` (a hidden temporary
name, fsynced, renamed, the folder fsynced), and `dataset.json` is written the same way last: a crash leaves no half shard under a shard's name and no
dataset.json describing shards that are not all there.
"""

from __future__ import annotations

import glob
import io
import os
import tarfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.atomic import atomic_path, fsync_dir
from pipeline.remote import file_sha256

from . import pixels, tario
from .bad import DataError
from .bucket import BucketOut, readable_copy
from .index import INDEX_SUFFIX, SampleMembers, encode_index, write_index
from .info import (
    DATASET_JSON,
    FORMAT_NAME,
    FORMAT_VERSION,
    is_remote,
    is_url,
    shard_scheme,
    write_json_atomic,
)
from .sources import (  # noqa: F401 (re-exported: the writers' inputs)
    FOLDER_IMAGE_EXTS,
    Item,
    Source,
    digits_source,
    folder_source,
    keep_train_fraction,
    stratified_split,
    synthetic_image,
    synthetic_source,
)

# ----------------------------------------------------------------------------- writing


@dataclass
class ShardRecord:
    name: str
    num_samples: int
    bytes: int
    sha256: str
    """Digest of the shard's bytes: the data state's fingerprint covers it (a rewritten shard is refused on resume)."""


class ShardWriter:
    """Writes `{prefix}-000000.tar`, `{prefix}-000001.tar`, ... with at most `max_samples` samples
    and (roughly) `max_bytes` bytes each; each shard appears under its name only when complete."""

    def __init__(self, out_dir: str | Path, prefix: str, max_samples: int = 1000, max_bytes: int | None = None,
                 on_shard: Callable[[Path], None] | None = None):
        if max_samples < 1:
            raise DataError(f"max samples per shard must be >= 1, got {max_samples}")
        self.out_dir = Path(out_dir)
        self.prefix = prefix
        self.on_shard = on_shard  # called with each complete shard's path (make_shards --out s3://: upload it)
        self.max_samples = max_samples
        self.max_bytes = max_bytes
        self.records: list[ShardRecord] = []
        self._file: Any = None
        self._tar: tarfile.TarFile | None = None
        self._tmp: Path | None = None
        self._atomic: Any = None  # atomic_path(final) of the shard being written, entered by hand (see _open)
        self._count = 0
        self._bytes = 0
        self._samples: list[SampleMembers] = []  # the index of the shard being written

    def _name(self) -> str:
        return f"{self.prefix}-{len(self.records):06d}.tar"

    def _open(self) -> None:
        # A shard is written over many write() calls, not in one block: the context is entered here, left in
        # _finish (fsync, rename, folder fsync) or, with the error, in abort (the temporary file removed).
        self._atomic = atomic_path(self.out_dir / self._name())
        self._tmp = self._atomic.__enter__()
        self._file = open(self._tmp, "wb")  # noqa: SIM115 (closed in _finish)
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.USTAR_FORMAT)
        self._count = 0
        self._bytes = 0
        self._samples = []

    def _finish(self) -> None:
        assert self._tar is not None and self._tmp is not None
        self._tar.close()
        self._file.close()
        name = self._name()
        final = self.out_dir / name
        size = self._tmp.stat().st_size
        # The index first: a shard under its name always has its index (a crash leaves at most an index).
        write_index(str(final) + INDEX_SUFFIX, encode_index(self._samples, size))
        atomic, self._atomic = self._atomic, None
        atomic.__exit__(None, None, None)  # fsync, rename to `final`, fsync the folder
        self.records.append(ShardRecord(name, self._count, size, file_sha256(final)))  # just written: page cache
        self._tar = self._file = self._tmp = None
        if self.on_shard is not None:
            self.on_shard(final)

    def write(self, key: str, members: dict[str, bytes]) -> None:
        """One sample: {'jpg': bytes, 'cls': b'3'} -> KEY.jpg, KEY.cls (in that order)."""
        size = sum(_round_block(len(v)) + tarfile.BLOCKSIZE for v in members.values())
        if self._tar is not None and (
                self._count >= self.max_samples
                or (self.max_bytes is not None and self._bytes + size > self.max_bytes)):
            self._finish()
        if self._tar is None:
            self._open()
        assert self._tar is not None
        sample = SampleMembers(key, {})
        for ext, data in members.items():
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size = len(data)
            info.mode = 0o644
            info.mtime = 0  # the same input gives byte-identical shards
            self._tar.addfile(info, io.BytesIO(data))
            # addfile leaves the offset past the data's padding: the data starts one padded size before.
            sample.members[ext] = (self._tar.offset - _round_block(len(data)), len(data))
        self._samples.append(sample)
        self._count += 1
        self._bytes += size

    def close(self) -> list[ShardRecord]:
        if self._tar is not None:
            self._finish()
        fsync_dir(self.out_dir)
        return self.records

    def abort(self) -> None:
        """Drop the shard being written (on an error); completed shards stay."""
        if self._tar is not None:
            try:
                self._file.close()
            finally:
                atomic, self._atomic = self._atomic, None
                if atomic is not None:
                    stop = DataError("shard writing aborted")
                    atomic.__exit__(DataError, stop, None)  # removes the temporary file; returns False
            self._tar = self._file = self._tmp = None


def _round_block(n: int) -> int:
    return (n + tarfile.BLOCKSIZE - 1) // tarfile.BLOCKSIZE * tarfile.BLOCKSIZE


# ----------------------------------------------------------------------------- write a data set


@dataclass
class WriteSummary:
    samples: int
    shards: int
    bytes: int
    seconds: float
    skipped: int

    def line(self, out_dir: str | Path) -> str:
        rate = self.samples / self.seconds if self.seconds > 0 else 0.0
        skipped = f", skipped {self.skipped} unreadable" if self.skipped else ""
        return (f"wrote {self.samples} samples in {self.shards} shards ({self.bytes / 1e6:.1f} MB) to {out_dir} "
                f"in {self.seconds:.1f} s ({rate:.0f} samples/s{skipped})")


def _encode_safe(encode: Callable[[Item], tuple[Any, ...]], item: Item
                 ) -> tuple[str, bytes, pixels.SampleInfo] | str:
    """(ext, bytes, what the pixels are) or the reason the item is skipped; a jpg/png member is 8-bit RGB."""
    try:
        ext, data, *info = encode(item)
        return ext, data, info[0] if info else pixels.RGB8
    except tario.SampleError as e:
        return str(e)
    except OSError as e:
        return f"{item.ref}: {e}"


class _Encode:
    def __init__(self, encode: Callable[[Item], tuple[Any, ...]]):
        self.encode = encode

    def __call__(self, item: Item) -> tuple[str, bytes, pixels.SampleInfo] | str:
        return _encode_safe(self.encode, item)


_worker_encode: _Encode | None = None
"""In a --workers process only: the source's encoder, sent once when the process starts (`_start_worker`)."""


def _start_worker(encode: Callable[[Item], tuple[Any, ...]]) -> None:
    global _worker_encode
    _worker_encode = _Encode(encode)


def _encode_in_worker(item: Item) -> tuple[str, bytes, pixels.SampleInfo] | str:
    assert _worker_encode is not None, "a make_shards worker started without its encoder"
    return _worker_encode(item)


def _encoded(source: Source, items: list[Item], workers: int
             ) -> Iterator[tuple[str, bytes, pixels.SampleInfo] | str]:
    if workers <= 1:
        yield from map(_Encode(source.encode), items)
        return
    import multiprocessing as mp
    # forkserver, not fork: a fork copies this process's other threads' held locks into the child, which then
    # waits on one for good (pipeline/signals.py, worker_context). The encoder goes to each worker once
    # (initargs), not with every chunk: an in-memory source (IDX's arrays) is tens of MB.
    with mp.get_context("forkserver").Pool(workers, initializer=_start_worker, initargs=(source.encode,)) as pool:
        yield from pool.imap(_encode_in_worker, items, chunksize=16)  # ordered: the output does not depend on --workers


def prepare_out_dir(out_dir: Path, overwrite: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    ours = [p for p in out_dir.iterdir() if p.name == DATASET_JSON or
            (p.name.endswith((".tar", ".tar" + INDEX_SUFFIX)) and p.name.split("-")[0] in ("train", "val", "test"))]
    if ours and not overwrite:
        raise DataError(f"'{out_dir}' already holds shards or a {DATASET_JSON}; pass --overwrite to replace them")
    # dataset.json goes first: an interrupted rewrite must not leave it describing old shards.
    for p in sorted(ours, key=lambda p: p.name != DATASET_JSON):
        p.unlink()
    for p in out_dir.glob(".*.tmp"):  # a killed writer's temporary files (atomic_path's names)
        p.unlink()


def write_dataset(source: Source, out_dir: str | Path, max_samples_per_shard: int = 1000,
                  max_bytes_per_shard: int | None = None, seed: int = 0, workers: int = 1,
                  overwrite: bool = False, progress: bool = True, log: Callable[[str], None] = print
                  ) -> WriteSummary:
    """Shuffle each split (seeded: shards are not sorted by class), write shards, then dataset.json.
    `out_dir` may be s3://bucket/prefix: each shard is uploaded as soon as it is complete (from a local
    staging folder that holds one shard at a time), dataset.json last."""
    if is_url(str(out_dir)):
        with BucketOut(str(out_dir), overwrite) as bucket:
            return _write_dataset(source, bucket.staging, max_samples_per_shard, max_bytes_per_shard, seed,
                                  workers, True, progress, log, bucket)
    return _write_dataset(source, Path(out_dir), max_samples_per_shard, max_bytes_per_shard, seed, workers,
                          overwrite, progress, log, None)


def _write_dataset(source: Source, out: Path, max_samples_per_shard: int, max_bytes_per_shard: int | None,
                   seed: int, workers: int, overwrite: bool, progress: bool, log: Callable[[str], None],
                   bucket: BucketOut | None) -> WriteSummary:
    from tqdm import tqdm

    shown = bucket.url if bucket is not None else out
    prepare_out_dir(out, overwrite)
    t0 = time.perf_counter()
    total = sum(len(v) for v in source.splits.values())
    splits_json: dict[str, Any] = {}
    skipped = 0
    formats: set[str] = set()
    summary_px = pixels.PixelSummary()  # channels, dtype, names; statistics of the train split
    with tqdm(total=total, unit="img", desc=f"shards -> {shown}", disable=not progress, dynamic_ncols=True) as bar:
        for split, items in source.splits.items():
            order = np.random.default_rng([seed, zlib.crc32(split.encode())]).permutation(len(items))
            items = [items[i] for i in order]
            writer = ShardWriter(out, split, max_samples_per_shard, max_bytes_per_shard,
                                 bucket.upload if bucket is not None else None)
            n = 0
            try:
                for item, result in zip(items, _encoded(source, items, workers)):
                    bar.update(1)
                    if isinstance(result, str):
                        skipped += 1
                        bar.write(f"skipped: {result}")
                        continue
                    ext, data, info = result
                    formats.add(ext)
                    where = source.name_of(item) if source.name_of is not None else f"{split} sample {n}"
                    summary_px.add(info, where, with_stats=split == "train")
                    # A label-free source (label -1) writes the image alone: MAE needs no label.
                    label = {"cls": str(item.label).encode()} if item.label >= 0 else {}
                    # The file it came from, relative to the folder (KEY.src, UTF-8): readers that do not
                    # know the member pass it over; tario.source_name reads it back.
                    name = {tario.SOURCE_MEMBER: source.name_of(item).encode()} if source.name_of is not None else {}
                    writer.write(f"{n:06d}", {ext: data, **label, **name})
                    n += 1
            except BaseException:
                writer.abort()
                raise
            records = writer.close()
            if not records:
                raise DataError(f"split '{split}' of {source.name} has no readable images")
            splits_json[split] = {
                "num_samples": n,
                "shards": [{"name": r.name, "num_samples": r.num_samples, "bytes": r.bytes, "sha256": r.sha256}
                           for r in records],
            }
    image_format = formats.pop() if len(formats) == 1 else (source.image_format if not formats else "mixed")
    write_json_atomic(out / DATASET_JSON, {
        "format": FORMAT_NAME, "version": FORMAT_VERSION, "source": source.name,
        "num_classes": len(source.class_names), "class_names": source.class_names,
        "image_format": image_format, "label_key": "cls" if source.class_names else "", **summary_px.json(),
        "splits": splits_json,
    })
    if bucket is not None:
        bucket.upload(out / DATASET_JSON)  # last: the shards it names are all there
    seconds = time.perf_counter() - t0
    nbytes = sum(s["bytes"] for sp in splits_json.values() for s in sp["shards"])
    summary = WriteSummary(sum(sp["num_samples"] for sp in splits_json.values()),
                           sum(len(sp["shards"]) for sp in splits_json.values()), nbytes, seconds, skipped)
    log(summary.line(shown))
    return summary


# ----------------------------------------------------------------------------- shards written by others


def expand_shards(pattern: str) -> list[str]:
    """Brace ranges ('{000..099}') and globs ('*.tar'); a pattern that matches nothing is an error."""
    import braceexpand

    out: list[str] = []
    for p in braceexpand.braceexpand(pattern):
        if is_remote(p):
            out.append(p)
        elif any(c in p for c in "*?["):
            out += sorted(glob.glob(p))
        elif os.path.exists(p):
            out.append(p)
        else:
            raise DataError(f"shard '{p}' (from '{pattern}') does not exist")
    if not out:
        raise DataError(f"shard pattern '{pattern}' matches no files")
    return out


def scan_shard(shard: str, label_key: str) -> tuple[int, list[int], int]:
    """(samples, labels of those with an image, samples without an image or a usable label) of one shard.

    Every sample (key group) counts, image or not: the loaders number samples by position in the
    tar, so an image-less one is a counted bad sample, not a shift of every later index."""
    n, labels, unlabelled = 0, [], 0
    try:
        for raw in tario.iter_raw_samples(shard):
            n += 1
            try:
                tario.image_member(raw)
            except tario.SampleError:
                unlabelled += 1
                continue
            try:
                labels.append(tario.parse_label(raw, label_key))
            except tario.SampleError:
                unlabelled += 1
    except tario.ShardError as e:
        raise DataError(str(e)) from None
    return n, labels, unlabelled


def index_shards(splits: dict[str, str], out_dir: str | Path, label_key: str = "cls",
                 progress: bool = True, log: Callable[[str], None] = print) -> WriteSummary:
    """Describe existing shards (img2dataset, timm, ...) in `out_dir/dataset.json`; nothing is copied.

    `splits` maps a split name to a shard pattern. Counts and the class count come from
    reading every shard once (labels only; no image is decoded).
    """
    from tqdm import tqdm

    remote_out = is_url(str(out_dir))
    if remote_out and shard_scheme(str(out_dir)) != "s3":
        raise DataError(f"--out {out_dir}: only s3:// prefixes are written to (http(s) is read-only)")
    out: Path | str = str(out_dir).rstrip("/") if remote_out else Path(out_dir)
    if not remote_out:
        out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    expanded = {split: expand_shards(pattern) for split, pattern in splits.items()}
    splits_json: dict[str, Any] = {}
    max_label, unlabelled_total = -1, 0
    nshards = sum(len(v) for v in expanded.values())
    with tqdm(total=nshards, unit="shard", desc="indexing", disable=not progress) as bar:
        for split, shards in expanded.items():
            entries = []
            for shard in shards:
                with readable_copy(shard) as local:
                    n, labels, unlabelled = scan_shard(local, label_key)
                    entry: dict[str, Any] = {"name": _relative_to(shard, out), "num_samples": n}
                    if not local.startswith("pipe:"):  # a file (a URL's verified copy): its size and digest
                        entry["bytes"] = os.stat(local).st_size
                        entry["sha256"] = file_sha256(local)
                unlabelled_total += unlabelled
                max_label = max([max_label, *labels])
                entries.append(entry)
                bar.update(1)
            splits_json[split] = {"num_samples": sum(e["num_samples"] for e in entries), "shards": entries}
    if max_label < 0:
        # Shards of images alone: valid for MAE pretraining (num_classes 0; a supervised run refuses them).
        log(f"note: no sample has an integer label at '{label_key}': indexed as label-free shards, for "
            f"model.objective=mae (if the labels are elsewhere, set --label-key, e.g. json:label)")
        label_key = ""
    elif unlabelled_total:
        log(f"warning: {unlabelled_total} samples have no image or no integer label at '{label_key}'; "
            f"the loader will skip and count them")
    num_classes = max_label + 1
    description = {
        "format": FORMAT_NAME, "version": FORMAT_VERSION, "source": "shards:" + ",".join(splits.values()),
        "num_classes": num_classes, "class_names": [str(i) for i in range(num_classes)],
        "image_format": "jpg", "label_key": label_key, "splits": splits_json,
    }
    where = f"{out}/{DATASET_JSON}"
    if isinstance(out, Path):
        write_json_atomic(out / DATASET_JSON, description)
    else:
        with BucketOut(out, overwrite=True) as bucket:
            write_json_atomic(bucket.staging / DATASET_JSON, description)
            bucket.upload(bucket.staging / DATASET_JSON)
    total_bytes = sum(e.get("bytes", 0) for sp in splits_json.values() for e in sp["shards"])
    summary = WriteSummary(sum(sp["num_samples"] for sp in splits_json.values()), nshards, total_bytes,
                           time.perf_counter() - t0, 0)
    log(f"indexed {summary.samples} samples in {summary.shards} shards, {num_classes} classes "
        f"-> {where} in {summary.seconds:.1f} s")
    return summary




def _relative_to(shard: str, folder: Path | str) -> str:
    if isinstance(folder, str):  # a URL prefix: names under it are written relative to it
        return shard[len(folder) + 1:] if shard.startswith(folder + "/") else shard
    if is_remote(shard):
        return shard
    path = Path(shard).resolve()
    try:
        return str(path.relative_to(folder.resolve()))
    except ValueError:
        return str(path)
