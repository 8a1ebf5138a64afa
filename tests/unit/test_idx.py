"""The IDX reader (`make_shards.py --source idx:DIR`, `--source fashion-mnist`) and `--classes`: small IDX files
written here, gzip and plain; each malformed file one line and nothing written; the real Fashion-MNIST where
Debian's package is installed (`make test` installs it; CI requires it)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from pipeline.data import DataError, read_dataset_info, tario
from pipeline.data.idx import FASHION_MNIST_DIR, KNOWN_CLASS_NAMES, idx_source, read_idx
from pipeline.data.tario import decode_array

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("make_shards", ROOT / "launch" / "make_shards.py")
make_shards = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_shards)


def idx_bytes(array: np.ndarray, type_code: int = 0x08) -> bytes:
    """An IDX file of `array`: two zero bytes, the type code, ndim, big-endian sizes, big-endian values."""
    header = struct.pack(">BBBB", 0, 0, type_code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_idx(folder: Path, n_train: int = 40, n_test: int = 20, size: int = 6, classes: int = 4,
              gz: bool = True) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """MNIST's four files in `folder` (random images, labels cycling over `classes`); their arrays by split."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    out = {}
    for prefix, split, n in (("train", "train", n_train), ("t10k", "val", n_test)):
        images = rng.integers(0, 256, (n, size, size), dtype=np.uint8)
        labels = (np.arange(n) % classes).astype(np.uint8)
        for kind, array, rank in (("images", images, 3), ("labels", labels, 1)):
            name = f"{prefix}-{kind}-idx{rank}-ubyte" + (".gz" if gz else "")
            data = idx_bytes(array)
            (folder / name).write_bytes(gzip.compress(data) if gz else data)
        out[split] = (images, labels)
    return out


def read_back(out: Path, split: str) -> dict[bytes, int]:
    """Each written image's bytes -> its label."""
    info = read_dataset_info(out)
    found = {}
    for shard in info.splits[split].shards:
        for raw in tario.iter_raw_samples(shard):
            ext, data = tario.image_member(raw)
            array = decode_array(data)
            assert array.shape[-1] == 1 and array.dtype == np.uint8, (ext, array.shape, array.dtype)
            found[array[..., 0].tobytes()] = tario.parse_label(raw, "cls")
    return found


@pytest.mark.parametrize("gz", [True, False], ids=["gzip", "plain"])
def test_idx_files_become_one_channel_shards_with_the_official_split(tmp_path: Path, gz: bool) -> None:
    arrays = write_idx(tmp_path / "mnist", gz=gz)
    assert make_shards.main(["--source", f"idx:{tmp_path / 'mnist'}", "--out", str(tmp_path / "out"),
                             "--max-samples-per-shard", "16", "--no-progress"]) == 0
    meta = json.loads((tmp_path / "out" / "dataset.json").read_text())
    assert (meta["channels"], meta["dtype"], meta["num_classes"]) == (1, "uint8", 4)
    assert meta["class_names"] == ["0", "1", "2", "3"]  # an unknown set: its labels
    assert {s: v["num_samples"] for s, v in meta["splits"].items()} == {"train": 40, "val": 20}
    images = arrays["train"][0].astype(np.float64)
    assert meta["mean"] == pytest.approx([images.mean()]) and meta["std"] == pytest.approx([images.std()])
    for split, (images, labels) in arrays.items():  # every image exactly once, with its label
        assert read_back(tmp_path / "out", split) == {im.tobytes(): int(lab) for im, lab in zip(images, labels)}


def test_classes_keeps_those_classes_relabelled_in_the_order_given(tmp_path: Path) -> None:
    arrays = write_idx(tmp_path / "mnist")
    assert make_shards.main(["--source", f"idx:{tmp_path / 'mnist'}", "--classes", "3,1", "--out",
                             str(tmp_path / "out"), "--no-progress"]) == 0
    meta = json.loads((tmp_path / "out" / "dataset.json").read_text())
    assert meta["class_names"] == ["3", "1"] and meta["num_classes"] == 2
    for split, (images, labels) in arrays.items():
        want = {im.tobytes(): {3: 0, 1: 1}[int(lab)] for im, lab in zip(images, labels) if lab in (3, 1)}
        assert read_back(tmp_path / "out", split) == want


def test_known_sets_are_named_by_their_folder(tmp_path: Path) -> None:
    write_idx(tmp_path / "fashion-mnist", classes=10)
    assert idx_source(tmp_path / "fashion-mnist").class_names == KNOWN_CLASS_NAMES["fashion"]


