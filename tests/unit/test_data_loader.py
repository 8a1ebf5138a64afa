"""Train stream and eval pass: elastic determinism, exact resume on any layout, exactly-once eval, bad data."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import pickle
import random
import tarfile
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from PIL import Image

from pipeline.config import ConfigError, DataConfig
from pipeline.data import (
    BadDataError,
    DataError,
    build_eval_loader,
    build_train_loader,
    raise_if_any_failed,
    read_dataset_info,
    tario,
)
from pipeline.data.shards import ShardWriter, synthetic_source, write_dataset
from pipeline.objectives import load_config

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
        if n == 0:  # an empty (but valid) tar
            tarfile.open(folder / f"{split}{s}-000000.tar", "w").close()
            names.append((f"{split}{s}-000000.tar", 0))
            continue
        w = ShardWriter(folder, f"{split}{s}", max_samples=n)
        for _ in range(n):
            w.write(f"{i:06d}", {"png": png(i), "cls": str(i).encode()})
            i += 1
        rec = w.close()
        names.append((rec[0].name, n))
    write_info(folder, {split: names}, num_classes=i)
    return i


def cfg_for(path: Path, **kw) -> DataConfig:
    base = dict(path=str(path), num_workers=0, shuffle_span=8, hflip=0.5, scale=(0.5, 1.0),
                cache_dir=str(path / "cache"))
    if "cache_dir" not in DataConfig.__dataclass_fields__:  # lets this file run against the old loader
        del base["cache_dir"]
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



def ids_of(loader, micro_batches: int) -> list[int]:
    it = iter(loader)
    out: list[int] = []
    for _ in range(micro_batches):
        next(it)
        out += loader.last_ids.tolist()
    return out


def step_sets(cfg: DataConfig, world: int, micro: int, steps: int, global_batch: int, seed: int = 5,
              **kw) -> list[set[int]]:
    """Sample ids of each of `steps` steps, gathered over `world` simulated ranks."""
    sets: list[set[int]] = [set() for _ in range(steps)]
    for rank in range(world):
        loader = build_train_loader(cfg, IMG, micro, seed=seed, rank=rank, world_size=world,
                                    global_batch_size=global_batch, **kw)
        ids = ids_of(loader, steps * loader.accum)
        per_step = micro * loader.accum
        for t in range(steps):
            sets[t] |= set(ids[t * per_step:(t + 1) * per_step])
    return sets


# ----------------------------------------------------------------------------- elastic determinism


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


@pytest.mark.slow
def test_step_sample_sets_are_the_same_on_every_layout(tmp_path: Path) -> None:
    """World sizes 1-4 x accumulation 1-4 (every one that makes G = 24), 0-3 workers: same ids per step."""
    n = id_dataset(tmp_path, [13, 0, 29, 7, 31])
    cfg = cfg_for(tmp_path, shuffle_span=10)
    steps, G = 7, 24  # 168 positions: the stream crosses into the second epoch (n = 80)
    reference = step_sets(cfg, 1, G, steps, G, ids_only=True)
    assert all(len(s) == G for s in reference[:3])  # within the first epoch: G distinct samples
    layouts = [(w, a) for w in range(1, 5) for a in range(1, 5) if G % (w * a) == 0]
    assert len(layouts) == 14
    for w, a in layouts:
        workers = (w + a) % 4  # every worker count 0-3 occurs
        got = step_sets(cfg_for(tmp_path, shuffle_span=10, num_workers=workers), w, G // (w * a), steps, G,
                        ids_only=True)
        assert got == reference, (w, a, workers)
    # an epoch is a permutation: its first 80 positions hold every sample once
    ids = ids_of(build_train_loader(cfg, IMG, 8, seed=5, global_batch_size=8, ids_only=True), 10)
    assert sorted(ids) == list(range(n))


def test_same_images_per_step_on_another_layout_with_workers(synth: Path) -> None:
    """The pixels, not just the ids: 1 rank x 8 vs 2 ranks x 2 micro x 2 accumulation with 2 workers."""
    cfg = cfg_for(synth, num_workers=0, auto_augment="rand-m9-mstd0.5")
    one = take(build_train_loader(cfg, IMG, 8, seed=4, global_batch_size=8), 3)
    ranks = [take(build_train_loader(cfg_for(synth, num_workers=2, auto_augment="rand-m9-mstd0.5"), IMG, 2,
                                     seed=4, rank=r, world_size=2, global_batch_size=8), 6) for r in range(2)]
    for t in range(3):
        images = torch.cat([b[0] for r in range(2) for b in ranks[r][2 * t:2 * t + 2]])
        targets = torch.cat([b[1] for r in range(2) for b in ranks[r][2 * t:2 * t + 2]])
        assert torch.equal(images, one[t][0]) and torch.equal(targets, one[t][1]), t


def test_layout_that_cannot_make_the_global_batch_is_a_one_line_error(synth: Path) -> None:
    with pytest.raises(ConfigError, match=r"global_batch_size=10 is not a multiple of train.micro_batch_size=2 x "
                                          r"world size 3 = 6"):
        build_train_loader(cfg_for(synth), IMG, 2, seed=0, rank=0, world_size=3, global_batch_size=10)
    with pytest.raises(ConfigError, match="global_batch_size=64 is not a multiple of train.micro_batch_size=24"):
        from pipeline.derived import resolve_batch
        resolve_batch(load_config(None, ["train.global_batch_size=64", "train.micro_batch_size=24"]).train, 1)
    cfg = load_config(None, ["train.global_batch_size=64", "train.micro_batch_size=8"])
    from pipeline.derived import deepspeed_config
    ds = deepspeed_config(cfg, 2)
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"]) == (64, 4)
    with pytest.raises(ConfigError, match="grad_accum_steps=2 contradicts"):
        deepspeed_config(load_config(None, ["train.global_batch_size=64", "train.micro_batch_size=8",
                                            "train.grad_accum_steps=2"]), 2)


# ----------------------------------------------------------------------------- resume


@pytest.mark.parametrize("mixup", [False, True])
def test_resume_yields_exactly_the_uninterrupted_batches_with_two_workers(synth: Path, mixup: bool) -> None:
    cfg = cfg_for(synth, num_workers=2, shuffle_span=7, mixup=0.8 if mixup else 0.0,
                  cutmix=1.0 if mixup else 0.0, auto_augment="rand-m9-mstd0.5" if mixup else None)
    loader = build_train_loader(cfg, IMG, 6, seed=3)
    take(loader, 10)
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    assert len(pickle.dumps(state)) < 4096
    assert state["position"] == 60 and "epoch" not in state  # stored once: the epoch follows from the position
    uninterrupted = take(loader, 5)

    restored = build_train_loader(cfg, IMG, 6, seed=3)
    restored.load_state_dict(state)
    resumed = take(restored, 5)
    assert same(uninterrupted, resumed)
    assert restored.soft_targets == mixup
    if mixup:
        assert resumed[0][1].shape == (6, 4) and resumed[0][1].dtype == torch.float32
    assert restored.state_dict() == loader.state_dict()


def test_interrupted_run_resumed_on_2_then_3_then_1_nodes_sees_the_epoch_once(tmp_path: Path) -> None:
    """2 partitions (of 36 samples each); one rank per node: 3 nodes do not divide them."""
    n = id_dataset(tmp_path, [17, 11, 25, 19])  # labels are global ids: what was read, not just planned
    G, seen, state = 12, [], None
    for phase, (world, micro, steps) in enumerate(((2, 3, 2), (3, 2, 2), (1, 6, 2))):
        per_rank = []
        for rank in range(world):
            loader = build_train_loader(cfg_for(tmp_path, num_workers=rank % 3, shuffle_span=9, partitions=2), IMG,
                                        micro, seed=7, rank=rank, world_size=world, global_batch_size=G)
            if state is not None:
                loader.load_state_dict(state)
            per_rank.append(loader)
            seen += [int(v) for _, t in take(loader, steps * loader.accum) for v in t]
        state = pickle.loads(pickle.dumps(per_rank[0].state_dict()))
        assert state["position"] == G * steps * (phase + 1) == len(seen)
    assert len(seen) == 72 and len(set(seen)) == 72 and set(seen) <= set(range(n))
    assert per_rank[0].stream.order.partitions == 2 and state["partitions"] == 2
    ids = ids_of(build_train_loader(cfg_for(tmp_path, shuffle_span=9, partitions=2), IMG, 12, seed=7,
                                    ids_only=True), 6)
    assert sorted(seen) == sorted(ids)  # the uninterrupted run's first 72 samples


def test_seek_step_realigns_after_an_extra_micro_batch(synth: Path) -> None:
    # The trainer replaces a micro batch skipped for a non-finite loss by the next one, then seeks to the
    # next step: that step gets its own samples again and the state says exactly where the run is.
    def loader():
        return build_train_loader(cfg_for(synth, num_workers=1), IMG, 4, seed=3, global_batch_size=8, ids_only=True)

    ref = ids_of(loader(), 8)
    perturbed = loader()
    first = ids_of(perturbed, 3)  # step 0 plus one extra micro batch (step 1's first)
    perturbed.seek_step(1)
    assert perturbed.state_dict()["position"] == 8
    assert first == ref[:12] and ids_of(perturbed, 4) == ref[8:24]
    perturbed.seek_step(3)  # already there: nothing restarts
    assert perturbed._it is not None and ids_of(perturbed, 2) == ref[24:32]


def test_resume_reads_and_decodes_only_the_samples_handed_out(synth: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = cfg_for(synth, shuffle_span=5)
    loader = build_train_loader(cfg, IMG, 4, seed=0)
    take(loader, 25)  # 100 samples in: several windows and shards
    state = loader.state_dict()
    expected = take(loader, 3)

    decoded = []
    real = tario.decode_image
    monkeypatch.setattr(tario, "decode_image", lambda data, *a: decoded.append(1) or real(data, *a))
    restored = build_train_loader(cfg, IMG, 4, seed=0)
    restored.load_state_dict(state)
    assert same(take(restored, 3), expected)
    assert len(decoded) == 12  # only the 3 x 4 images handed out
    assert restored.counters().bytes <= 1.25 * restored.counters().sample_bytes + 3 * 10 * 1024


def test_pipe_shards_are_cached_locally_once_and_resume_exactly(tmp_path: Path) -> None:
    id_dataset(tmp_path, [23, 17])
    data = json.loads((tmp_path / "dataset.json").read_text())
    for entry in data["splits"]["train"]["shards"]:
        entry["name"] = f"pipe:cat {tmp_path / entry['name']}"
    piped = tmp_path / "piped"
    piped.mkdir()
    (piped / "dataset.json").write_text(json.dumps(data))
    results = []
    for folder in (tmp_path, piped):
        cfg = cfg_for(folder, num_workers=2, shuffle_span=3, allow_pipe_shards=True)
        loader = build_train_loader(cfg, IMG, 3, seed=1, rank=1, world_size=2)
        take(loader, 7)
        state = loader.state_dict()
        expected = take(loader, 6)
        restored = build_train_loader(cfg, IMG, 3, seed=1, rank=1, world_size=2)
        restored.load_state_dict(state)
        assert same(take(restored, 6), expected), folder
        results.append(expected)
    assert same(results[0], results[1])
    assert len(list((piped / "cache").glob("*.tar"))) == 2


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


def test_state_of_another_seed_global_batch_or_data_set_is_refused(synth: Path) -> None:
    cfg = cfg_for(synth)
    loader = build_train_loader(cfg, IMG, 4, seed=0, global_batch_size=8, world_size=2)
    take(loader, 2)
    state = loader.state_dict()
    build_train_loader(cfg, IMG, 8, seed=0, global_batch_size=8).load_state_dict(state)  # another layout: fine
    with pytest.raises(DataError, match="global_batch_size: 8 .checkpoint. vs 16"):
        build_train_loader(cfg, IMG, 8, seed=0, global_batch_size=16).load_state_dict(state)
    with pytest.raises(DataError, match="seed: 0 .checkpoint. vs 1"):
        build_train_loader(cfg, IMG, 8, seed=1, global_batch_size=8).load_state_dict(state)
    with pytest.raises(DataError, match="version 1"):
        build_train_loader(cfg, IMG, 8, seed=0).load_state_dict([{"version": 1}])
    with pytest.raises(DataError, match=r"version 2, expected 3 \(the sample order changed to partitions"):
        build_train_loader(cfg, IMG, 8, seed=0, global_batch_size=8).load_state_dict({**state, "version": 2})
    with pytest.raises(DataError, match="partitions: 1 .checkpoint. vs 2"):
        build_train_loader(cfg_for(synth, partitions=2), IMG, 8, seed=0, global_batch_size=8).load_state_dict(state)


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


def eval_workers() -> list[psutil.Process]:
    """This process's eval DataLoader workers (started by its fork server; named by WorkerInit)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.name() == "eval-worker":
                found.append(p)
    return found


