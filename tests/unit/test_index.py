"""Per-shard sample indexes: written by make_shards, built once per machine for shards without one."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import re
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
    # Three processes of one machine, at once; not forked from this one: a fork of a process whose threads
    # (onnxruntime's allocator, OpenMP) hold a lock can deadlock in the child, as it did in the unit tier.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # imported once in the server (if this call starts it), not per child
    with ctx.Pool(3) as pool:
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
    # 16-sample shards of ~1.5 KB images: headers dominate here; at 1,000 x 110 KB it is ~0.07%. Each index
    # is read whole once (checked before use), then 40 bytes per sample read.
    assert 0 < counters.index_bytes <= 6 * (200 + 16 * 40) + 96 * 40
    assert counters.bytes >= counters.sample_bytes
    json.dumps(loader.state_dict()["counters"])  # the checkpoint's part: plain JSON, without the I/O figures
    assert "bytes" not in loader.state_dict()["counters"]


def test_a_cache_too_small_for_the_shuffle_span_stops_before_training(shards: Path, tmp_path: Path) -> None:
    from pipeline.data import DataError

    info = json.loads((shards / "dataset.json").read_text())
    for entry in info["splits"]["train"]["shards"]:  # remote: copied into the cache before reading
        entry["name"] = f"pipe:cat {shards / entry['name']}"
    piped = tmp_path / "piped"
    piped.mkdir()
    (piped / "dataset.json").write_text(json.dumps(info))
    shard_bytes = info["splits"]["train"]["shards"][0]["bytes"]
    cfg = DataConfig(path=str(piped), num_workers=0, cache_dir=str(tmp_path / "c"), cache_limit_gb=1e-6,
                     allow_pipe_shards=True)
    with pytest.raises(DataError, match=r"data.cache_limit_gb=1e-06 is too small: node 0 of 1 reads 2 partitions "
                                        r"whose shuffle spans .data.shuffle_span=262144. need ") as e:
        build_train_loader(cfg, 16, 8, seed=0, global_batch_size=16)
    # The need in a unit that does not round it to 0, and a limit to set that is not below it
    need_kib = -(-6 * shard_bytes * 10 // 1024) / 10
    said = re.search(r"need (\S+) KiB of shards at once; set data.cache_limit_gb to at least (\S+) or", str(e.value))
    assert said and float(said[1]) == need_kib, str(e.value)
    build_train_loader(dataclasses.replace(cfg, cache_limit_gb=float(said[2])), 16, 8, seed=0, global_batch_size=16)
    # 2 partitions of 3 shards: the span covers each whole partition
    from pipeline.data.loader import cache_needed_bytes
    from pipeline.data.order import GlobalOrder

    order = GlobalOrder([16] * 6, seed=0, global_batch=16)
    assert cache_needed_bytes(order, [shard_bytes] * 6, 0, 1) == 6 * shard_bytes
    assert cache_needed_bytes(order, [shard_bytes] * 6, 1, 2) == 3 * shard_bytes  # node 1 of 2: one partition
    assert cache_needed_bytes(order, [None] * 6, 0, 1) is None
    cfg.cache_limit_gb = 6 * shard_bytes / 2**30
    build_train_loader(cfg, 16, 8, seed=0, global_batch_size=16)  # just enough
    cfg.cache_limit_gb = (6 * shard_bytes - 1) / 2**30
    with pytest.raises(DataError, match="is too small"):  # a byte less is refused
        build_train_loader(cfg, 16, 8, seed=0, global_batch_size=16)


def test_a_held_copy_is_never_evicted_and_one_evicted_while_released_is_fetched_again(shards: Path,
                                                                                     tmp_path: Path) -> None:
    """Two readers of one node's cache (two Indexes: what two loader workers have) under a limit of one copy.
    A copy a reader holds stays (the cache goes over its limit rather than take it); a released one is
    evicted for the next copy, and read again it is fetched again: the same bytes, never a bad sample."""
    from pipeline.data.cache import cache_name
    from pipeline.data.reader import Indexes

    tars = sorted(shards.glob("train-*.tar"))
    names = [f"pipe:cat {t}" for t in tars[:3]]  # copied into the cache before reading
    size = tars[0].stat().st_size
    cache = tmp_path / "cache"
    first, second = (Indexes(str(cache), 1.5 * size / 2**30) for _ in range(2))
    want = first.load(names[0], 3).members
    second.load(names[1], 0)  # needs room: the held copy of names[0] is not taken
    assert (cache / cache_name(names[0])).exists() and (cache / cache_name(names[1])).exists()
    assert first.load(names[0], 3).members == want
    first.keep_only([])  # released: free to evict
    second.load(names[2], 0)  # second still holds names[1]: names[0] goes
    assert not (cache / cache_name(names[0])).exists() and (cache / cache_name(names[1])).exists()
    assert first.load(names[0], 3).members == want  # fetched again, read as before
    assert (cache / cache_name(names[0])).exists() and not first.errors
    first.close()
    second.close()


@pytest.mark.parametrize("env,expected", [
    ({}, (0, 1, "single")),
    ({"CROSS_RANK": "2", "CROSS_SIZE": "4", "LOCAL_SIZE": "8", "SLURM_NODEID": "0", "SLURM_NNODES": "4"},
     (2, 4, "deepspeed")),
    ({"GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "6"}, (1, 3, "torchrun")),
    ({"SLURM_NODEID": "3", "SLURM_NNODES": "5"}, (3, 5, "slurm")),
])
def test_node_place_from_the_launchers_environment(env: dict[str, str], expected: tuple) -> None:
    from pipeline.data.nodes import node_place

    place = node_place(env)
    assert (place.node, place.nodes, place.source) == expected
    with pytest.raises(ValueError, match="CROSS_RANK='x' is not an integer"):
        node_place({"CROSS_RANK": "x", "CROSS_SIZE": "2"})


def test_fetch_ahead_copies_the_coming_shards_within_the_budget(shards: Path, tmp_path: Path) -> None:
    import time

    from pipeline.data.fetch import plan, upcoming_shards
    from pipeline.data.order import GlobalOrder

    order = GlobalOrder([16] * 6, seed=0, global_batch=8, partitions=2, span=20)
    first = upcoming_shards(order, 0, 2, 0, 100)  # rank 0 of 2: partition 0's three shards
    assert sorted(first.tolist()) == sorted(order.shards[0].tolist())
    assert plan(order, [100] * 6, 0, 2, 0, 250) == first[:2].tolist()  # two shards fit in 250 bytes
    assert plan(order, [100] * 6, 0, 2, 0, 10**6) == first.tolist()

    info = json.loads((shards / "dataset.json").read_text())
    for entry in info["splits"]["train"]["shards"]:
        entry["name"] = f"pipe:cat {shards / entry['name']}"
    piped = tmp_path / "piped"
    piped.mkdir()
    (piped / "dataset.json").write_text(json.dumps(info))
    for fetch_ahead in (False, True):
        cache = tmp_path / f"cache-{fetch_ahead}"
        cfg = DataConfig(path=str(piped), num_workers=0, cache_dir=str(cache), fetch_ahead=fetch_ahead,
                         partitions=2, shuffle_span=16, hflip=0.0, allow_pipe_shards=True)
        loader = build_train_loader(cfg, 16, 4, seed=0, global_batch_size=4)
        next(loader)  # one micro batch of 4 samples: at most 4 shards read
        deadline = time.monotonic() + 20
        while fetch_ahead and len(list(cache.glob("*.tar"))) < 6 and time.monotonic() < deadline:
            time.sleep(0.1)
        copies = len(list(cache.glob("*.tar")))
        assert copies == 6 if fetch_ahead else copies <= 4, (fetch_ahead, copies)
        if loader.fetcher is not None:
            loader.fetcher.stop()
            assert not loader.fetcher.process.is_alive()


def test_the_fetch_process_ends_on_terminate_whatever_the_ranks_signal_handlers(tmp_path: Path) -> None:
    import signal

    from pipeline.data.fetch import FetchAhead
    from pipeline.data.order import GlobalOrder

    old = signal.signal(signal.SIGTERM, lambda *a: None)  # as the rank's preemption handler: SIGTERM raises a flag
    try:
        fetcher = FetchAhead(GlobalOrder([16] * 4, seed=0, global_batch=8), ["pipe:false"] * 4, [None] * 4, 0, 1,
                             str(tmp_path), 1 << 20, 1 << 20)
        assert fetcher.ready.wait(timeout=30)
        fetcher.process.terminate()
        fetcher.process.join(timeout=10)
        assert fetcher.process.exitcode == -signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, old)


def test_the_index_and_the_streamed_reader_number_samples_alike(tmp_path: Path) -> None:
    """Both group tar members into samples with tario.member_key: a directory, a `__` member, a member
    with no extension, upper-case extensions, a key that comes back after another (a new sample) and
    multi-dot extensions give the same keys, numbers and members either way."""
    import io
    import tarfile

    from pipeline.data import tario

    names = ["d/", "__index__.json", "README", "a.jpg", "a.CLS", "b.seg.png", "b.cls", "a.jpg", "a.cls",
             "c.JPG", "c.cls"]
    path = tmp_path / "odd.tar"
    with tarfile.open(path, "w") as tar:
        for i, name in enumerate(names):
            info = tarfile.TarInfo(name.rstrip("/"))
            if name.endswith("/"):
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
                continue
            data = f"{i}".encode()
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    streamed = [(s.key, s.index, s.members) for s in tario.iter_raw_samples(str(path))]
    assert [(k, i, sorted(m)) for k, i, m in streamed] == [
        ("a", 0, ["cls", "jpg"]), ("b", 1, ["cls", "seg.png"]), ("a", 2, ["cls", "jpg"]), ("c", 3, ["cls", "jpg"])]
    scanned, truncated = index.scan(str(path), str(path))
    assert truncated is None
    assert [(s.key, sorted(s.members)) for s in scanned] == [(k, sorted(m)) for k, _, m in streamed]
    with open(path, "rb") as f:  # the offsets the index records point at the streamed bytes
        for s, (_, _, members) in zip(scanned, streamed, strict=True):
            for ext, (offset, size) in s.members.items():
                f.seek(offset)
                assert f.read(size) == members[ext]
