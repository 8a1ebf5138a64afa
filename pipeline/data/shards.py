"""Write WebDataset shards: `train-000000.tar` of `KEY.jpg|png` + `KEY.cls`, and a `dataset.json`.

Sources (see `launch/make_shards.py`):

    folder:PATH   an ImageFolder tree (PATH/CLASS/*.jpg, or PATH/train/... and PATH/val/...)
    digits        scikit-learn's bundled 1,797 handwritten 8x8 digits, upscaled, PNG (the demo data)
    synthetic     generated, learnable images of any size and class count, JPEG (tests, benchmarks)
    shards:GLOB   shards written by others (img2dataset, timm): indexed in place, nothing copied

Every shard is written to a hidden temporary name, fsynced, then renamed, and `dataset.json`
is written the same way last: a crash leaves no half shard under a shard's name and no
dataset.json describing shards that are not all there.
"""

from __future__ import annotations

import glob
import io
import os
import tarfile
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from . import tario
from .info import (
    DATASET_JSON,
    FORMAT_NAME,
    FORMAT_VERSION,
    DataError,
    fsync_dir,
    is_remote,
    write_json_atomic,
)

FOLDER_IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".ppm", ".tif", ".tiff", ".gif"}


# ----------------------------------------------------------------------------- writing


@dataclass
class ShardRecord:
    name: str
    num_samples: int
    bytes: int


class ShardWriter:
    """Writes `{prefix}-000000.tar`, `{prefix}-000001.tar`, ... with at most `max_samples` samples
    and (roughly) `max_bytes` bytes each; each shard appears under its name only when complete."""

    def __init__(self, out_dir: str | Path, prefix: str, max_samples: int = 1000, max_bytes: int | None = None):
        if max_samples < 1:
            raise DataError(f"max samples per shard must be >= 1, got {max_samples}")
        self.out_dir = Path(out_dir)
        self.prefix = prefix
        self.max_samples = max_samples
        self.max_bytes = max_bytes
        self.records: list[ShardRecord] = []
        self._file: Any = None
        self._tar: tarfile.TarFile | None = None
        self._tmp: Path | None = None
        self._count = 0
        self._bytes = 0

    def _name(self) -> str:
        return f"{self.prefix}-{len(self.records):06d}.tar"

    def _open(self) -> None:
        self._tmp = self.out_dir / f".{self._name()}.tmp-{os.getpid()}"
        self._file = open(self._tmp, "wb")  # noqa: SIM115 (closed in _finish)
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.USTAR_FORMAT)
        self._count = 0
        self._bytes = 0

    def _finish(self) -> None:
        assert self._tar is not None and self._tmp is not None
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        name = self._name()
        final = self.out_dir / name
        os.replace(self._tmp, final)
        self.records.append(ShardRecord(name, self._count, final.stat().st_size))
        self._tar = self._file = self._tmp = None

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
        for ext, data in members.items():
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size = len(data)
            info.mode = 0o644
            info.mtime = 0  # the same input gives byte-identical shards
            self._tar.addfile(info, io.BytesIO(data))
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
                if self._tmp is not None:
                    self._tmp.unlink(missing_ok=True)
            self._tar = self._file = self._tmp = None


def _round_block(n: int) -> int:
    return (n + tarfile.BLOCKSIZE - 1) // tarfile.BLOCKSIZE * tarfile.BLOCKSIZE


# ----------------------------------------------------------------------------- sources


@dataclass
class Item:
    """One sample to write: `ref` is what `encode` needs (a path, an index)."""
    label: int
    ref: Any


@dataclass
class Source:
    name: str
    class_names: list[str]
    splits: dict[str, list[Item]]
    encode: Callable[[Item], tuple[str, bytes]]
    """Item -> (image extension, image bytes); runs in worker processes when --workers > 1."""
    image_format: str


def stratified_split(labels: Sequence[int], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Indices (train, val): per class, a seeded shuffle and round(val_fraction x n) to val."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    train, val = [], []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        idx = idx[rng.permutation(len(idx))]
        n_val = int(round(val_fraction * len(idx)))
        val += idx[:n_val].tolist()
        train += idx[n_val:].tolist()
    return sorted(train), sorted(val)


# digits ---------------------------------------------------------------------


def _encode_png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False, compress_level=6)
    return buf.getvalue()