def test_an_eval_worker_killed_mid_pass_is_replaced_and_every_sample_is_seen_once(tmp_path: Path, capfd) -> None:
    # A worker killed by the OOM killer or an operator: the pass starts workers again for the batches not
    # yet seen and still yields len() batches; before, the rank raised alone and its peers waited for it.
    n = id_dataset(tmp_path, [40, 40], split="val")
    ev = build_eval_loader(cfg_for(tmp_path, num_workers=2, prefetch_factor=1), IMG, 2)
    seen, batches = [], 0
    for i, (_, targets, valid) in enumerate(ev):
        if i == 1:
            victims = eval_workers()
            assert len(victims) == 2, victims
            victims[1].kill()
        seen += targets[valid].tolist()
        batches += 1
    assert batches == len(ev) == 40 and ev.failure is None
    assert sorted(seen) == list(range(n))  # each sample once: the restarted workers took only the unseen
    assert "starting the workers again" in capfd.readouterr().err
    raise_if_any_failed(ev)  # nothing to raise


# ----------------------------------------------------------------------------- bad data


def clean_shard(folder: Path, prefix: str, n: int = 30, label: int = 2) -> str:
    w = ShardWriter(folder, prefix, max_samples=n)
    for i in range(n):
        w.write(f"{prefix}{i:04d}", {"png": png(hash(prefix) % 1000 + i), "cls": str(label).encode()})
    return w.close()[0].name


