"""Pixels as they are (issue 62): 16-bit PNG, multi-band TIFF, .npy and DICOM through make_shards, stored
losslessly and read back pixel for pixel; dataset.json's channels, dtype and per-channel statistics."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.data import DataError, tario
from pipeline.data.pixels import ChannelStats, decode_array
from pipeline.data.shards import folder_source, write_dataset

QUIET = dict(progress=False, log=lambda s: None)


def write_set(root: Path, files: dict[str, np.ndarray], out: Path, workers: int = 1) -> dict:
    """Write each array to root/NAME by its extension, make shards of the folder (all train), return dataset.json."""
    import tifffile

    for name, array in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".npy":
            np.save(path, array)
        elif path.suffix == ".png":
            Image.fromarray(array).save(path)
        elif path.suffix == ".tif":  # the three layouts: bands as pages, bands in each pixel, named pages
            layout = int(path.stem) % 3
            if layout < 2:
                tifffile.imwrite(path, np.moveaxis(array, -1, 0) if layout == 0 else array,
                                 photometric="minisblack", planarconfig=None if layout == 0 else "contig")
            else:
                with tifffile.TiffWriter(path) as tif:
                    for c in range(array.shape[-1]):  # 285: PageName
                        tif.write(array[..., c], photometric="minisblack", metadata=None,
                                  extratags=[(285, "s", 0, f"band{c}", True)])
    write_dataset(folder_source(str(root), val_fraction=0.0), out, max_samples_per_shard=3, workers=workers,
                  **QUIET)
    return json.loads((out / "dataset.json").read_text())


def read_back(out: Path) -> dict[str, np.ndarray]:
    """Every sample's pixels as stored, by the file it came from."""
    got = {}
    for shard in sorted(out.glob("train-*.tar")):
        for raw in tario.iter_raw_samples(str(shard)):
            got[tario.source_name(raw)] = decode_array(raw.members["npy"])
    return got