def _digit_png(pixels: np.ndarray, size: int) -> bytes:
    img = Image.fromarray(np.clip(pixels * (255.0 / 16.0), 0, 255).round().astype(np.uint8), "L")
    img = img.resize((size, size), Image.BICUBIC).convert("RGB")
    return _encode_png(img)


class _DigitsEncoder:
    def __init__(self, size: int):
        self.size = size
        self.images: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"size": self.size, "images": None}  # workers load the (bundled) data themselves

    def __call__(self, item: Item) -> tuple[str, bytes]:
        if self.images is None:
            from sklearn.datasets import load_digits  # bundled with scikit-learn: no download
            self.images = load_digits().images
        return "png", _digit_png(self.images[item.ref], self.size)


def digits_source(size: int = 32, val_fraction: float = 0.2, seed: int = 0) -> Source:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DataError("--source digits needs scikit-learn: pip install 'vit-pipeline[demo]'") from None
    digits = load_digits()
    labels = [int(t) for t in digits.target]
    train, val = stratified_split(labels, val_fraction, seed)
    splits = {"train": [Item(labels[i], i) for i in train], "val": [Item(labels[i], i) for i in val]}
    return Source("digits", [str(i) for i in range(10)], splits, _DigitsEncoder(size), "png")


# synthetic ------------------------------------------------------------------


def synthetic_image(index: int, label: int, num_classes: int, size: tuple[int, int], seed: int = 0) -> np.ndarray:
    """A learnable RGB image: class -> hue and stripe orientation/frequency; per sample: phase, contrast, noise."""
    h, w = size
    rng = np.random.default_rng([seed, index, 0x5A17])
    hue = label / num_classes
    base = np.array([np.cos(2 * np.pi * (hue + k / 3)) for k in range(3)]) * 0.35 + 0.5
    theta = np.pi * label / num_classes
    freq = 2 + label % 3
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi)
    stripes = np.sin(2 * np.pi * freq * (xx * np.cos(theta) + yy * np.sin(theta)) / max(h, w) + phase)
    contrast = rng.uniform(0.2, 0.4)
    img = base[None, None, :] * (1 + contrast * stripes[..., None])
    img = img * 255 + rng.normal(0, 12, size=(h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


class _SyntheticEncoder:
    def __init__(self, num_classes: int, size: tuple[int, int], seed: int, quality: int):
        self.num_classes, self.size, self.seed, self.quality = num_classes, size, seed, quality

    def __call__(self, item: Item) -> tuple[str, bytes]:
        pixels = synthetic_image(item.ref, item.label, self.num_classes, self.size, self.seed)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=self.quality)
        return "jpg", buf.getvalue()


def synthetic_source(num_samples: int = 1000, num_classes: int = 10, size: int | tuple[int, int] = 64,
                     val_fraction: float = 0.2, seed: int = 0, quality: int = 90) -> Source:
    if num_samples < 1 or num_classes < 1:
        raise DataError("synthetic data needs num_samples >= 1 and num_classes >= 1")
    hw = (size, size) if isinstance(size, int) else tuple(size)
    labels = [i % num_classes for i in range(num_samples)]
    train, val = stratified_split(labels, val_fraction, seed)
    splits = {"train": [Item(labels[i], i) for i in train]}
    if val:
        splits["val"] = [Item(labels[i], i) for i in val]
    return Source("synthetic", [f"class_{i}" for i in range(num_classes)], splits,
                  _SyntheticEncoder(num_classes, hw, seed, quality), "jpg")  # type: ignore[arg-type]


# image folder ---------------------------------------------------------------


def _scan_class_folders(root: Path, class_names: list[str] | None = None) -> tuple[list[str], list[Item]]:
    found = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    classes = class_names if class_names is not None else found
    if not classes:
        raise DataError(f"image folder '{root}' has no class sub-folders (expected {root}/CLASS/*.jpg)")
    unknown = sorted(set(found) - set(classes))
    if unknown:
        raise DataError(f"'{root}' has class folders not in the training classes: {', '.join(unknown[:5])}")
    items = []
    for label, name in enumerate(classes):
        folder = root / name
        if not folder.is_dir():
            continue
        for dirpath, _, files in sorted(os.walk(folder, followlinks=True)):
            for f in sorted(files):
                if Path(f).suffix.lower() in FOLDER_IMAGE_EXTS and not f.startswith("."):
                    items.append(Item(label, os.path.join(dirpath, f)))
    return classes, items


class _FolderEncoder:
    """Keeps JPEG and PNG bytes as they are (no re-compression); re-encodes other formats or resized images."""

    def __init__(self, resize: int | None, quality: int):
        self.resize, self.quality = resize, quality

    def __call__(self, item: Item) -> tuple[str, bytes]:
        data = Path(item.ref).read_bytes()
        ext = Path(item.ref).suffix.lower().lstrip(".")
        ext = "jpg" if ext == "jpeg" else ext
        try:
            img = Image.open(io.BytesIO(data))
            fmt = img.format
            if self.resize is None and ext in ("jpg", "png") and fmt in ("JPEG", "PNG"):
                img.verify()  # cheap structural check; full decode happens at training time
                return ("jpg" if fmt == "JPEG" else "png"), data
            img = img.convert("RGB")
            if self.resize is not None and min(img.size) > self.resize:
                scale = self.resize / min(img.size)
                img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))),
                                 Image.BICUBIC)
            buf = io.BytesIO()
            if fmt == "PNG" and self.resize is None:
                img.save(buf, format="PNG")
                return "png", buf.getvalue()
            img.save(buf, format="JPEG", quality=self.quality)
            return "jpg", buf.getvalue()
        except Exception as e:
            raise tario.SampleError(tario.CORRUPT_IMAGE, f"{item.ref}: {e}") from None


