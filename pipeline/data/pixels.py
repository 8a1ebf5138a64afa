"""Pixels as they are: images that are not 8-bit RGB (16-bit PNG, TIFF, NumPy arrays, DICOM), stored losslessly.

make_shards reads such a file into an H x W x C array in its own dtype (`read_pixels`) and writes it as a `.npy`
tar member (`ARRAY_MEMBER`, `encode_array`); the reader turns the member back into that array (`decode_array`).
8-bit RGB (and 8-bit grey) JPEG/PNG keep their own members: no existing data set changes.

While writing, `ChannelStats` gathers each channel's mean and standard deviation in the pixels' own units, exact
over the split (per-sample means and squared deviations in float64, merged with Chan et al.'s pairwise update:
sums of squares alone lose digits when the mean is large next to the spread, as 16-bit CT values are).
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .bad import DataError
from .tario import ARRAY_DTYPES, as_hwc, decode_array  # noqa: F401 (the reader's half, in tario: no cycle)

ARRAY_MEMBER = "npy"
TIFF_EXTS = (".tif", ".tiff")
ARRAY_SOURCE_EXTS = {".npy", ".dcm", *TIFF_EXTS}
"""Folder files read by `read_pixels` always (a PNG only when it is not 8-bit, see `is_8bit_png`)."""


@dataclass
class Pixels:
    """One image's pixels, H x W x C in their own dtype, and the channel names where the file has them."""
    array: np.ndarray
    channel_names: list[str] | None = None


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


# ----------------------------------------------------------------------------- what a run makes of them


def set_channels(info: Any) -> int:
    """The channels of a data set's samples as the reader gives them (pipeline.data.DatasetInfo): dataset.json's
    `channels`, 3 for a set that does not say (8-bit RGB, written before it did, or by others)."""
    return int(info.pixels.get("channels", 3))


def resolve_data(cfg: Any, info: Any) -> Any:
    """The DataConfig with data.mean/std as the set needs them (None: dataset.json's), their length checked
    against its channels, and what is defined for 8-bit RGB only refused on an array set: one line each."""
    channels, array = set_channels(info), info.image_format == ARRAY_MEMBER
    what = f"{info.path} holds {channels}-channel {info.pixels.get('dtype', 'uint8')} images"
    if array:
        for key in COLOUR_KEYS:
            if getattr(cfg, key):
                raise DataError(f"data.{key}={getattr(cfg, key)!r}: colour transforms are defined for 8-bit RGB, "
                                f"and {what} (arrays): unset data.{key}")
        if cfg.decode_device == "cuda":
            raise DataError(f"data.decode_device=cuda decodes JPEG on the GPU, and {what} (arrays): use cpu")
    values = {}
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    for key in ("mean", "std"):
        value = getattr(cfg, key)
        if array and value is not None and tuple(value) == tuple(defaults[key] or ()):
            # The default is 8-bit RGB's, in [0, 1] units: an array set's pixels are in their own (uint16 counts,
            # Hounsfield units), where it would normalise silently wrong. Its default is dataset.json's statistics.
            value = None
        if value is None:
            value = info.pixels.get(key)
            if value is None:
                raise DataError(f"data.{key}: null takes dataset.json's statistics, and {info.path} has none "
                                f"(an 8-bit RGB set: set data.{key}, e.g. [0.5, 0.5, 0.5])")
            if key == "std":  # a constant channel (std 0): centred by its mean, left unscaled
                value = [v if v > 0 else 1.0 for v in value]
        if len(value) != channels:
            raise DataError(f"data.{key} has {len(value)} values and {what} (data.{key}: null takes "
                            f"dataset.json's statistics)")
        values[key] = tuple(float(v) for v in value)
    if min(values["std"]) <= 0:
        raise DataError(f"data.std must be positive, got {list(values['std'])}")
    return dataclasses.replace(cfg, **values)


CROP_SECTIONS = {"dinov2": "dino", "dinov3": "dinov3"}
"""The objectives whose multi-crop (pipeline/data/multicrop.py) has colour transforms, and their config section."""
COLOUR_KEYS = ("color_jitter", "auto_augment")  # data.* transforms defined for 8-bit RGB only
COLOUR_PROBABILITIES = ("color_jitter_p", "greyscale_p", "solarize_p")


def _without_colour(cfg: Any, name: str, what: str) -> Any:
    """The multi-crop's colour transforms off for an array set: a probability at the recipe's default becomes 0
    (as data.mean/std's RGB default becomes the set's own), one set to anything else but 0 is one line."""
    section = getattr(cfg, name)
    defaults = {f.name: f.default for f in dataclasses.fields(section)}
    off = {}
    for key in COLOUR_PROBABILITIES:
        value = getattr(section, key)
        if value and value != defaults[key]:
            raise DataError(f"{name}.{key}={value}: colour transforms are defined for 8-bit RGB, and {what} "
                            f"(arrays): set {name}.{key}=0")
        off[key] = 0.0
    return dataclasses.replace(cfg, **{name: dataclasses.replace(section, **off)})


def resolve_pixels(cfg: Any, info: Any) -> Any:
    """The run's Config with data.mean/std resolved (`resolve_data`) and model.in_chans the set's channels when
    unset; a model.in_chans other than the set's is one line, before anything is built."""
    channels = set_channels(info)
    if info.image_format == ARRAY_MEMBER and cfg.model.objective not in ("supervised", "mae", *CROP_SECTIONS):
        raise DataError(f"model.objective={cfg.model.objective}: {info.path} holds array images ({channels} "
                        f"channels); the supervised, MAE, DINOv2 and DINOv3 objectives read them (issue 62)")
    if info.image_format == ARRAY_MEMBER and cfg.model.objective in CROP_SECTIONS:
        cfg = _without_colour(cfg, CROP_SECTIONS[cfg.model.objective], f"{info.path} holds {channels}-channel "
                                                                        f"{info.pixels.get('dtype')} images")
    if cfg.model.in_chans is not None and cfg.model.in_chans != channels:
        raise DataError(f"model.in_chans={cfg.model.in_chans}, and {info.path} holds {channels}-channel images "
                        f"(leave model.in_chans unset to take the data set's)")
    # An RGB set's run keeps model.in_chans unset: its config.yaml reads as before, a resume compares alike.
    model = dataclasses.replace(cfg.model, in_chans=channels if channels != 3 else cfg.model.in_chans)
    return dataclasses.replace(cfg, model=model, data=resolve_data(cfg.data, info))


def for_model(cfg: Any, info: Any, in_chans: int, where: str) -> Any:
    """The DataConfig a trained model reads a set with (launch/evaluate.py, launch/embed.py): the set's channels the
    model's (one line naming `where` otherwise, before anything is read), data.mean/std as `resolve_data` makes them
    (a weights file's default on an array set: dataset.json's statistics)."""
    channels = set_channels(info)
    if channels != in_chans:
        raise DataError(f"{where}: {info.path} holds {channels}-channel images and the model takes {in_chans} "
                        f"(its model.in_chans); give a set of the channels it was trained on")
    return resolve_data(cfg, info)
