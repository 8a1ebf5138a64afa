"""Reading samples out of WebDataset tar shards, with an explicit position per sample.

A sample is the run of consecutive tar members sharing a key (`000123.jpg`, `000123.cls`),
as in webdataset (`webdataset.tariterators.base_plus_ext`). `iter_raw_samples` streams a shard
from its beginning (make_shards reading shards written by others); the loaders read samples by
index instead (index.py).

`decode` (image and label of a sample) raises `SampleError(kind)`, so that bad samples are
counted by kind (bad.py).
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image
from webdataset.tariterators import base_plus_ext

from .info import is_remote

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "ppm", "tif", "tiff", "npy")  # npy: pixels.py's arrays

# Kinds of bad data, counted separately (`bad_counts()`).
CORRUPT_IMAGE = "corrupt_image"
MISSING_IMAGE = "missing_image"
MISSING_LABEL = "missing_label"
BAD_LABEL = "bad_label"
TRUNCATED_TAR = "truncated_tar"
UNREADABLE_SHARD = "unreadable_shard"
DUPLICATE_MEMBER = "duplicate_member"
OVERSIZED_IMAGE = "oversized_image"
BAD_KINDS = (CORRUPT_IMAGE, OVERSIZED_IMAGE, MISSING_IMAGE, MISSING_LABEL, BAD_LABEL, DUPLICATE_MEMBER, TRUNCATED_TAR,
             UNREADABLE_SHARD)
# PIL's own warning threshold (Image.MAX_IMAGE_PIXELS, about 89 MP; it refuses only twice that): a 17 KB PNG of
# 144 MP decodes to 432 MB of RGB in a loader worker. `data.max_image_pixels` raises it.
MAX_IMAGE_PIXELS = 89_478_485


class SampleError(Exception):
    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


class ShardError(Exception):
    """The shard could not be opened (kind unreadable_shard) or ended early (truncated_tar)."""

    def __init__(self, kind: str, shard: str, detail: str):
        super().__init__(f"{kind} in '{shard}': {detail}")
        self.kind = kind
        self.shard = shard


@dataclass
class RawSample:
    key: str
    index: int
    """Position of the sample in its shard (0-based)."""
    members: dict[str, bytes] = field(default_factory=dict)


def iter_raw_samples(shard: str) -> Iterator[RawSample]:
    """Samples of `shard` from the beginning, streamed (a local file, a pipe, a URL webdataset opens).

    Raises ShardError(unreadable_shard) if nothing can be read, ShardError(truncated_tar) if the
    archive breaks off (the samples before the break are yielded first).
    """
    try:
        if is_remote(shard):
            from webdataset import gopen  # the function: pipes, http(s), s3 via 'pipe:aws s3 cp ...'
            stream = gopen(shard, "rb")
        else:
            stream = open(shard, "rb", buffering=1 << 20)  # noqa: SIM115 (closed below)
    except (OSError, ValueError) as e:  # ValueError: webdataset refusing a URL
        raise ShardError(UNREADABLE_SHARD, shard, str(e)) from None
    try:
        yield from _samples(stream, shard)
    finally:
        try:
            stream.close()
        except Exception:  # a pipe's non-zero exit: what it did deliver was read; a short count is
            pass           # reported as truncated_tar by the caller


def member_key(info: tarfile.TarInfo) -> tuple[str, str] | None:
    """(sample key, lower-case extension) of a tar member, or None for a member that belongs to no sample
    (not a regular file, no extension, a `__`-prefixed name such as `__index__`). A sample is the run of
    consecutive members sharing a key: the one rule the streamed reader here and the index writer
    (pipeline/data/index.py) both number samples by."""
    if not info.isreg():
        return None
    key, ext = base_plus_ext(info.name)
    if key is None or os.path.basename(key).startswith("__"):
        return None
    return key, ext.lower()


def _samples(stream: io.IOBase, shard: str) -> Iterator[RawSample]:
    try:
        tar = tarfile.open(fileobj=stream, mode="r|*")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise ShardError(UNREADABLE_SHARD, shard, f"not a tar archive ({e})") from None
    current: RawSample | None = None
    members_read = index = 0
    try:
        for info in tar:
            members_read += 1
            tar.members = []  # a streaming TarFile keeps every header otherwise
            named = member_key(info)
            if named is None:
                continue
            key, ext = named
            if current is not None and current.key != key:
                yield current
                index += 1
                current = None
            if current is None:
                current = RawSample(key, index)
            fobj = tar.extractfile(info)
            current.members[ext] = fobj.read() if fobj is not None else b""
        if current is not None:
            yield current
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:
        if members_read == 0:
            raise ShardError(UNREADABLE_SHARD, shard, f"not a tar archive ({e})") from None
        raise ShardError(TRUNCATED_TAR, shard, str(e)) from None


def image_member(sample: RawSample) -> tuple[str, bytes]:
    for ext in IMAGE_EXTS:
        if ext in sample.members:
            return ext, sample.members[ext]
    raise SampleError(MISSING_IMAGE, f"sample '{sample.key}' has no image member ({', '.join(sample.members)})")


def open_image(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """The image with only its header parsed; SampleError(oversized_image) past `max_pixels` (before any
    pixel is decoded: a decompression bomb costs a header read), SampleError(corrupt_image) if unreadable."""
    if max_pixels > (Image.MAX_IMAGE_PIXELS or 0):
        Image.MAX_IMAGE_PIXELS = max_pixels  # PIL refuses at twice its own limit: ours is the one that counts
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # counted below instead
            img = Image.open(io.BytesIO(data))
        width, height = img.size
    except Image.DecompressionBombError as e:
        raise SampleError(OVERSIZED_IMAGE, str(e)) from None
    except Exception as e:  # PIL raises many types (OSError, SyntaxError, ValueError)
        raise SampleError(CORRUPT_IMAGE, image_error(e, data)) from None
    if width * height > max_pixels:
        raise SampleError(OVERSIZED_IMAGE, f"{width}x{height} = {width * height} pixels > data.max_image_pixels="
                                           f"{max_pixels}; not decoded")
    return img


def decode_image(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """Fully decoded RGB image; SampleError(oversized_image) past `max_pixels` (checked from the header),
    SampleError(corrupt_image) for a truncated or corrupt file."""
    img = open_image(data, max_pixels)
    try:
        img.load()
        return img.convert("RGB") if img.mode != "RGB" else img
    except Exception as e:  # PIL raises many types (OSError, SyntaxError, ValueError)
        raise SampleError(CORRUPT_IMAGE, image_error(e, data)) from None


def image_error(e: Exception, data: bytes) -> str:
    """PIL's reason, without what names nothing to a user: its 'cannot identify image file <_io.BytesIO object
    at 0x...>' for bytes that are no image it knows (an empty file among them) says so and their size."""
    if isinstance(e, Image.UnidentifiedImageError):
        return f"not an image file PIL can read ({'empty: 0 bytes' if not data else f'{len(data)} bytes'})"
    return str(e)


