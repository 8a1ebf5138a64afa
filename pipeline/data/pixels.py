"""Pixels as they are: images that are not 8-bit RGB (16-bit PNG, TIFF, NumPy arrays, DICOM), stored losslessly.

make_shards reads such a file into an H x W x C array in its own dtype (`read_pixels`) and writes it as a `.npy`
tar member (`ARRAY_MEMBER`, `encode_array`); the reader turns the member back into that array (`decode_array`).
8-bit RGB (and 8-bit grey) JPEG/PNG keep their own members: no existing data set changes.

While writing, `ChannelStats` gathers each channel's mean and standard deviation in the pixels' own units, exact
over the split (per-sample means and squared deviations in float64, merged with Chan et al.'s pairwise update:
sums of squares alone lose digits when the mean is large next to the spread, as 16-bit CT values are).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import tario
from .bad import DataError

ARRAY_MEMBER = "npy"
ARRAY_DTYPES = ("uint8", "uint16", "int16", "float32")
"""What an array member may hold: the dtypes make_shards writes and the reader normalises."""
TIFF_EXTS = (".tif", ".tiff")
ARRAY_SOURCE_EXTS = {".npy", ".dcm", *TIFF_EXTS}
"""Folder files read by `read_pixels` always (a PNG only when it is not 8-bit, see `is_8bit_png`)."""


@dataclass
class Pixels:
    """One image's pixels, H x W x C in their own dtype, and the channel names where the file has them."""
    array: np.ndarray
    channel_names: list[str] | None = None


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


def _read_npy(path: Path) -> Pixels:
    return Pixels(np.load(path, allow_pickle=False))  # no pickle: a .npy from elsewhere runs no code


def _read_tiff(path: Path) -> Pixels:
    """Every axis other than Y and X (pages, bands, samples) becomes channels, in the file's order."""
    import tifffile

    with tifffile.TiffFile(path) as tif:
        series = tif.series[0]
        array, axes = series.asarray(), series.axes
        names = [p.tags["PageName"].value for p in tif.pages if "PageName" in p.tags]
    if "Y" not in axes or "X" not in axes:
        raise ValueError(f"{path}: TIFF axes '{axes}' have no Y and X")
    order = [axes.index("Y"), axes.index("X")] + [i for i, a in enumerate(axes) if a not in "YX"]
    array = array.transpose(order).reshape(array.shape[order[0]], array.shape[order[1]], -1)
    return Pixels(array, names if len(names) == array.shape[2] else None)


def _read_dicom(path: Path) -> Pixels:
    """The stored values through RescaleSlope/RescaleIntercept (Hounsfield units for CT), as float32 (exact for
    the integers CT holds); the window (WindowCenter/Width) is a display choice, left to normalisation."""
    import pydicom

    ds = pydicom.dcmread(path)
    array = ds.pixel_array
    if int(getattr(ds, "NumberOfFrames", 1) or 1) > 1 and int(getattr(ds, "SamplesPerPixel", 1)) == 1:
        array = np.moveaxis(array, 0, -1)  # frames -> channels, as a multi-page TIFF's pages
    slope, intercept = float(getattr(ds, "RescaleSlope", 1) or 1), float(getattr(ds, "RescaleIntercept", 0) or 0)
    if (slope, intercept) != (1.0, 0.0):
        array = (array.astype(np.float64) * slope + intercept).astype(np.float32)
    elif array.dtype.name not in ARRAY_DTYPES:
        array = array.astype(np.float32)
    return Pixels(array)


def _read_png16(path: Path) -> Pixels:
    from PIL import Image

    with Image.open(path) as img:
        if img.mode not in ("I;16", "I;16B", "I;16L", "I"):
            raise ValueError(f"{path}: a {img.mode} PNG of 16 bits is read by PIL as 8 bits; "
                             f"write it as a TIFF or a .npy to keep its bits")
        array = np.array(img)
    return Pixels(array.astype(np.uint16) if array.dtype != np.uint16 else array)


def is_8bit_png(data: bytes) -> bool:
    """From the PNG header (IHDR's bit depth, byte 24): 16-bit PNGs go through `read_pixels`; 8-bit ones keep
    today's png member (PIL reads them to RGB as before)."""
    return not (data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 24 and data[24] == 16)


