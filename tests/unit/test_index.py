"""Per-shard sample indexes: written by make_shards, built once per machine for shards without one."""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
from pathlib import Path

import pytest

from pipeline.config import DataConfig
from pipeline.data import build_train_loader, index
from pipeline.data.shards import synthetic_source, write_dataset

QUIET = dict(progress=False, log=lambda s: None)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("idx")
    write_dataset(synthetic_source(96, 3, 16, val_fraction=0.0), out, max_samples_per_shard=16, **QUIET)
    return out


def test_make_shards_writes_the_index_a_scan_would_build(shards: Path) -> None:
    tars = sorted(shards.glob("*.tar"))
    assert len(tars) == 6
    for tar in tars:
        written = Path(str(tar) + index.INDEX_SUFFIX).read_bytes()
        assert written == index.build_index(str(tar), str(tar)), tar.name
        header, _ = index.read_header(str(tar) + index.INDEX_SUFFIX)
        assert header["samples"] == 16 and header["exts"] == ["cls", "jpg"]


def _read_all(folder: str, cache: str) -> list[int]:
    cfg = DataConfig(path=folder, num_workers=0, cache_dir=cache, hflip=0.0)
    loader = build_train_loader(cfg, 16, 8, seed=0)
    return [int(v) for _ in range(12) for v in next(loader)[1]]


def test_no_process_scans_a_shard_that_has_its_index(shards: Path, monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    def no_scan(*a, **k):
        raise AssertionError("scanned a shard that has an index")

    monkeypatch.setattr(index, "scan", no_scan)
    labels = _read_all(str(shards), str(tmp_path / "cache"))
    assert len(labels) == 96
    assert not (tmp_path / "cache" / "index").exists()


def test_shards_written_by_others_get_one_index_per_machine_in_the_cache(shards: Path, tmp_path: Path) -> None:
    others = tmp_path / "others"
    shutil.copytree(shards, others, ignore=shutil.ignore_patterns("*.idx"))
    cache = tmp_path / "cache"
    with mp.get_context("fork").Pool(3) as pool:  # three processes of one machine, at once
        results = pool.starmap(_read_all, [(str(others), str(cache))] * 3)
    assert results[0] == results[1] == results[2] == _read_all(str(shards), str(tmp_path / "cache2"))
    built = sorted((cache / "index").glob("*" + index.INDEX_SUFFIX))
    assert len(built) == 6  # one per shard, shared by the processes
    assert not list(others.glob("*.idx"))  # nothing written beside shards that are not ours
    # a shard rewritten since gets a new index (the old one no longer matches its size)
    tar = sorted(others.glob("*.tar"))[0]
    tar.write_bytes(tar.read_bytes() + b"\0" * 10240)
    info = json.loads((others / "dataset.json").read_text())
    info["splits"]["train"]["shards"][0]["bytes"] = tar.stat().st_size
    (others / "dataset.json").write_text(json.dumps(info))
    _read_all(str(others), str(cache))
    assert len(list((cache / "index").glob("*" + index.INDEX_SUFFIX))) == 7


def test_index_bytes_are_a_small_fraction_of_the_sample_bytes(shards: Path, tmp_path: Path) -> None:
    cfg = DataConfig(path=str(shards), num_workers=0, cache_dir=str(tmp_path), hflip=0.0)
    loader = build_train_loader(cfg, 16, 8, seed=0)
    for _ in range(12):
        next(loader)
    counters = loader.counters()
    # 16-sample shards of ~1.5 KB images: headers dominate here; at 1,000 x 110 KB it is ~0.03%
    assert 0 < counters["index_bytes"] <= 6 * 200 + 96 * 40
    assert counters["bytes"] >= counters["sample_bytes"]
    json.dumps(counters)
