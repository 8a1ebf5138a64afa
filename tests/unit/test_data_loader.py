"""Train stream and eval pass: determinism, exact resume, coverage, exactly-once eval, bad data."""

from __future__ import annotations

import io
import json
import pickle
import random
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.config import DataConfig
from pipeline.data import (
    BadDataError,
    DataError,
    build_eval_loader,
    build_train_loader,
    read_dataset_info,
    tario,
)
from pipeline.data.shards import ShardWriter, synthetic_source, write_dataset

IMG = 16


# ----------------------------------------------------------------------------- helpers


def png(value: int, size: int = 8) -> bytes:
    rng = np.random.default_rng(value)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write_info(folder: Path, splits: dict[str, list[tuple[str, int]]], num_classes: int) -> None:
    """dataset.json for shards already in `folder`: {split: [(name, num_samples)]}; bytes from the files."""
    data = {"num_classes": num_classes, "class_names": [str(i) for i in range(num_classes)], "splits": {
        split: {"num_samples": sum(n for _, n in shards),
                "shards": [{"name": name, "num_samples": n, "bytes": (folder / name).stat().st_size}
                           for name, n in shards]}
        for split, shards in splits.items()}}
    (folder / "dataset.json").write_text(json.dumps(data))


def id_dataset(folder: Path, sizes: list[int], split: str = "train") -> int:
    """Shards of the given sizes whose label is the sample's global id (so batches reveal which samples)."""
    names, i = [], 0
    for s, n in enumerate(sizes):
        w = ShardWriter(folder, f"{split}{s}", max_samples=max(n, 1))
        for _ in range(n):
            w.write(f"{i:06d}", {"png": png(i), "cls": str(i).encode()})
            i += 1
        rec = w.close()
        names.append((rec[0].name, n))
    write_info(folder, {split: names}, num_classes=i)
    return i


def cfg_for(path: Path, **kw) -> DataConfig:
    base = dict(path=str(path), num_workers=0, shuffle_buffer=8, hflip=0.5, scale=(0.5, 1.0))
    base.update(kw)
    return DataConfig(**base)


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synth")
    write_dataset(synthetic_source(240, 4, IMG, val_fraction=0.25), out, max_samples_per_shard=20,
                  progress=False, log=lambda s: None)
    return out