def folder_source(path: str, val_fraction: float = 0.1, seed: int = 0, resize: int | None = None,
                  quality: int = 95) -> Source:
    root = Path(path)
    if not root.is_dir():
        raise DataError(f"image folder '{root}' does not exist")
    if (root / "train").is_dir():
        classes, train_items = _scan_class_folders(root / "train")
        splits = {"train": train_items}
        if (root / "val").is_dir():
            _, splits["val"] = _scan_class_folders(root / "val", classes)
    else:
        classes, items = _scan_class_folders(root)
        train, val = stratified_split([it.label for it in items], val_fraction, seed)
        splits = {"train": [items[i] for i in train]}
        if val:
            splits["val"] = [items[i] for i in val]
    if not splits["train"]:
        raise DataError(f"image folder '{root}' holds no images ({', '.join(sorted(FOLDER_IMAGE_EXTS))})")
    return Source(f"folder:{root}", classes, splits, _FolderEncoder(resize, quality), "jpg")


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


def _encode_safe(encode: Callable[[Item], tuple[str, bytes]], item: Item) -> tuple[str, bytes] | str:
    try:
        return encode(item)
    except tario.SampleError as e:
        return str(e)
    except OSError as e:
        return f"{item.ref}: {e}"


class _Encode:
    def __init__(self, encode: Callable[[Item], tuple[str, bytes]]):
        self.encode = encode

    def __call__(self, item: Item) -> tuple[str, bytes] | str:
        return _encode_safe(self.encode, item)


def _encoded(source: Source, items: list[Item], workers: int) -> Iterator[tuple[str, bytes] | str]:
    fn = _Encode(source.encode)
    if workers <= 1:
        yield from map(fn, items)
        return
    import multiprocessing as mp
    with mp.get_context("fork").Pool(workers) as pool:
        yield from pool.imap(fn, items, chunksize=16)  # ordered: the output does not depend on --workers


