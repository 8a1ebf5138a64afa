"""The IDX format (LeCun's MNIST files; Fashion-MNIST, KMNIST and EMNIST ship the same): a data set of small
grey images read from its own files, no download (`make_shards.py --source idx:DIR` or `--source fashion-mnist`).

An IDX file is a 4-byte magic number (two zero bytes, a type code, the number of dimensions), one big-endian
int32 size per dimension, then the values, big-endian, row-major. `DIR` holds `train-images-idx3-ubyte` and
`train-labels-idx1-ubyte` (each optionally `.gz`), and `t10k-...` (or `test-...`) for the official test split,
written as the `val` split. The images are stored as they are: one-channel 8-bit arrays (pixels.py), so a run
reads one channel (`model.in_chans` from dataset.json) with the set's own mean and std.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from . import pixels
from .bad import DataError
from .sources import Item, Source

IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
"""The IDX type code (the magic number's third byte) -> NumPy's big-endian dtype."""

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
"""Where Debian's `dataset-fashion-mnist` package puts the IDX files (`--source fashion-mnist`)."""

KNOWN_CLASS_NAMES = {
    "fashion": ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                "Ankle boot"],  # Zalando Research's README, in label order
    "kmnist": ["o", "ki", "su", "tsu", "na", "ha", "ma", "ya", "re", "wo"],  # the romanised hiragana of KMNIST
}
"""A set named in its folder's path -> its class names; any other set's classes are named by their labels."""

SPLIT_PREFIXES = {"train": ("train",), "val": ("t10k", "test")}


def read_idx(path: str | Path) -> np.ndarray:
    """The array an IDX file holds (gzip or plain, by its first bytes), in native byte order; a DataError naming the
    file for a bad magic number or a size that does not match its bytes."""
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise DataError(f"{path}: not a readable gzip file ({e})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in IDX_TYPES or raw[3] == 0:
        raise DataError(f"{path}: not an IDX file (magic number {raw[:4].hex() or 'missing'}; expected 0000, "
                        f"a type code of {', '.join(f'{t:02x}' for t in IDX_TYPES)}, and the number of dimensions)")
    ndim, dtype = raw[3], np.dtype(IDX_TYPES[raw[2]])
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: the header says {ndim} dimensions and the file ends after {len(raw)} bytes")
    shape = tuple(int(d) for d in np.frombuffer(raw, ">u4", ndim, 4))
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        raise DataError(f"{path}: the header says {' x '.join(map(str, shape))} values of {dtype.name} "
                        f"({expected} bytes with the header), and the file holds {len(raw)} bytes")
    return np.frombuffer(raw, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def _find(root: Path, split: str, kind: str) -> Path | None:
    """`<prefix>-<kind>-idx<n>-ubyte[.gz]` in `root` (EMNIST's `emnist-balanced-train-...` included)."""
    found = sorted(p for prefix in SPLIT_PREFIXES[split]
                   for p in root.glob(f"*{prefix}-{kind}-idx*") if not p.name.startswith("."))
    return found[0] if found else None


def _split(root: Path, split: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(images N x H x W, labels N) of one split, or None where `root` has neither of its files."""
    images_path, labels_path = _find(root, split, "images"), _find(root, split, "labels")
    if images_path is None and labels_path is None:
        return None
    if images_path is None or labels_path is None:
        have, missing = (images_path or labels_path), ("images" if images_path is None else "labels")
        raise DataError(f"{root}: {have.name} and no {split} {missing} file beside it "
                        f"(expected *{SPLIT_PREFIXES[split][0]}-{missing}-idx*)")
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or images.dtype != np.uint8:
        raise DataError(f"{images_path}: expected N x H x W unsigned bytes (idx3-ubyte), got "
                        f"{' x '.join(map(str, images.shape))} of {images.dtype.name}")
    if labels.ndim != 1:
        raise DataError(f"{labels_path}: expected one label per image (idx1), got {labels.ndim} dimensions")
    if len(images) != len(labels):
        raise DataError(f"{root}: {images_path.name} holds {len(images)} images and {labels_path.name} "
                        f"{len(labels)} labels")
    return images, labels.astype(np.int64)


class _IdxEncoder:
    """Item.ref = (split, index): the image as a one-channel 8-bit array member, with its statistics."""

    def __init__(self, images: dict[str, np.ndarray]):
        self.images = images  # inherited by fork workers; small (Fashion-MNIST: 55 MB)

    def __call__(self, item: Item) -> tuple[str, bytes, pixels.SampleInfo]:
        split, i = item.ref
        array = np.ascontiguousarray(self.images[split][i])[..., None]  # H x W x 1
        return pixels.ARRAY_MEMBER, pixels.encode_array(array), pixels.SampleInfo(1, "uint8", None,
                                                                                  pixels.ChannelStats.of(array))


def class_names_for(root: Path, num_classes: int) -> list[str]:
    """The set's class names where its folder names a known set, else the labels as text."""
    where = str(root.resolve()).lower()
    for key, names in KNOWN_CLASS_NAMES.items():
        if key in where and len(names) == num_classes:
            return list(names)
    return [str(i) for i in range(num_classes)]


def idx_source(path: str | Path) -> Source:
    """The IDX files in `path` as a Source: train from `train-*`, val from `t10k-*` (the official split)."""
    root = Path(path)
    if not root.is_dir():
        raise DataError(f"--source idx:{path}: no such folder (expected the IDX files, e.g. "
                        f"train-images-idx3-ubyte.gz)")
    splits = {name: data for name in SPLIT_PREFIXES if (data := _split(root, name)) is not None}
    if "train" not in splits:
        raise DataError(f"{root}: no train-images-idx3-ubyte[.gz] and train-labels-idx1-ubyte[.gz]")
    shapes = {name: images.shape[1:] for name, (images, _) in splits.items()}
    if len(set(shapes.values())) > 1:
        raise DataError(f"{root}: the splits' images differ in size ({shapes})")
    labels = np.concatenate([lab for _, lab in splits.values()])
    if labels.min() < 0:
        raise DataError(f"{root}: negative labels ({int(labels.min())})")
    class_names = class_names_for(root, int(labels.max()) + 1)
    items = {name: [Item(int(lab), (name, i)) for i, lab in enumerate(labs)] for name, (_, labs) in splits.items()}
    encoder = _IdxEncoder({name: images for name, (images, _) in splits.items()})
    return Source(f"idx:{root}", class_names, items, encoder, pixels.ARRAY_MEMBER)


def fashion_mnist_source(path: str = FASHION_MNIST_DIR) -> Source:
    """Fashion-MNIST from Debian's package (`--source fashion-mnist`); one line naming it when it is absent."""
    if not Path(path).is_dir():
        raise DataError(f"--source fashion-mnist reads {path}, which does not exist: install Debian's package "
                        f"(apt-get update && apt-get install dataset-fashion-mnist), or give --source idx:DIR")
    return idx_source(path)