def bad_dataset(folder: Path) -> None:
    """Five 30-sample shards: a has one sample of each per-sample kind of bad data (25 good), b is
    cut inside its 16th sample (15 good), c is not a tar at all, d is clean, e ends cleanly after
    20 samples (a tar cut at a member boundary reads as a shorter archive)."""
    a = folder / "a-000000.tar"
    with tarfile.open(a, "w") as t:
        for i in range(30):
            members = [("png", png(i)), ("cls", str(i % 3).encode())]
            if i == 3:
                members[0] = ("png", png(i)[:180])  # corrupt: the header reads, the pixel data is cut short
            if i == 5:
                del members[1]
            if i == 7:
                members[1] = ("cls", b"seven")
            if i == 9:
                del members[0]
            if i == 11:
                members.append(("cls", b"1"))  # a duplicate member name: which label is meant?
            for ext, data in members:
                info = tarfile.TarInfo(f"a{i:04d}.{ext}")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
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


def test_each_kind_of_bad_data_is_counted_in_eval(tmp_path: Path) -> None:
    bad_dataset(tmp_path)
    cfg = cfg_for(tmp_path, num_workers=2, max_bad_fraction=0.9)
    ev = build_eval_loader(cfg, IMG, 16, rank=0, world_size=1)
    valid = sum(int(v.sum()) for _, _, v in ev)
    assert ev.bad_counts() == {"bad_label": 1, "corrupt_image": 1, "duplicate_member": 1, "missing_image": 1,
                               "missing_label": 1, "truncated_tar": 15 + 10, "unreadable_shard": 30}
    assert valid == 25 + 15 + 0 + 30 + 20


