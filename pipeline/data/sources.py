"""Where samples to write come from: an image folder, scikit-learn's digits, or synthetic images.

A `Source` lists `Item`s per split and knows how to encode one (image extension, bytes);
`shards.write_dataset` writes them. See `launch/make_shards.py` for the command line.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from . import pixels, tario
from .bad import DataError

FOLDER_IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".ppm", ".tif", ".tiff", ".gif", ".npy", ".dcm"}


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
    encode: Callable[[Item], tuple[Any, ...]]
    """Item -> (image extension, image bytes) or, for an array member, (ext, bytes, pixels.SampleInfo);
    runs in worker processes when --workers > 1."""
    image_format: str
    name_of: Callable[[Item], str] | None = None
    """Item -> the name of the file it came from, recorded with the sample (`tario.SOURCE_MEMBER`) so that its
    embedding can be traced back to the user's file; None: a source of no files (digits, synthetic)."""


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


def keep_train_fraction(source: Source, fraction: float, seed: int) -> Source:
    """The source with `fraction` of each class of its train split kept (seeded, at least one image per
    class), the other splits whole: the few labels of a semi-supervised fine-tune (`make demo-mae`)."""
    if not 0 < fraction <= 1:
        raise DataError(f"--train-fraction must be in (0, 1], got {fraction}")
    items = source.splits["train"]
    # stratified_split puts round(f x n) of each class on its "val" side: that side is what is kept.
    _, kept = stratified_split([it.label for it in items], fraction, seed)
    counts = {it.label for it in items}
    kept_labels = {items[i].label for i in kept}
    kept += [next(i for i, it in enumerate(items) if it.label == c) for c in sorted(counts - kept_labels)]
    splits = dict(source.splits, train=[items[i] for i in sorted(kept)])
    return Source(f"{source.name}, {fraction:g} of train", source.class_names, splits, source.encode,
                  source.image_format)


def keep_classes(source: Source, classes: list[Any]) -> Source:
    """The source with only the given classes (each a label or a class name), relabelled 0..k-1 in the order given,
    every split filtered alike (`--classes`): a set of some of the classes, e.g. a source for adaptation."""
    if not source.class_names:
        raise DataError(f"--classes: {source.name} has no classes to choose from")
    chosen: list[int] = []
    for c in classes:
        text = str(c).strip()
        if text.isdigit():
            label = int(text)
        elif text in source.class_names:
            label = source.class_names.index(text)
        else:
            raise DataError(f"--classes: '{text}' is neither a label (0-{len(source.class_names) - 1}) nor a class "
                            f"name of {source.name} ({', '.join(source.class_names)})")
        if not 0 <= label < len(source.class_names):
            raise DataError(f"--classes: label {label} is outside {source.name}'s 0-{len(source.class_names) - 1}")
        if label in chosen:
            raise DataError(f"--classes: '{text}' is given twice")
        chosen.append(label)
    if not chosen:
        raise DataError("--classes: no class given (e.g. --classes 0,1,2)")
    new = {old: i for i, old in enumerate(chosen)}
    splits = {split: [Item(new[it.label], it.ref) for it in items if it.label in new]
              for split, items in source.splits.items()}
    return Source(f"{source.name}, classes {','.join(map(str, chosen))}", [source.class_names[c] for c in chosen],
                  splits, _Relabelled(source.encode, {i: old for old, i in new.items()}), source.image_format,
                  source.name_of)


class _Relabelled:
    """`keep_classes`' encoder: the source's own, on the item with its original label (a synthetic image is drawn
    from its class)."""

    def __init__(self, encode: Any, original: dict[int, int]):
        self.encode, self.original = encode, original

    def __call__(self, item: Item) -> tuple[Any, ...]:
        return self.encode(Item(self.original[item.label], item.ref))