def prepare_out_dir(out_dir: Path, overwrite: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    ours = [p for p in out_dir.iterdir() if p.name == DATASET_JSON or
            (p.suffix == ".tar" and p.name.split("-")[0] in ("train", "val", "test"))]
    if ours and not overwrite:
        raise DataError(f"'{out_dir}' already holds shards or a {DATASET_JSON}; pass --overwrite to replace them")
    # dataset.json goes first: an interrupted rewrite must not leave it describing old shards.
    for p in sorted(ours, key=lambda p: p.name != DATASET_JSON):
        p.unlink()
    for p in out_dir.glob(".*.tmp-*"):
        p.unlink()


def write_dataset(source: Source, out_dir: str | Path, max_samples_per_shard: int = 1000,
                  max_bytes_per_shard: int | None = None, seed: int = 0, workers: int = 1,
                  overwrite: bool = False, progress: bool = True, log: Callable[[str], None] = print
                  ) -> WriteSummary:
    """Shuffle each split (seeded: shards are not sorted by class), write shards, then dataset.json."""
    from tqdm import tqdm

    out = Path(out_dir)
    prepare_out_dir(out, overwrite)
    t0 = time.perf_counter()
    total = sum(len(v) for v in source.splits.values())
    splits_json: dict[str, Any] = {}
    skipped = 0
    formats: set[str] = set()
    with tqdm(total=total, unit="img", desc=f"shards -> {out}", disable=not progress, dynamic_ncols=True) as bar:
        for split, items in source.splits.items():
            order = np.random.default_rng([seed, zlib.crc32(split.encode())]).permutation(len(items))
            items = [items[i] for i in order]
            writer = ShardWriter(out, split, max_samples_per_shard, max_bytes_per_shard)
            n = 0
            try:
                for item, result in zip(items, _encoded(source, items, workers)):
                    bar.update(1)
                    if isinstance(result, str):
                        skipped += 1
                        bar.write(f"skipped: {result}")
                        continue
                    ext, data = result
                    formats.add(ext)
                    writer.write(f"{n:06d}", {ext: data, "cls": str(item.label).encode()})
                    n += 1
            except BaseException:
                writer.abort()
                raise
            records = writer.close()
            if not records:
                raise DataError(f"split '{split}' of {source.name} has no readable images")
            splits_json[split] = {
                "num_samples": n,
                "shards": [{"name": r.name, "num_samples": r.num_samples, "bytes": r.bytes} for r in records],
            }
    image_format = formats.pop() if len(formats) == 1 else (source.image_format if not formats else "mixed")
    write_json_atomic(out / DATASET_JSON, {
        "format": FORMAT_NAME, "version": FORMAT_VERSION, "source": source.name,
        "num_classes": len(source.class_names), "class_names": source.class_names,
        "image_format": image_format, "label_key": "cls", "splits": splits_json,
    })
    seconds = time.perf_counter() - t0
    nbytes = sum(s["bytes"] for sp in splits_json.values() for s in sp["shards"])
    summary = WriteSummary(sum(sp["num_samples"] for sp in splits_json.values()),
                           sum(len(sp["shards"]) for sp in splits_json.values()), nbytes, seconds, skipped)
    log(summary.line(out))
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

    out = Path(out_dir)
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
                n, labels, unlabelled = scan_shard(shard, label_key)
                unlabelled_total += unlabelled
                max_label = max([max_label, *labels])
                entry: dict[str, Any] = {"name": _relative_to(shard, out), "num_samples": n}
                if not is_remote(shard):
                    entry["bytes"] = os.stat(shard).st_size
                entries.append(entry)
                bar.update(1)
            splits_json[split] = {"num_samples": sum(e["num_samples"] for e in entries), "shards": entries}
    if max_label < 0:
        raise DataError(f"no sample in {', '.join(splits.values())} has an integer label at '{label_key}' "
                        f"(set --label-key, e.g. json:label)")
    if unlabelled_total:
        log(f"warning: {unlabelled_total} samples have no image or no integer label at '{label_key}'; "
            f"the loader will skip and count them")
    num_classes = max_label + 1
    write_json_atomic(out / DATASET_JSON, {
        "format": FORMAT_NAME, "version": FORMAT_VERSION, "source": "shards:" + ",".join(splits.values()),
        "num_classes": num_classes, "class_names": [str(i) for i in range(num_classes)],
        "image_format": "jpg", "label_key": label_key, "splits": splits_json,
    })
    total_bytes = sum(e.get("bytes", 0) for sp in splits_json.values() for e in sp["shards"])
    summary = WriteSummary(sum(sp["num_samples"] for sp in splits_json.values()), nshards, total_bytes,
                           time.perf_counter() - t0, 0)
    log(f"indexed {summary.samples} samples in {summary.shards} shards, {num_classes} classes "
        f"-> {out / DATASET_JSON} in {summary.seconds:.1f} s")
    return summary


def _relative_to(shard: str, folder: Path) -> str:
    if is_remote(shard):
        return shard
    path = Path(shard).resolve()
    try:
        return str(path.relative_to(folder.resolve()))
    except ValueError:
        return str(path)