def take(loader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    it = iter(loader)
    return [next(it) for _ in range(n)]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


# ----------------------------------------------------------------------------- determinism and resume


def test_same_arguments_same_stream_and_different_seed_or_rank_differs(synth: Path) -> None:
    cfg = cfg_for(synth)
    first = take(build_train_loader(cfg, IMG, 8, seed=1, rank=0, world_size=2), 6)
    again = take(build_train_loader(cfg, IMG, 8, seed=1, rank=0, world_size=2), 6)
    assert same(first, again)
    other_seed = take(build_train_loader(cfg, IMG, 8, seed=2, rank=0, world_size=2), 6)
    other_rank = take(build_train_loader(cfg, IMG, 8, seed=1, rank=1, world_size=2), 6)
    assert not same(first, other_seed)
    assert not same(first, other_rank)
    assert first[0][0].shape == (8, 3, IMG, IMG) and first[0][0].dtype == torch.float32
    assert first[0][1].dtype == torch.long


@pytest.mark.parametrize("mixup", [False, True])
def test_resume_yields_exactly_the_uninterrupted_batches_with_two_workers(synth: Path, mixup: bool) -> None:
    cfg = cfg_for(synth, num_workers=2, shuffle_buffer=7, mixup=0.8 if mixup else 0.0,
                  cutmix=1.0 if mixup else 0.0, auto_augment="rand-m9-mstd0.5" if mixup else None)
    loader = build_train_loader(cfg, IMG, 6, seed=3)
    take(loader, 10)
    state = loader.state_dict()
    state = pickle.loads(pickle.dumps(state))
    assert len(pickle.dumps(state)) < 4096
    assert any(w["offset"] > 0 for w in state["workers_state"]), "resume point should be mid-shard"
    uninterrupted = take(loader, 5)

    restored = build_train_loader(cfg, IMG, 6, seed=3)
    restored.load_state_dict(state)
    resumed = take(restored, 5)
    assert same(uninterrupted, resumed)
    assert restored.soft_targets == mixup
    if mixup:
        assert resumed[0][1].shape == (6, 4) and resumed[0][1].dtype == torch.float32
    # the resumed loader's position goes on like the original's
    assert restored.state_dict() == loader.state_dict()


def test_resume_in_sample_level_mode_and_from_non_seekable_pipe_shards(tmp_path: Path) -> None:
    id_dataset(tmp_path, [23, 17])
    # the same shards read through a pipe: no seeking, resume skips members instead
    data = json.loads((tmp_path / "dataset.json").read_text())
    for entry in data["splits"]["train"]["shards"]:
        entry["name"] = f"pipe:cat {tmp_path / entry['name']}"
    piped = tmp_path / "piped"
    piped.mkdir()
    (piped / "dataset.json").write_text(json.dumps(data))
    for folder in (tmp_path, piped):
        cfg = cfg_for(folder, num_workers=2, shuffle_buffer=3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fewer shards than readers
            loader = build_train_loader(cfg, IMG, 3, seed=1, rank=1, world_size=2)
            take(loader, 7)
            state = loader.state_dict()
            expected = take(loader, 6)
            restored = build_train_loader(cfg, IMG, 3, seed=1, rank=1, world_size=2)
        restored.load_state_dict(state)
        assert same(take(restored, 6), expected), folder


def test_resume_seeks_without_decoding_skipped_images(synth: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = cfg_for(synth, shuffle_buffer=5)
    loader = build_train_loader(cfg, IMG, 4, seed=0)
    take(loader, 25)  # 100 samples in: several blocks and shards
    state = loader.state_dict()
    expected = take(loader, 3)

    decoded = []
    real = tario.decode_image
    monkeypatch.setattr(tario, "decode_image", lambda data: decoded.append(1) or real(data))
    restored = build_train_loader(cfg, IMG, 4, seed=0)
    restored.load_state_dict(state)
    assert same(take(restored, 3), expected)
    assert len(decoded) == 12  # only the 3 x 4 images handed out


def test_main_process_loader_leaves_global_rngs_alone(synth: Path) -> None:
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    take(build_train_loader(cfg_for(synth, mixup=0.5), IMG, 4, seed=0), 3)
    t, r, n = torch.rand(1), random.random(), np.random.rand()
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    assert (torch.rand(1), random.random(), np.random.rand()) == (t, r, n)


def test_resume_with_another_world_size_is_refused_unless_not_strict(synth: Path) -> None:
    cfg = cfg_for(synth)
    loader = build_train_loader(cfg, IMG, 4, seed=0, rank=0, world_size=1)
    take(loader, 2)
    state = loader.state_dict()
    other = build_train_loader(cfg, IMG, 4, seed=0, rank=0, world_size=2)
    with pytest.raises(DataError, match="world_size"):
        other.load_state_dict(state)
    with pytest.warns(UserWarning, match="fresh epoch"):
        other.load_state_dict(state, strict=False)
    assert len(take(other, 2)) == 2


# ----------------------------------------------------------------------------- coverage


def _labels_per_rank(cfg: DataConfig, world: int, batches: int, batch: int) -> list[list[int]]:
    out = []
    for rank in range(world):
        got = take(build_train_loader(cfg, IMG, batch, seed=5, rank=rank, world_size=world), batches)
        out.append([int(v) for _, t in got for v in t])
    return out


def test_one_epoch_across_ranks_and_workers_sees_every_sample_once(tmp_path: Path) -> None:
    n = id_dataset(tmp_path, [5] * 8)  # 8 shards = 2 ranks x 2 workers x 2 shards each
    cfg = cfg_for(tmp_path, num_workers=2, shuffle_buffer=4)
    per_rank = _labels_per_rank(cfg, world=2, batches=4, batch=5)  # 20 samples a rank = one epoch
    seen = [v for labels in per_rank for v in labels]
    assert sorted(seen) == list(range(n))


def test_fewer_shards_than_readers_splits_by_sample_with_a_warning(tmp_path: Path) -> None:
    n = id_dataset(tmp_path, [23, 17])  # 2 shards for 2 ranks x 2 workers
    cfg = cfg_for(tmp_path, num_workers=2, shuffle_buffer=4)
    with pytest.warns(UserWarning, match="every reader reads every shard"):
        per_rank = _labels_per_rank(cfg, world=2, batches=4, batch=5)
    seen = [v for labels in per_rank for v in labels]
    assert sorted(seen) == list(range(n))
    # the stream goes on into later epochs on every rank
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for rank in range(2):
            assert len(take(build_train_loader(cfg, IMG, 5, seed=5, rank=rank, world_size=2), 12)) == 12


def test_fewer_samples_than_readers_is_an_error(tmp_path: Path) -> None:
    id_dataset(tmp_path, [3])
    with pytest.raises(DataError, match="fewer than"):
        build_train_loader(cfg_for(tmp_path, num_workers=2), IMG, 2, seed=0, world_size=2)


# ----------------------------------------------------------------------------- eval


@pytest.mark.parametrize("workers,world,batch", [(2, 2, 4), (0, 2, 5), (2, 3, 2)])
def test_eval_visits_every_sample_exactly_once_with_equal_batch_counts(
        tmp_path: Path, workers: int, world: int, batch: int) -> None:
    n = id_dataset(tmp_path, [7, 2, 12], split="val")
    cfg = cfg_for(tmp_path, num_workers=workers)
    seen, counts = [], []
    for rank in range(world):
        ev = build_eval_loader(cfg, IMG, batch, rank=rank, world_size=world)
        batches = list(ev)
        assert len(batches) == len(ev)
        counts.append(len(ev))
        for images, targets, valid in batches:
            assert images.shape == (batch, 3, IMG, IMG) and valid.dtype == torch.bool
            seen += targets[valid].tolist()
            assert torch.all(images[~valid] == 0)
    assert len(set(counts)) == 1
    assert sorted(seen) == list(range(n))


# ----------------------------------------------------------------------------- bad data


def clean_shard(folder: Path, prefix: str, n: int = 30, label: int = 2) -> str:
    w = ShardWriter(folder, prefix, max_samples=n)
    for i in range(n):
        w.write(f"{prefix}{i:04d}", {"png": png(hash(prefix) % 1000 + i), "cls": str(label).encode()})
    return w.close()[0].name


def bad_dataset(folder: Path) -> None:
    """Five 30-sample shards: a has one sample of each per-sample kind of bad data (26 good), b is
    cut inside its 16th sample (15 good), c is not a tar at all, d is clean, e ends cleanly after
    20 samples (a tar cut at a member boundary reads as a shorter archive)."""
    w = ShardWriter(folder, "a", max_samples=100)
    for i in range(30):
        members = {"png": png(i), "cls": str(i % 3).encode()}
        if i == 3:
            members["png"] = png(i)[:180]  # corrupt: the header reads, the pixel data is cut short
        if i == 5:
            del members["cls"]
        if i == 7:
            members["cls"] = b"seven"
        if i == 9:
            del members["png"]
        w.write(f"a{i:04d}", members)
    w.close()
    b = folder / clean_shard(folder, "b", label=1)
    with tarfile.open(b) as t:
        cut = t.getmember("b0015.png").offset_data + 50
    b.write_bytes(b.read_bytes()[:cut])
    (folder / "c-000000.tar").write_bytes(b"this is not a tar archive" * 100)
    clean_shard(folder, "d")
    e = folder / clean_shard(folder, "e", label=0)
    with tarfile.open(e) as t:
        cut = t.getmember("e0020.png").offset
    e.write_bytes(e.read_bytes()[:cut])
    shards = [(f"{p}-000000.tar", 30) for p in "abcde"]
    write_info(folder, {"train": shards, "val": shards}, num_classes=3)


def one_unreadable_dataset(folder: Path) -> None:
    """Five clean shards and one (c) that cannot be read: 30 of 180 samples bad."""
    names = [clean_shard(folder, p) for p in "defgh"]
    (folder / "c-000000.tar").write_bytes(b"\0garbage" * 300)
    shards = [(n, 30) for n in names[:2]] + [("c-000000.tar", 30)] + [(n, 30) for n in names[2:]]
    write_info(folder, {"train": shards, "val": shards}, num_classes=3)


def test_each_kind_of_bad_data_is_skipped_and_counted_in_eval(tmp_path: Path) -> None:
    bad_dataset(tmp_path)
    cfg = cfg_for(tmp_path, num_workers=2, max_bad_fraction=0.9)
    ev = build_eval_loader(cfg, IMG, 16, rank=0, world_size=1)
    valid = sum(int(v.sum()) for _, _, v in ev)
    counts = ev.bad_counts()
    assert counts["corrupt_image"] == 1
    assert counts["missing_label"] == 1
    assert counts["bad_label"] == 1
    assert counts["missing_image"] == 1
    assert counts["truncated_tar"] == 15 + 10  # samples lost, by kind
    assert counts["unreadable_shard"] == 30
    assert valid == 26 + 15 + 0 + 30 + 20


def test_each_kind_of_bad_data_is_skipped_and_counted_in_training(tmp_path: Path) -> None:
    bad_dataset(tmp_path)
    cfg = cfg_for(tmp_path, num_workers=2, max_bad_fraction=0.9)
    loader = build_train_loader(cfg, IMG, 8, seed=0)
    it = iter(loader)
    while loader.samples_read() < 2 * 150:  # two epochs
        images, targets = next(it)
        assert targets.max() < 3 and torch.isfinite(images).all()
    counts = loader.bad_counts()
    assert set(counts) == set(tario.BAD_KINDS), counts
    # two whole epochs: b (15 lost) and e (10 lost, an archive that ends cleanly but early) twice each
    assert counts["truncated_tar"] >= 2 * 25 and counts["unreadable_shard"] >= 2 * 30, counts
    # the counts travel in the checkpoint
    restored = build_train_loader(cfg, IMG, 8, seed=0)
    restored.load_state_dict(loader.state_dict())
    assert restored.bad_counts() == counts and restored.samples_read() == loader.samples_read()


def test_bad_counts_after_a_resume_equal_the_uninterrupted_counts(tmp_path: Path) -> None:
    bad_dataset(tmp_path)
    cfg = cfg_for(tmp_path, max_bad_fraction=0.9, shuffle_buffer=8)
    reference = build_train_loader(cfg, IMG, 4, seed=0)
    states, counts = [], []
    for _ in range(40):  # resume points throughout more than one epoch
        next(reference)
        states.append(reference.state_dict())
        counts.append((reference.bad_counts(), reference.samples_read()))
    for stop in range(35):
        restored = build_train_loader(cfg, IMG, 4, seed=0)
        restored.load_state_dict(states[stop])
        take(restored, 5)
        assert (restored.bad_counts(), restored.samples_read()) == counts[stop + 5], stop


@pytest.mark.parametrize("workers", [0, 2])
def test_too_many_bad_samples_stop_training_naming_the_shard(tmp_path: Path, workers: int) -> None:
    one_unreadable_dataset(tmp_path)
    loader = build_train_loader(cfg_for(tmp_path, num_workers=workers), IMG, 8, seed=0)  # default 0.01
    with pytest.raises(BadDataError, match=r"shard '.*c-000000\.tar'"):
        take(loader, 100)


def test_too_many_bad_samples_stop_eval_naming_the_shard(tmp_path: Path) -> None:
    one_unreadable_dataset(tmp_path)
    ev = build_eval_loader(cfg_for(tmp_path, num_workers=0), IMG, 16)
    with pytest.raises(BadDataError, match=r"shard '.*c-000000\.tar'"):
        list(ev)


def test_unknown_split_is_a_clear_error(synth: Path) -> None:
    with pytest.raises(DataError, match="no split 'nope'"):
        build_train_loader(cfg_for(synth, train_split="nope"), IMG, 4, seed=0)
    assert read_dataset_info(synth).num_classes == 4