class _Unlabelled:
    """`without_labels`' encoder: the source's own, on the item as it was (a synthetic image is drawn from its class)."""

    def __init__(self, encode: Callable[[Item], tuple[Any, ...]]):
        self.encode = encode

    def __call__(self, item: Item) -> tuple[Any, ...]:
        return self.encode(Item(*item.ref))


def without_labels(source: Source) -> Source:
    """The source's images, the same splits, no labels (`--no-labels`): shards as a team's unlabelled images are,
    for a self-supervised run judged on the labelled ones apart (eval.sets; `make demo-mae`)."""
    splits = {split: [Item(-1, (it.label, it.ref)) for it in items] for split, items in source.splits.items()}
    return Source(f"{source.name}, without labels", [], splits, _Unlabelled(source.encode), source.image_format)


# digits ---------------------------------------------------------------------


def _encode_png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False, compress_level=6)
    return buf.getvalue()


DIGIT_STYLES = ("shifted",)  # --source digits:STYLE: the same digits drawn otherwise (a second domain)


def _digit_png(pixels: np.ndarray, size: int) -> bytes:
    img = Image.fromarray(np.clip(pixels * (255.0 / 16.0), 0, 255).round().astype(np.uint8), "L")
    img = img.resize((size, size), Image.BICUBIC).convert("RGB")
    return _encode_png(img)


def _digit_uint16(levels: np.ndarray, size: int) -> np.ndarray:
    """The 8x8 digit's 17 grey levels (0-16) scaled to 16 bits (x 65535 / 16), resized bicubic as the PNG's (in
    float32, then rounded and clipped): size x size x 1 uint16, a single-channel 16-bit image (issue 62's demo)."""
    img = Image.fromarray((levels * (65535.0 / 16.0)).astype(np.float32), "F").resize((size, size), Image.BICUBIC)
    return np.clip(np.asarray(img).round(), 0, 65535).astype(np.uint16)[..., None]


class _DigitsEncoder:
    def __init__(self, size: int, dtype: str = "uint8", style: str | None = None):
        self.size, self.dtype, self.style = size, dtype, style
        self.images: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:  # workers load the (bundled) data themselves
        return {"size": self.size, "dtype": self.dtype, "style": self.style, "images": None}

    def __call__(self, item: Item) -> tuple[str, bytes] | tuple[str, bytes, pixels.SampleInfo]:
        if self.images is None:
            from sklearn.datasets import load_digits  # bundled with scikit-learn: no download
            self.images = load_digits().images
        levels = self.images[item.ref]
        if self.style == "shifted":  # dark ink on a light ground, turned a quarter: docs/adapt.md's second domain
            levels = np.rot90(16.0 - levels)
        if self.dtype == "uint16":  # an array member with its statistics, as a folder's .npy (pixels.py)
            array = _digit_uint16(levels, self.size)
            info = pixels.SampleInfo(1, "uint16", None, pixels.ChannelStats.of(array))
            return pixels.ARRAY_MEMBER, pixels.encode_array(array), info
        return "png", _digit_png(levels, self.size)