def test_each_kind_of_bad_data_is_replaced_and_counted_in_training(tmp_path: Path) -> None:
    bad_dataset(tmp_path)
    cfg = cfg_for(tmp_path, num_workers=2, max_bad_fraction=0.9)
    loader = build_train_loader(cfg, IMG, 10, seed=0)
    for _ in range(30):  # two epochs of 150
        images, targets = next(loader)
        assert images.shape[0] == 10 and targets.max() < 3 and torch.isfinite(images).all()
    assert loader.bad_counts() == {"bad_label": 2, "corrupt_image": 2, "duplicate_member": 2, "missing_image": 2,
                                   "missing_label": 2, "truncated_tar": 50, "unreadable_shard": 60}
    assert loader.samples_read() == 300
    # the counts travel in the checkpoint (rank 0 carries the global sums on)
    restored = build_train_loader(cfg, IMG, 10, seed=0)
    restored.load_state_dict(loader.state_dict())
    assert restored.bad_counts() == loader.bad_counts() and restored.samples_read() == 300
    other_rank = build_train_loader(cfg, IMG, 5, seed=0, rank=1, world_size=2)
    other_rank.load_state_dict(loader.state_dict())
    assert other_rank.bad_counts() == {}


@pytest.mark.parametrize("workers", [0, 2])
def test_too_many_bad_samples_stop_training_naming_the_shard(tmp_path: Path, workers: int) -> None:
    one_unreadable_dataset(tmp_path)
    loader = build_train_loader(cfg_for(tmp_path, num_workers=workers), IMG, 8, seed=0)  # default 0.01
    with pytest.raises(BadDataError, match=r"shard '.*c-000000\.tar'.*not a tar archive"):
        take(loader, 100)