def assert_stats(info: dict, arrays: list[np.ndarray]) -> None:
    every = np.concatenate([a.reshape(-1, a.shape[-1]).astype(np.float64) for a in arrays])
    np.testing.assert_allclose(info["mean"], every.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(info["std"], every.std(axis=0), rtol=1e-6)


def rng_arrays(n: int, shape: tuple[int, ...], dtype: str, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype == "float32":
        # A large offset next to the spread: sums of squares alone would lose the std's digits.
        return [(rng.normal(1000.0, 0.5, shape)).astype(np.float32) for _ in range(n)]
    hi = 65536 if dtype == "uint16" else 256
    return [rng.integers(0, hi, shape).astype(dtype) for _ in range(n)]


@pytest.mark.parametrize("dtype,channels", [("uint16", 1), ("uint16", 4), ("float32", 13), ("float32", 1),
                                            ("uint8", 4)])
def test_npy_round_trip_and_statistics(tmp_path, dtype, channels):
    arrays = rng_arrays(5, (6, 7, channels), dtype)
    files = {f"c{i % 2}/{i}.npy": a for i, a in enumerate(arrays)}
    info = write_set(tmp_path / "src", files, tmp_path / "out")
    assert (info["channels"], info["dtype"]) == (channels, dtype)
    got = read_back(tmp_path / "out")
    for name, array in files.items():
        assert got[name].dtype == array.dtype and np.array_equal(got[name], array)
    assert_stats(info, arrays)


def test_hw_npy_is_one_channel(tmp_path):
    arrays = rng_arrays(3, (5, 4), "uint16")
    info = write_set(tmp_path / "src", {f"{i}.npy": a for i, a in enumerate(arrays)}, tmp_path / "out")
    assert info["channels"] == 1 and info["mean"] == pytest.approx([np.mean(arrays, dtype=np.float64)], rel=1e-6)


def test_png16_and_multiband_tiff(tmp_path):
    grey = rng_arrays(4, (9, 8), "uint16", seed=1)
    info = write_set(tmp_path / "png", {f"{i}.png": a for i, a in enumerate(grey)}, tmp_path / "png_out")
    assert (info["channels"], info["dtype"]) == (1, "uint16")
    got = read_back(tmp_path / "png_out")
    assert all(np.array_equal(got[f"{i}.png"][..., 0], a) for i, a in enumerate(grey))
    assert_stats(info, [a[..., None] for a in grey])

    bands = rng_arrays(3, (8, 6, 4), "uint16", seed=2)
    info = write_set(tmp_path / "tif", {f"{i}.tif": a for i, a in enumerate(bands)}, tmp_path / "tif_out")
    assert (info["channels"], info["dtype"]) == (4, "uint16")
    assert "channel_names" not in info  # one file of the three names its pages: names that differ name nothing
    got = read_back(tmp_path / "tif_out")
    assert all(np.array_equal(got[f"{i}.tif"], a) for i, a in enumerate(bands))
    assert_stats(info, bands)
    named = {f"{3 * i + 2}.tif": a for i, a in enumerate(bands)}
    info = write_set(tmp_path / "named", named, tmp_path / "named_out")
    assert info["channel_names"] == ["band0", "band1", "band2", "band3"]


def test_dicom_after_its_rescale(tmp_path):
    pydicom = pytest.importorskip("pydicom")
    path = pydicom.data.get_testdata_file("CT_small.dcm")
    ds = pydicom.dcmread(path)
    expected = (ds.pixel_array.astype(np.float64) * float(ds.RescaleSlope) + float(ds.RescaleIntercept))
    assert float(ds.RescaleIntercept) != 0  # the rescale is exercised, not the identity
    (tmp_path / "src").mkdir()
    shutil.copy(path, tmp_path / "src" / "ct.dcm")
    write_dataset(folder_source(str(tmp_path / "src"), val_fraction=0.0), tmp_path / "out", **QUIET)
    info = json.loads((tmp_path / "out" / "dataset.json").read_text())
    assert (info["channels"], info["dtype"]) == (1, "float32")
    got = read_back(tmp_path / "out")["ct.dcm"]
    assert np.array_equal(got[..., 0].astype(np.float64), expected)
    assert_stats(info, [expected[..., None]])


def test_statistics_merged_across_writer_processes(tmp_path):
    arrays = rng_arrays(40, (4, 5, 3), "float32", seed=3)
    files = {f"{i:02d}.npy": a for i, a in enumerate(arrays)}
    one = write_set(tmp_path / "src", files, tmp_path / "one")
    two = write_set(tmp_path / "src", {}, tmp_path / "two", workers=2)
    assert_stats(two, arrays)
    np.testing.assert_allclose(two["mean"], one["mean"], rtol=1e-12)


def test_chan_merge_is_the_whole_sets():
    a, b = np.random.default_rng(4).normal(5e4, 2.0, (2, 30, 3))
    merged = ChannelStats.of(a).merge(ChannelStats.of(b))
    np.testing.assert_allclose(merged.std(), np.concatenate([a, b]).std(axis=0), rtol=1e-9)


def test_rgb_sets_unchanged_and_mixed_sets_refused(tmp_path):
    rgb = rng_arrays(2, (6, 6, 3), "uint8")
    root = tmp_path / "rgb"
    root.mkdir()
    for i, a in enumerate(rgb):
        Image.fromarray(a).save(root / f"{i}.png")
    write_dataset(folder_source(str(root), val_fraction=0.0), tmp_path / "rgb_out", **QUIET)
    info = json.loads((tmp_path / "rgb_out" / "dataset.json").read_text())
    assert (info["image_format"], info["channels"], info["dtype"]) == ("png", 3, "uint8") and "mean" not in info
    np.save(root / "x.npy", rng_arrays(1, (6, 6), "uint16")[0])
    with pytest.raises(DataError, match="x.npy: 1 channels of uint16, but .* 3 of uint8"):
        write_dataset(folder_source(str(root), val_fraction=0.0), tmp_path / "mixed", **QUIET)


def test_nan_pixels_skipped_when_writing_and_bad_when_read(tmp_path):
    arrays = rng_arrays(3, (4, 4, 2), "float32")
    arrays[1][0, 0, 1] = np.nan
    info = write_set(tmp_path / "src", {f"{i}.npy": a for i, a in enumerate(arrays)}, tmp_path / "out")
    assert info["splits"]["train"]["num_samples"] == 2
    assert_stats(info, [arrays[0], arrays[2]])
    import io
    buf = io.BytesIO()
    np.save(buf, arrays[1])
    with pytest.raises(tario.SampleError, match="1 NaN/inf pixels"):
        decode_array(buf.getvalue())