def corrupt(folder: Path, name: str, data: bytes) -> None:
    (folder / name).unlink()
    (folder / name.removesuffix(".gz")).write_bytes(data)


BAD_FILES = {
    "bad magic number": ("train-images-idx3-ubyte.gz", b"\x00\x00\x42\x03" + bytes(100),
                         r"train-images-idx3-ubyte: not an IDX file \(magic number 00004203"),
    "count that does not match the bytes": (
        "train-images-idx3-ubyte.gz", idx_bytes(np.zeros((40, 6, 6), np.uint8))[:-7],
        r"the header says 40 x 6 x 6 values of uint8 \(1456 bytes with the header\), and the file holds 1449 bytes"),
    "labels and images of different lengths": (
        "t10k-labels-idx1-ubyte.gz", idx_bytes(np.zeros(19, np.uint8)),
        r"t10k-images-idx3-ubyte.gz holds 20 images and t10k-labels-idx1-ubyte 19 labels"),
    "a missing labels file": ("train-labels-idx1-ubyte.gz", None,
                              r"train-images-idx3-ubyte.gz and no train labels file beside it"),
}


@pytest.mark.parametrize("case", BAD_FILES, ids=list(BAD_FILES))
def test_a_malformed_idx_file_is_one_line_and_nothing_is_written(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                 case: str) -> None:
    name, data, message = BAD_FILES[case]
    write_idx(tmp_path / "mnist")
    if data is None:
        (tmp_path / "mnist" / name).unlink()
    else:
        corrupt(tmp_path / "mnist", name, data)
    assert make_shards.main(["--source", f"idx:{tmp_path / 'mnist'}", "--out", str(tmp_path / "out"),
                             "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert __import__("re").search(message, err), err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_wrong_arguments_are_one_line_each(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_idx(tmp_path / "mnist")
    cases = [
        (["--source", "fashion-mnist:/nowhere"], "install Debian's package (apt-get update && apt-get install "
                                                  "dataset-fashion-mnist)"),
        (["--source", f"idx:{tmp_path / 'mnist'}", "--classes", "0,Coat"], "'Coat' is neither a label (0-3) nor"),
        (["--source", f"idx:{tmp_path / 'mnist'}", "--classes", "1,7"], "label 7 is outside"),
        (["--source", f"idx:{tmp_path / 'mnist'}", "--val-fraction", "0.1"], "keeps the set's official split"),
        (["--source", f"idx:{tmp_path / 'none'}"], "no such folder"),
    ]
    for argv, message in cases:
        assert make_shards.main([*argv, "--out", str(tmp_path / "out"), "--no-progress"]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "out").exists()


def test_read_idx_reads_other_types_in_native_order(tmp_path: Path) -> None:
    values = np.arange(-6, 6, dtype=np.int32).reshape(3, 4)
    (tmp_path / "x.idx").write_bytes(idx_bytes(values, 0x0C))
    got = read_idx(tmp_path / "x.idx")
    assert got.dtype.isnative and np.array_equal(got, values)


def test_fashion_mnist_from_debians_package() -> None:
    """The real set: 60,000 + 10,000 images of 28 x 28, ten named classes, 6,000 / 1,000 of each."""
    if not Path(FASHION_MNIST_DIR).is_dir():
        if os.environ.get("VIT_PIPELINE_REQUIRE_DATASETS") == "1":
            pytest.fail(f"{FASHION_MNIST_DIR} missing with VIT_PIPELINE_REQUIRE_DATASETS=1 "
                        f"(tests/install_datasets.sh installs dataset-fashion-mnist)")
        pytest.skip(f"{FASHION_MNIST_DIR} missing: apt-get install dataset-fashion-mnist (make test does)")
    source = make_shards.fashion_mnist_source()
    assert source.class_names[0] == "T-shirt/top" and source.class_names[9] == "Ankle boot"
    for split, n in (("train", 60000), ("val", 10000)):
        labels = np.array([it.label for it in source.splits[split]])
        assert len(labels) == n and np.array_equal(np.bincount(labels), np.full(10, n // 10))
    ext, data, info = source.encode(source.splits["train"][0])
    assert decode_array(data).shape == (28, 28, 1) and (info.channels, info.dtype) == (1, "uint8")
    with pytest.raises(DataError, match="'Sweater' is neither"):
        make_shards.keep_classes(source, ["Sweater"])