def test_too_many_bad_samples_stop_eval_naming_the_shard(tmp_path: Path) -> None:
    one_unreadable_dataset(tmp_path)
    ev = build_eval_loader(cfg_for(tmp_path, num_workers=0), IMG, 16)
    batches = list(ev)  # the pass still yields every batch (the ranks stay in step), the rest invalid...
    assert len(batches) == len(ev) and not batches[-1][2].any()
    with pytest.raises(BadDataError, match=r"shard '.*c-000000\.tar'"):
        raise_if_any_failed(ev)  # ...and the failure is raised after it, on every rank together


def test_unknown_split_is_a_clear_error(synth: Path) -> None:
    with pytest.raises(DataError, match="no split 'nope'"):
        build_train_loader(cfg_for(synth, train_split="nope"), IMG, 4, seed=0)
    assert read_dataset_info(synth).num_classes == 4


# ----------------------------------------------------------------------------- the "bad data" list
# Each of these failed on the loader before the elastic rewrite.


def test_resume_over_tar_gz_shards_continues_exactly(tmp_path: Path) -> None:
    n = id_dataset(tmp_path, [40, 40])
    data = json.loads((tmp_path / "dataset.json").read_text())
    for entry in data["splits"]["train"]["shards"]:
        tar = tmp_path / entry["name"]
        gz = tar.with_name(tar.name + ".gz")
        gz.write_bytes(gzip.compress(tar.read_bytes()))
        entry["name"], entry["bytes"] = gz.name, gz.stat().st_size
    (tmp_path / "dataset.json").write_text(json.dumps(data))
    cfg = cfg_for(tmp_path, shuffle_span=16)
    reference = [int(v) for _, t in take(build_train_loader(cfg, IMG, 4, seed=2), 20) for v in t]
    assert sorted(reference) == list(range(n))
    loader = build_train_loader(cfg, IMG, 4, seed=2)
    first = [int(v) for _, t in take(loader, 7) for v in t]
    restored = build_train_loader(cfg, IMG, 4, seed=2)
    restored.load_state_dict(loader.state_dict())
    rest = [int(v) for _, t in take(restored, 13) for v in t]
    assert first + rest == reference
    assert restored.bad_counts() == {}


