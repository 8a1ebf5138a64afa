"""Inputs from others run no code and cannot exhaust memory (issue 30), each with real files and processes:
`pipe:` shard names only with the opt-in, unreadable schemes refused at start, decompression bombs counted
and never decoded, damaged indexes rebuilt, DeepSpeed pickles carrying code never unpickled, and a refused
fine-tune source leaving nothing that blocks the corrected command."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.config import DataConfig
from pipeline.data import DataError, build_eval_loader, build_train_loader, tario
from pipeline.data.index import INDEX_SUFFIX, Indexes
from pipeline.data.shards import ShardWriter

ROOT = Path(__file__).resolve().parents[2]
IMG = 16


def png(value: int, size: int = 8) -> bytes:
    rng = np.random.default_rng(value)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def bomb_png(side: int = 12000) -> bytes:
    """A real, decodable grey PNG of side x side pixels (144 MP at 12000) that is a few hundred KB: zeros
    compress ~1000:1. Written chunk by chunk, never held whole."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    z = zlib.compressobj(9)
    row = b"\x00" * (side + 1)  # filter byte + one byte per pixel
    body = b"".join(z.compress(row * 100) for _ in range(side // 100)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", body) + chunk(b"IEND", b""))


def dataset(folder: Path, n: int = 16, names: list[str] | None = None, image=png) -> Path:
    """One shard of n labelled PNGs (+ its index) and a dataset.json listing it as train and val, under
    `names` when given (e.g. a pipe: command)."""
    w = ShardWriter(folder, "train", max_samples=n)
    for i in range(n):
        w.write(f"{i:06d}", {"png": image(i), "cls": b"0"})
    rec = w.close()[0]
    shards = [{"name": name, "num_samples": n} for name in (names or [rec.name])]
    info = {"num_classes": 2, "class_names": ["a", "b"], "splits": {
        s: {"num_samples": n * len(shards), "shards": shards} for s in ("train", "val")}}
    (folder / "dataset.json").write_text(json.dumps(info))
    return folder / rec.name


def cfg_for(path: Path, **kw) -> DataConfig:
    return DataConfig(**{"path": str(path), "num_workers": 0, "shuffle_span": 8, "cache_dir": str(path / "cache"),
                         **kw})


# ----------------------------------------------------------------------------- shard names


def test_a_pipe_shard_runs_only_with_the_opt_in(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    shard = tmp_path / "train-000000.tar"
    dataset(tmp_path, names=[f"pipe:touch {marker}; cat {shard}"])
    for build in (build_train_loader, build_eval_loader):
        with pytest.raises(DataError) as e:
            build(cfg_for(tmp_path), IMG, 4, seed=0) if build is build_train_loader else build(cfg_for(tmp_path), IMG, 4)
        assert "\n" not in str(e.value) and "a shell command; not run" in str(e.value), str(e.value)
        assert "data.allow_pipe_shards=true" in str(e.value) and f"touch {marker}" in str(e.value)
    assert not marker.exists()

    # webdataset's own switch refuses them whatever the config says (checked in a fresh interpreter: it is
    # read at import)
    code = (f"from pipeline.data import build_train_loader, DataError; from pipeline.config import DataConfig\n"
            f"try: build_train_loader(DataConfig(path={str(tmp_path)!r}, num_workers=0, allow_pipe_shards=True, "
            f"cache_dir={str(tmp_path / 'c')!r}), {IMG}, 4, seed=0)\n"
            f"except DataError as e: print(e)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "WDS_SECURE": "1"}, capture_output=True,
                         text=True, timeout=120)
    assert "WDS_SECURE=1 is set" in out.stdout, out.stdout + out.stderr
    assert not marker.exists()

    loader = build_train_loader(cfg_for(tmp_path, allow_pipe_shards=True), IMG, 4, seed=0)
    images, _ = next(loader)
    assert marker.exists() and images.shape == (4, 3, IMG, IMG) and loader.bad_counts() == {}


@pytest.mark.parametrize("name", ["s3://bucket/train-0.tar", "ftp://host/train-0.tar", "gs://b/t.tar",
                                  "hf://datasets/x/t.tar"])
def test_a_scheme_we_cannot_read_is_one_line_at_start(tmp_path: Path, name: str) -> None:
    dataset(tmp_path, names=["train-000000.tar", name])
    with pytest.raises(DataError) as e:
        build_train_loader(cfg_for(tmp_path), IMG, 4, seed=0)
    scheme = name.split("://")[0]
    assert str(e.value) == (f"{tmp_path / 'dataset.json'}: split 'train' names shard '{name}': scheme '{scheme}://' "
                            f"is not one this pipeline reads (local paths, http://, https://); copy the shards to "
                            f"one of them")


# ----------------------------------------------------------------------------- decompression bombs


DECODE = """
import resource, sys
from pipeline.data import tario
from pipeline.data.index import Indexes
raw = Indexes(None, 1).load(sys.argv[1], int(sys.argv[2]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    tario.decode(raw, "cls", 2)
    kind = "ok"
except tario.SampleError as e:
    kind = e.kind
print(kind, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_a_decompression_bomb_is_a_bad_sample_never_decoded(tmp_path: Path) -> None:
    bomb = bomb_png()
    assert len(bomb) < 1_000_000 and Image.open(io.BytesIO(bomb)).size == (12000, 12000)
    shard = dataset(tmp_path, n=4, image=lambda i: bomb if i == 1 else png(i))
    # Peak memory of a fresh process reading and decoding one sample: the bomb costs no more than a small one.
    peaks = {}
    for i in (0, 1):
        out = subprocess.run([sys.executable, "-c", DECODE, str(shard), str(i)], capture_output=True, text=True,
                             timeout=120, cwd=ROOT)
        kind, grown_mb = out.stdout.split()
        peaks[kind] = int(grown_mb)
    assert set(peaks) == {"ok", tario.OVERSIZED_IMAGE}, peaks
    assert peaks[tario.OVERSIZED_IMAGE] < peaks["ok"] + 200, peaks  # decoded, it is 144 MB grey, 432 MB RGB

    loader = build_train_loader(cfg_for(tmp_path, max_bad_fraction=0.5), IMG, 4, seed=0)
    next(loader)
    assert loader.bad_counts() == {tario.OVERSIZED_IMAGE: 1}
    # the limit is a config key: raised, the same image decodes (PIL's own refusal at twice its limit too)
    big = tario.decode_image(bomb_png(1000), max_pixels=10**6)
    assert big.size == (1000, 1000)
    with pytest.raises(tario.SampleError, match="1000x1000 = 1000000 pixels > data.max_image_pixels=999999"):
        tario.decode_image(bomb_png(1000), max_pixels=10**6 - 1)


# ----------------------------------------------------------------------------- damaged indexes


def test_a_damaged_index_is_rebuilt_not_a_traceback(tmp_path: Path) -> None:
    shard = dataset(tmp_path, n=16)
    index = Path(str(shard) + INDEX_SUFFIX)
    whole = index.read_bytes()
    expected = [Indexes(str(tmp_path / "c0"), 1).load(str(shard), i).members["png"] for i in range(16)]
    records = len(whole) - 16 * 5 * 8  # where the records start (png, cls: 5 int64 per sample)
    damaged = {
        "cut off": whole[:records + 3 * 40 + 7],  # header intact, records cut
        "garbage offset": whole[:records + 40] + struct.pack("<q", 2**40) + whole[records + 48:],
        "negative size": whole[:records + 56] + struct.pack("<q", -5) + whole[records + 64:],
        "header not JSON": whole[:20] + b"\xff" * 8 + whole[28:],
    }
    for what, data in damaged.items():
        index.write_bytes(data)
        indexes = Indexes(str(tmp_path / what), 1)
        got = [indexes.load(str(shard), i).members["png"] for i in range(16)]
        assert got == expected, what
        rebuilt = list((tmp_path / what / "index").glob("*" + INDEX_SUFFIX))
        assert len(rebuilt) == 1, what  # built in the cache; the damaged one is left as it was
        assert index.read_bytes() == data