def digits_source(size: int = 32, val_fraction: float = 0.2, seed: int = 0, dtype: str = "uint8",
                  style: str | None = None) -> Source:
    """scikit-learn's digits: 8-bit RGB PNGs, or (`dtype` uint16) single-channel 16-bit arrays of the same images;
    `style` 'shifted': each inverted (dark on light) and rotated 90 degrees, the same labels and split."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DataError("--source digits needs scikit-learn: pip install 'vit-pipeline[demo]'") from None
    digits = load_digits()
    labels = [int(t) for t in digits.target]
    train, val = stratified_split(labels, val_fraction, seed)
    splits = {"train": [Item(labels[i], i) for i in train], "val": [Item(labels[i], i) for i in val]}
    return Source(f"digits-{style}" if style else "digits", [str(i) for i in range(10)], splits,
                  _DigitsEncoder(size, dtype, style),
                  pixels.ARRAY_MEMBER if dtype == "uint16" else "png")


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


def _images_in(folder: Path, label: int) -> list[Item]:
    items = []
    for dirpath, _, files in sorted(os.walk(folder, followlinks=True)):
        for f in sorted(files):
            if Path(f).suffix.lower() in FOLDER_IMAGE_EXTS and not f.startswith("."):
                items.append(Item(label, os.path.join(dirpath, f)))
    return items


def _is_label_free(root: Path) -> bool:
    """Images directly in `root` and no sub-folders: a collection without classes (MAE pretrains on it)."""
    entries = [e for e in root.iterdir() if not e.name.startswith(".")]
    return not any(e.is_dir() for e in entries) and any(e.suffix.lower() in FOLDER_IMAGE_EXTS for e in entries)


def _scan_class_folders(root: Path, class_names: list[str] | None = None) -> tuple[list[str], list[Item]]:
    if class_names == [] or (class_names is None and _is_label_free(root)):
        return [], _images_in(root, -1)  # label -1: written without a .cls member
    found = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    classes = class_names if class_names is not None else found
    if not classes:
        raise DataError(f"image folder '{root}' has no class sub-folders (expected {root}/CLASS/*.jpg)")
    unknown = sorted(set(found) - set(classes))
    if unknown:
        raise DataError(f"'{root}' has class folders not in the training classes: {', '.join(unknown[:5])}")
    items = []
    for label, name in enumerate(classes):
        if (root / name).is_dir():
            items += _images_in(root / name, label)
    return classes, items


class _FolderEncoder:
    """Keeps JPEG and PNG bytes as they are (no re-compression); re-encodes other 8-bit formats or resized images.
    What is not 8-bit (16-bit PNG, TIFF of other modes, pages or bands, .npy, DICOM) becomes an array member in
    its own dtype and channel count (pixels.py), lossless."""

    def __init__(self, resize: int | None, quality: int):
        self.resize, self.quality = resize, quality

    def __call__(self, item: Item) -> tuple[Any, ...]:
        data = Path(item.ref).read_bytes()
        ext = Path(item.ref).suffix.lower().lstrip(".")
        ext = "jpg" if ext == "jpeg" else ext
        try:
            if self._as_array(ext, data):
                return self._array(item)
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
        except tario.SampleError:
            raise
        except Exception as e:
            raise tario.SampleError(tario.CORRUPT_IMAGE, f"{item.ref}: {tario.image_error(e, data)}") from None

    @staticmethod
    def _as_array(ext: str, data: bytes) -> bool:
        """An array member, or today's 8-bit path (an 8-bit RGB/grey one-page TIFF included: no set changes)."""
        if ext == "png":
            return not pixels.is_8bit_png(data)
        if ext in ("tif", "tiff"):
            try:
                img = Image.open(io.BytesIO(data))
                return not (img.mode in ("RGB", "L", "P") and getattr(img, "n_frames", 1) == 1)
            except Exception:  # PIL cannot read it (bands, float, compression): tifffile can
                return True
        return ext in ("npy", "dcm")

    def _array(self, item: Item) -> tuple[Any, ...]:
        if self.resize is not None:
            raise tario.SampleError(tario.CORRUPT_IMAGE, f"{item.ref}: --resize re-encodes 8-bit images only; "
                                                         f"arrays are stored as they are")
        px = pixels.read_pixels(item.ref)
        bad = px.array.dtype.kind == "f" and not np.isfinite(px.array).all()
        if bad:  # statistics over NaN are NaN: such a sample is skipped and reported, as an unreadable one
            raise tario.SampleError(tario.CORRUPT_IMAGE, f"{item.ref}: NaN/inf pixels")
        info = pixels.SampleInfo(px.array.shape[2], px.array.dtype.name, px.channel_names,
                                 pixels.ChannelStats.of(px.array))
        return pixels.ARRAY_MEMBER, pixels.encode_array(px.array), info


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
    return Source(f"folder:{root}", classes, splits, _FolderEncoder(resize, quality), "jpg",
                  name_of=lambda item: Path(item.ref).relative_to(root).as_posix())