def read_pixels(path: str | Path) -> Pixels:
    """The file's pixels, H x W x C in their own dtype, by extension (.npy, .tif/.tiff, .dcm, 16-bit .png);
    ValueError (or the reader's own error) for a file that is not what its extension says."""
    path = Path(path)
    ext = path.suffix.lower()
    read = {".npy": _read_npy, ".dcm": _read_dicom, ".png": _read_png16}.get(ext)
    pixels = (read or _read_tiff)(path) if (read or ext in TIFF_EXTS) else None
    if pixels is None:
        raise ValueError(f"{path}: not a kind read as an array (.npy, .tif, .tiff, .dcm, 16-bit .png)")
    pixels.array = as_hwc(pixels.array, str(path))
    return pixels


def encode_array(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def decode_array(data: bytes) -> np.ndarray:
    """An array member back to H x W x C; SampleError(corrupt_image) for bytes that are not one (a pickled
    object array included: never unpickled) or NaN/inf pixels (counted as bad, as a corrupt JPEG is)."""
    try:
        array = as_hwc(np.load(io.BytesIO(data), allow_pickle=False), "array member")
    except Exception as e:  # np.load raises ValueError, EOFError, OSError, ...
        raise tario.SampleError(tario.CORRUPT_IMAGE, f"not a readable .npy array ({e})") from None
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        bad = int(array.size - np.isfinite(array).sum())
        raise tario.SampleError(tario.CORRUPT_IMAGE, f"{bad} NaN/inf pixels")
    return array


# ----------------------------------------------------------------------------- statistics


@dataclass
class ChannelStats:
    """Per-channel pixel count, mean and sum of squared deviations (M2), float64; `add` one image, `merge` the
    stats of another writer process; `std` is NumPy's (ddof=0) over every pixel added."""
    count: int = 0
    mean: np.ndarray = field(default_factory=lambda: np.zeros(0))
    m2: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @classmethod
    def of(cls, array: np.ndarray) -> ChannelStats:
        flat = array.reshape(-1, array.shape[-1]).astype(np.float64)
        mean = flat.mean(axis=0)
        return cls(flat.shape[0], mean, ((flat - mean) ** 2).sum(axis=0))

    def merge(self, other: ChannelStats) -> ChannelStats:
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        n = self.count + other.count
        delta = other.mean - self.mean
        return ChannelStats(n, self.mean + delta * (other.count / n),
                            self.m2 + other.m2 + delta**2 * (self.count * other.count / n))

    def std(self) -> np.ndarray:
        return np.sqrt(self.m2 / self.count)


@dataclass
class SampleInfo:
    """What the writer learns of one sample's pixels (computed in the encoding process, merged in the writer)."""
    channels: int
    dtype: str
    channel_names: list[str] | None = None
    stats: ChannelStats | None = None
    """None: not gathered (8-bit RGB members: their runs keep today's ImageNet default)."""


RGB8 = SampleInfo(3, "uint8")
"""A jpg/png member: PIL decodes it to 8-bit RGB, whatever the file's mode."""


@dataclass
class PixelSummary:
    """What dataset.json says of a split's pixels: channels, dtype, channel names, mean and std (arrays only)."""
    channels: int | None = None
    dtype: str | None = None
    channel_names: list[str] | None = None
    stats: ChannelStats = field(default_factory=ChannelStats)
    first: str = ""  # the first sample's file, named when a later one disagrees

    def add(self, info: SampleInfo, where: str, with_stats: bool) -> None:
        """One written sample; a data set has one channel count and one dtype (a DataError otherwise)."""
        channels, dtype, names = info.channels, info.dtype, info.channel_names
        if self.channels is None:
            self.channels, self.dtype, self.channel_names, self.first = channels, dtype, names, where
        elif (channels, dtype) != (self.channels, self.dtype):
            raise DataError(f"{where}: {channels} channels of {dtype}, but {self.first} has {self.channels} "
                            f"of {self.dtype}; a data set holds one channel count and one dtype")
        elif names != self.channel_names:
            self.channel_names = None  # names that differ name nothing
        if with_stats and info.stats is not None:
            self.stats = self.stats.merge(info.stats)

    def json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"channels": self.channels, "dtype": self.dtype}
        if self.channel_names:
            out["channel_names"] = self.channel_names
        if self.stats.count:
            out["mean"] = [float(v) for v in self.stats.mean]
            out["std"] = [float(v) for v in self.stats.std()]
        return out