def test_eval_numbers_an_image_less_sample_as_invalid_without_shifting(tmp_path: Path) -> None:
    from pipeline.data.shards import index_shards

    with tarfile.open(tmp_path / "val-0.tar", "w") as t:
        for i in range(12):
            for ext, data in (("png", png(i)), ("cls", str(i).encode())):
                if i == 4 and ext == "png":
                    continue  # a label but no image
                info = tarfile.TarInfo(f"{i:04d}.{ext}")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    index_shards({"val": str(tmp_path / "val-0.tar")}, tmp_path, progress=False, log=lambda s: None)
    for world in (1, 2):
        seen, counts = [], {}
        for rank in range(world):
            ev = build_eval_loader(cfg_for(tmp_path), IMG, 4, rank=rank, world_size=world)
            seen += [int(v) for _, t, valid in ev for v in t[valid]]
            counts.update(ev.bad_counts())
        assert sorted(seen) == [i for i in range(12) if i != 4], world  # 11 images, each once
        assert counts == {"missing_image": 1}


def test_empty_shards_in_the_train_split_with_two_workers_over_many_epochs(tmp_path: Path) -> None:
    n = id_dataset(tmp_path, [0, 6, 0, 5, 0])
    loader = build_train_loader(cfg_for(tmp_path, num_workers=2, shuffle_span=4), IMG, 2, seed=0)
    labels = [int(v) for _, t in take(loader, 11 * 5) for v in t]  # ten epochs
    for e in range(10):
        assert sorted(labels[e * n:(e + 1) * n]) == list(range(n)), e


@pytest.mark.parametrize("shard,cause", [  # an unknown scheme is refused at start (test_trust.py)
    ("pipe:echo 'bucket not found' >&2; exit 3", "exited with status 3: bucket not found"),
])
def test_unreadable_shard_error_keeps_its_cause(tmp_path: Path, shard: str, cause: str) -> None:
    id_dataset(tmp_path, [20, 20])
    data = json.loads((tmp_path / "dataset.json").read_text())
    data["splits"]["train"]["shards"][1] = {"name": shard, "num_samples": 200}
    data["splits"]["train"]["num_samples"] = 220
    (tmp_path / "dataset.json").write_text(json.dumps(data))
    loader = build_train_loader(cfg_for(tmp_path, num_workers=1, allow_pipe_shards=True), IMG, 10, seed=0)
    with pytest.raises(BadDataError) as e:
        take(loader, 22)
    assert "unreadable_shard=" in str(e.value) and cause in str(e.value), str(e.value)


def test_negative_seed_is_a_config_error_not_a_loader_crash(synth: Path) -> None:
    with pytest.raises(ConfigError, match="train.seed' must be >= 0, got -1"):
        load_config(None, ["train.seed=-1"])
    with pytest.raises(DataError, match="train.seed must be >= 0"):
        build_train_loader(cfg_for(synth), IMG, 4, seed=-1)


def test_duplicate_member_name_is_a_counted_bad_sample_not_an_overwrite(tmp_path: Path) -> None:
    with tarfile.open(tmp_path / "train-0.tar", "w") as t:
        for i in range(8):
            members = [("png", png(i)), ("cls", b"0")] + ([("cls", b"1")] if i == 2 else [])
            for ext, data in members:
                info = tarfile.TarInfo(f"{i:04d}.{ext}")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    write_info(tmp_path, {"train": [("train-0.tar", 8)], "val": [("train-0.tar", 8)]}, num_classes=2)
    loader = build_train_loader(cfg_for(tmp_path, max_bad_fraction=0.5), IMG, 8, seed=0)
    _, targets = next(loader)
    assert loader.bad_counts() == {"duplicate_member": 1} and targets.tolist() == [0] * 8
    ev = build_eval_loader(cfg_for(tmp_path, max_bad_fraction=0.5), IMG, 8)
    assert sum(int(v.sum()) for _, _, v in ev) == 7 and ev.bad_counts() == {"duplicate_member": 1}