def sample_image(sample: RawSample, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image | Any:
    """`decode_image` of the sample's image, its error naming the sample (and the file make_shards made it from,
    when recorded); the reader that counts it names the shard."""
    ext, data = image_member(sample)
    try:
        if ext == "npy":  # an H x W x C array in its own dtype (pixels.py), not a PIL image
            return decode_array(data, max_pixels)
        return decode_image(data, max_pixels)
    except SampleError as e:
        name = source_name(sample)
        raise SampleError(e.kind, f"sample '{sample.key}'{f' ({name})' if name else ''}: {e.detail}") from None


# ----------------------------------------------------------------------------- array members (pixels.py)

ARRAY_DTYPES = ("uint8", "uint16", "int16", "float32")
"""What an array member may hold: the dtypes make_shards writes and the reader normalises."""


def as_hwc(array: np.ndarray, where: str) -> np.ndarray:
    """H x W -> H x W x 1; H x W x C kept; other shapes and dtypes refused (one line naming the file)."""
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or min(array.shape) < 1:
        raise ValueError(f"{where}: expected an H x W or H x W x C array, got shape {tuple(array.shape)}")
    if array.dtype.byteorder not in ("=", "|"):
        array = array.astype(array.dtype.newbyteorder("="))
    if array.dtype.name not in ARRAY_DTYPES:
        raise ValueError(f"{where}: pixels of dtype {array.dtype.name}; expected one of {', '.join(ARRAY_DTYPES)}")
    return np.ascontiguousarray(array)


def decode_array(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """An array member back to H x W x C; SampleError(corrupt_image) for bytes that are not one (a pickled
    object array included: never unpickled) or NaN/inf pixels (counted as bad, as a corrupt JPEG is);
    SampleError(oversized_image) past `max_pixels` (H x W), as for an image."""
    try:
        array = as_hwc(np.load(io.BytesIO(data), allow_pickle=False), "array member")
    except Exception as e:  # np.load raises ValueError, EOFError, OSError, ...
        raise SampleError(CORRUPT_IMAGE, f"not a readable .npy array ({e})") from None
    if array.shape[0] * array.shape[1] > max_pixels:
        raise SampleError(OVERSIZED_IMAGE, f"{array.shape[1]}x{array.shape[0]} pixels > "
                                           f"data.max_image_pixels={max_pixels}")
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        bad = int(array.size - np.isfinite(array).sum())
        raise SampleError(CORRUPT_IMAGE, f"{bad} NaN/inf pixels")
    return array


SOURCE_MEMBER = "src"  # make_shards' KEY.src: the file a sample came from, relative to the --source folder


def source_name(sample: RawSample) -> str | None:
    """The name of the file `sample` was made from, as make_shards recorded it (KEY.src); None for shards
    written before it did, by others, or from a source of no files."""
    raw = sample.members.get(SOURCE_MEMBER)
    return raw.decode("utf-8", errors="replace") if raw is not None else None


def parse_label(sample: RawSample, label_key: str, num_classes: int | None = None) -> int:
    """The integer label at `label_key`: a member ('cls', 'txt') or 'json' / 'json:FIELD'; '' reads no
    label and gives -1 (label-free shards, and MAE, which uses none)."""
    if not label_key:
        return -1
    ext, _, json_field = label_key.partition(":")
    if ext == "json" and not json_field:
        json_field = "label"
    raw = sample.members.get(ext)
    if raw is None:
        raise SampleError(MISSING_LABEL, f"sample '{sample.key}' has no '.{ext}' member")
    if json_field:
        try:
            value = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SampleError(BAD_LABEL, f"sample '{sample.key}': .json is not valid JSON ({e})") from None
        for part in json_field.split("."):
            if not isinstance(value, dict) or part not in value:
                raise SampleError(MISSING_LABEL, f"sample '{sample.key}': .json has no field '{json_field}'")
            value = value[part]
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise SampleError(BAD_LABEL, f"sample '{sample.key}': label {value!r} is not an integer")
        text = str(value)
    else:
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise SampleError(BAD_LABEL, f"sample '{sample.key}': label is not text") from None
    try:
        label = int(text)
    except ValueError:
        raise SampleError(BAD_LABEL, f"sample '{sample.key}': label {text[:40]!r} is not an integer") from None
    if label < 0 or (num_classes is not None and label >= num_classes):
        raise SampleError(BAD_LABEL, f"sample '{sample.key}': label {label} outside [0, {num_classes})")
    return label


def decode(raw: RawSample, label_key: str, num_classes: int | None, max_pixels: int = MAX_IMAGE_PIXELS
           ) -> tuple[Image.Image, int]:
    """(RGB image, label) or SampleError; the label and the image's size are checked before the (costly)
    decode."""
    label = parse_label(raw, label_key, num_classes)
    return sample_image(raw, max_pixels), label