def test_augment_seed_is_a_function_of_seed_and_position_only() -> None:
    from pipeline.data.order import AUGMENT, AUGMENT_BLOCK, GlobalOrder

    n = 3000
    a, b = GlobalOrder([1000, 2000], seed=5, global_batch=8), GlobalOrder([1000, 2000], seed=5, global_batch=8)
    positions = [0, 1, AUGMENT_BLOCK - 1, AUGMENT_BLOCK, n - 1, n, n + 1, 5 * n + 17]
    # Another visiting order (and so another cache history) gives the same seeds.
    assert [a.augment_seed(p) for p in positions] == [b.augment_seed(p) for p in reversed(positions)][::-1]
    # Block k is SeedSequence(AUGMENT, seed, k): the same scheme as seed_for.
    words = np.random.SeedSequence([AUGMENT, 5, 1]).generate_state(AUGMENT_BLOCK, np.uint64) >> np.uint64(1)
    assert a.augment_seed(AUGMENT_BLOCK + 1) == int(words[1]) and a.augment_seed(n) != a.augment_seed(0)
    assert len({a.augment_seed(p) for p in range(2 * n)}) == 2 * n  # no repeats within or across epochs
    assert GlobalOrder([1000, 2000], seed=6, global_batch=8).augment_seed(7) != a.augment_seed(7)
    assert 0 <= a.augment_seed(7) < 2**63


def test_randaugment_posterize_at_magnitude_10_keeps_0_bits_as_a_black_image():
    # MAE's and DeiT's rand-m9-mstd0.5-inc1 reaches magnitude 10 (2.3% of draws), where timm's increasing
    # posterize keeps 0 bits: Pillow 13 refuses that, and the run died in a DataLoader worker. Magnitude
    # 10 with no spread makes every posterize draw keep 0 bits.
    from PIL import ImageOps

    from pipeline.data.transforms import _posterize, seeded, train_transform

    cfg = DataConfig(auto_augment="rand-m10-mstd0-inc1", scale=(0.5, 1.0))
    transform = train_transform(cfg, (32, 32))
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8))
    ops = [op for t in transform.transforms for op in getattr(t, "ops", [])]
    assert {op.aug_fn for op in ops if op.name.startswith("Posterize")} == {_posterize}
    for seed in range(300):  # ~20 posterize draws among them
        with seeded(seed, restore=True):
            assert transform(img).shape == (3, 32, 32)
    assert np.asarray(_posterize(img, 0)).max() == 0
    assert np.array_equal(np.asarray(_posterize(img, 3)), np.asarray(ImageOps.posterize(img, 3)))
    assert _posterize(img, 8) is img


def test_worker_batch_buffers_are_reused_only_once_nothing_refers_to_them(synth: Path) -> None:
    """buffers.py: a worker writes into a buffer again only after the main process let go of every
    tensor and view of it; kept batches stay as they were, dropped ones are reused; the pixels are
    those of the main-process loader either way."""
    from pipeline.data.buffers import RING, storage_users

    reference = take(build_train_loader(cfg_for(synth, num_workers=0), IMG, 8, seed=3), 24)
    loader = build_train_loader(cfg_for(synth, num_workers=2), IMG, 8, seed=3)
    it = iter(loader)
    kept = [(x.clone(), y) for x, y in [next(it) for _ in range(12)]]  # clones: the originals are let go
    views = []
    for j in range(12, 24):
        images, targets = next(it)
        assert torch.equal(images, reference[j][0]) and torch.equal(targets, reference[j][1]), j
        if j < 15:
            views.append((j, images[2:5]))  # a view keeps its batch's buffer from reuse
        del images, targets
    assert all(torch.equal(x, reference[j][0]) for j, (x, _) in enumerate(kept))
    for j, view in views:
        assert torch.equal(view, reference[j][0][2:5]), j  # not overwritten by later batches
    released = loader._releaser.released
    assert int(released.sum()) > 0 and int(released.max()) > 1  # buffers went round the ring more than once
    assert released.shape == (2, RING)
    assert all(storage_users(s) > 1 for _, s in loader._releaser.held[:3])  # the views' batches: still held
    loader.close()


def test_bad_samples_is_derived_and_an_older_state_that_stored_it_still_loads() -> None:
    from pipeline.data.bad import Counters

    old = {"bad": {"corrupt_image": 2, "missing_label": 1}, "bad_shards": {"s.tar": 3}, "causes": {},
           "read": 40, "bad_samples": 3}  # a checkpoint written when the sum was stored
    c = Counters.from_state(old)
    assert c.bad_samples == 3 and "bad_samples" not in c.to_state()
    c.count_bad("corrupt_image", "t.tar")
    assert (c + c).bad_samples == 8 == sum((c + c).bad.values())
