"""Shard writing and reading: round trip, atomicity, sources, shards written by others, dataset.json checks."""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.config import DataConfig
from pipeline.data import DataError, build_eval_loader, build_train_loader, read_dataset_info, tario
from pipeline.data.shards import (
    Item,
    ShardWriter,
    Source,
    digits_source,
    expand_shards,
    folder_source,
    index_shards,
    keep_train_fraction,
    synthetic_source,
    write_dataset,
)
from pipeline.data.sources import without_labels

ROOT = Path(__file__).resolve().parents[2]
QUIET = dict(progress=False, log=lambda s: None)


def random_pixels(i: int, size: int = 12) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, (size, size, 3), dtype=np.uint8)


def _encode_random_png(item: Item) -> tuple[str, bytes]:
    buf = io.BytesIO()
    Image.fromarray(random_pixels(item.ref)).save(buf, format="PNG")
    return "png", buf.getvalue()


def read_back(folder: Path, split: str) -> dict[str, tuple[np.ndarray, int]]:
    info = read_dataset_info(folder)
    out = {}
    for shard in info.splits[split].shards:
        for raw in tario.iter_raw_samples(shard):
            _, data = tario.image_member(raw)
            out[raw.key] = (np.asarray(tario.decode_image(data)), tario.parse_label(raw, "cls"))
    return out


# ----------------------------------------------------------------------------- writer


def test_round_trip_png_is_lossless_and_shards_are_bounded(tmp_path: Path) -> None:
    items = [Item(label=i % 3, ref=i) for i in range(10)]
    source = Source("test", ["a", "b", "c"], {"train": items}, _encode_random_png, "png")
    write_dataset(source, tmp_path, max_samples_per_shard=3, **QUIET)
    info = read_dataset_info(tmp_path)
    split = info.splits["train"]
    assert [Path(s).name for s in split.shards] == [f"train-{i:06d}.tar" for i in range(4)]
    assert split.shard_counts == [3, 3, 3, 1] and split.num_samples == 10
    assert info.class_names == ["a", "b", "c"] and info.image_format == "png"
    back = read_back(tmp_path, "train")
    assert len(back) == 10
    # samples were shuffled before writing, so match them by content
    written = {tuple(random_pixels(i).ravel()[:32]): (random_pixels(i), i % 3) for i in range(10)}
    for pixels, label in back.values():
        ref_pixels, ref_label = written[tuple(pixels.ravel()[:32])]
        assert np.array_equal(pixels, ref_pixels) and label == ref_label


def test_byte_limit_per_shard(tmp_path: Path) -> None:
    w = ShardWriter(tmp_path, "train", max_samples=1000, max_bytes=10_000)
    for i in range(20):
        w.write(f"{i:06d}", {"png": b"x" * 1500, "cls": b"0"})
    records = w.close()
    assert len(records) > 1 and sum(r.num_samples for r in records) == 20
    assert all(r.num_samples <= 4 for r in records)  # 4 x (512 + 1536 + 512 + 512) bytes fit in 10 kB


def test_interrupted_write_leaves_no_half_shard_under_a_shard_name(tmp_path: Path) -> None:
    w = ShardWriter(tmp_path, "train", max_samples=3)
    for i in range(5):
        w.write(f"{i:06d}", {"png": b"x", "cls": b"0"})
    # the second shard is half written: only the first exists under a shard name
    assert sorted(p.name for p in tmp_path.glob("train-*.tar")) == ["train-000000.tar"]
    w.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train-000000.tar", "train-000000.tar.idx"]


def test_shards_go_through_the_one_atomic_write_and_a_killed_writers_temporary_is_cleared(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeline.data.shards as shards_mod
    from pipeline import atomic

    renamed: list[str] = []
    real = atomic.atomic_path

    def spy(path: str | Path):  # noqa: ANN202 - a context manager, as atomic_path
        renamed.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(shards_mod, "atomic_path", spy)
    w = ShardWriter(tmp_path, "train", max_samples=2)
    for i in range(3):
        w.write(f"{i:06d}", {"png": b"x", "cls": b"0"})
    hidden = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert len(hidden) == 1 and hidden[0].startswith(".train-000001.tar.")  # atomic_path's temporary name
    w.close()
    assert renamed == ["train-000000.tar", "train-000001.tar"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    # a writer killed mid-shard leaves its temporary file: the next --overwrite run removes it
    (tmp_path / ".train-000002.tar.123.abcd1234.tmp").write_bytes(b"half")
    write_dataset(synthetic_source(20, 2, 8), tmp_path, overwrite=True, **QUIET)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_writer_refuses_to_mix_with_old_shards_unless_overwrite(tmp_path: Path) -> None:
    source = synthetic_source(20, 2, 8)
    write_dataset(source, tmp_path, **QUIET)
    with pytest.raises(DataError, match="--overwrite"):
        write_dataset(source, tmp_path, **QUIET)
    write_dataset(source, tmp_path, overwrite=True, **QUIET)
    assert read_dataset_info(tmp_path).splits["train"].num_samples == 16


# ----------------------------------------------------------------------------- sources


def test_digits_source_has_1797_samples_10_classes_and_a_stratified_split(tmp_path: Path) -> None:
    write_dataset(digits_source(size=32), tmp_path, max_samples_per_shard=500, **QUIET)
    info = read_dataset_info(tmp_path)
    assert info.num_classes == 10 and info.image_format == "png"
    assert info.splits["train"].num_samples + info.splits["val"].num_samples == 1797
    val = read_back(tmp_path, "val")
    labels = np.bincount([label for _, label in val.values()], minlength=10)
    assert abs(len(val) - 0.2 * 1797) < 10 and labels.min() >= 33  # ~20% of each class (174-183 per class)
    pixels, _ = next(iter(val.values()))
    assert pixels.shape == (32, 32, 3)


def test_train_fraction_keeps_that_share_of_each_class_and_the_whole_val_split() -> None:
    full = digits_source(size=8)
    kept = keep_train_fraction(full, 0.1, seed=0)
    assert kept.splits["val"] == full.splits["val"]
    full_counts = np.bincount([it.label for it in full.splits["train"]], minlength=10)
    kept_counts = np.bincount([it.label for it in kept.splits["train"]], minlength=10)
    assert (kept_counts == np.round(0.1 * full_counts)).all() and kept_counts.sum() == 143
    refs = {it.ref for it in full.splits["train"]}
    assert {it.ref for it in kept.splits["train"]} <= refs  # a subset of the train split: val never leaks in
    assert [it.ref for it in keep_train_fraction(full, 0.1, seed=0).splits["train"]] == \
        [it.ref for it in kept.splits["train"]]  # seeded
    tiny = keep_train_fraction(full, 0.001, seed=0)  # round(0.001 x ~144) = 0: still one image per class
    assert sorted(it.label for it in tiny.splits["train"]) == list(range(10))
    for bad in (0.0, 1.5):
        with pytest.raises(DataError, match="--train-fraction"):
            keep_train_fraction(full, bad, seed=0)


def test_without_labels_writes_the_same_images_and_splits_and_no_label(tmp_path: Path) -> None:
    # Synthetic images are drawn from their class: the labels go, the images stay what they were.
    write_dataset(synthetic_source(30, 3, 16, seed=1), tmp_path / "labelled", **QUIET)
    write_dataset(without_labels(synthetic_source(30, 3, 16, seed=1)), tmp_path / "bare", **QUIET)
    info = read_dataset_info(tmp_path / "bare")
    assert (info.num_classes, info.class_names, info.label_key) == (0, [], "")
    for split in ("train", "val"):
        labelled = read_back(tmp_path / "labelled", split)
        bare = {raw.key: (tario.image_member(raw)[1], set(raw.members) - {"png", "jpg"})
                for shard in info.splits[split].shards for raw in tario.iter_raw_samples(shard)}
        assert bare.keys() == labelled.keys() and all(extra == set() for _, extra in bare.values())
        assert all(np.array_equal(np.asarray(tario.decode_image(data)), labelled[k][0]) for k, (data, _) in bare.items())


def test_synthetic_source_is_deterministic(tmp_path: Path) -> None:
    for name in ("a", "b"):
        write_dataset(synthetic_source(30, 3, 16, seed=1), tmp_path / name, **QUIET)
    for shard in ("train-000000.tar", "val-000000.tar"):
        assert (tmp_path / "a" / shard).read_bytes() == (tmp_path / "b" / shard).read_bytes()


_HELD = threading.Lock()


class _LockedEncoder:
    """An encoder that takes a lock of its module's, as any library call may take its own."""

    def __init__(self, encode):
        self.encode = encode

    def __call__(self, item):
        with _HELD:
            return self.encode(item)


def test_workers_start_clean_while_another_thread_holds_a_lock_the_encoder_takes(tmp_path: Path) -> None:
    """--workers 2 while another thread of make_shards holds a lock its encoder takes (issue 72): written, the
    same bytes as one process. Forked workers (before) inherit the lock held and wait on it for good."""
    src = synthetic_source(40, 4, 16, seed=3)
    write_dataset(src, tmp_path / "one", **QUIET)
    locked = dataclasses.replace(src, encode=_LockedEncoder(src.encode))
    writer = threading.Thread(target=write_dataset, args=(locked, tmp_path / "two"), kwargs={**QUIET, "workers": 2},
                              daemon=True)
    with _HELD:  # this thread's, while the writer's thread starts the workers
        writer.start()
        writer.join(120)
    assert not writer.is_alive(), "the workers wait on a lock held in make_shards when they started"
    for shard in ("train-000000.tar", "val-000000.tar"):
        assert (tmp_path / "one" / shard).read_bytes() == (tmp_path / "two" / shard).read_bytes()


def test_folder_source_reads_an_image_folder(tmp_path: Path) -> None:
    for c in ("cat", "dog"):
        (tmp_path / "imgs" / c).mkdir(parents=True)
        for i in range(10):
            Image.fromarray(random_pixels(i)).save(tmp_path / "imgs" / c / f"{i}.png")
    (tmp_path / "imgs" / "dog" / "broken.jpg").write_bytes(b"not an image")
    source = folder_source(str(tmp_path / "imgs"), val_fraction=0.2)
    summary = write_dataset(source, tmp_path / "out", **QUIET)
    assert summary.skipped == 1
    info = read_dataset_info(tmp_path / "out")
    assert info.class_names == ["cat", "dog"]
    assert info.splits["train"].num_samples + info.splits["val"].num_samples == 20
    assert info.splits["val"].num_samples in (3, 4)  # 2 of 10 cats, 2 of 11 dogs (one unreadable)


def test_an_empty_image_is_named_by_its_file_and_a_bad_sample_by_its_key_never_by_a_bytesio(tmp_path: Path) -> None:
    from pipeline.data import tario
    from pipeline.data.sources import Item, _FolderEncoder

    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "empty.jpg").write_bytes(b"")
    # make_shards' skipped line (the encoder's error) names the file and what is wrong with it
    with pytest.raises(tario.SampleError) as bad:
        _FolderEncoder(None, 95)(Item(-1, str(tmp_path / "imgs" / "empty.jpg")))
    assert str(bad.value) == f"corrupt_image: {tmp_path / 'imgs' / 'empty.jpg'}: not an image file PIL can read " \
                             "(empty: 0 bytes)"
    # A sample whose image is empty, read back: the sample's key and the file it came from, no '<_io.BytesIO'.
    raw = tario.RawSample("000007", 7, {"jpg": b"", tario.SOURCE_MEMBER: b"cats/IMG_7.jpg"})
    with pytest.raises(tario.SampleError) as bad:
        tario.decode(raw, "", None)
    assert str(bad.value) == "corrupt_image: sample '000007' (cats/IMG_7.jpg): not an image file PIL can read " \
                             "(empty: 0 bytes)"
    assert "BytesIO" not in str(bad.value) and tario.source_name(raw) == "cats/IMG_7.jpg"


@pytest.mark.slow
def test_make_shards_cli_writes_digits_and_reports_errors(tmp_path: Path) -> None:
    out = tmp_path / "digits"
    run = subprocess.run([sys.executable, str(ROOT / "launch/make_shards.py"), "--source", "digits",
                          "--out", str(out), "--no-progress"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "wrote 1797 samples in 3 shards" in run.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "launch/make_shards.py"), "--source", "nope",
                          "--out", str(tmp_path / "x")], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown --source 'nope'")


# ----------------------------------------------------------------------------- shards written by others


def _jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(random_pixels(i, 16)).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def write_img2dataset_shard(path: Path, start: int, n: int) -> None:
    """img2dataset's layout: KEY.jpg, KEY.txt (caption), KEY.json (metadata, here with a label)."""
    with tarfile.open(path, "w") as tar:
        for i in range(start, start + n):
            key = f"{i:09d}"
            members = {"jpg": _jpeg(i), "txt": f"a photo number {i}".encode(),
                       "json": json.dumps({"key": key, "caption": "x", "label": i % 5, "status": "success"}).encode()}
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_img2dataset_shards_are_indexed_and_read_with_a_json_label_key(tmp_path: Path) -> None:
    write_img2dataset_shard(tmp_path / "00000.tar", 0, 12)
    write_img2dataset_shard(tmp_path / "00001.tar", 12, 8)
    (tmp_path / "00000_stats.json").write_text("{}")
    index_shards({"train": str(tmp_path / "0000{0..1}.tar"), "val": str(tmp_path / "00001.tar")},
                 tmp_path, label_key="json:label", **QUIET)
    info = read_dataset_info(tmp_path)
    assert info.num_classes == 5 and info.label_key == "json:label"
    assert info.splits["train"].shard_counts == [12, 8]
    cfg = DataConfig(path=str(tmp_path), num_workers=0, hflip=0.0)
    ev = build_eval_loader(cfg, 16, 4)
    labels = [t[v].tolist() for _, t, v in ev]
    assert sorted(sum(labels, [])) == sorted(i % 5 for i in range(12, 20))
    images, targets = next(iter(build_train_loader(cfg, 16, 4, seed=0)))
    assert images.shape == (4, 3, 16, 16) and targets.max() < 5


def test_timm_info_json_layout_is_read(tmp_path: Path) -> None:
    w = ShardWriter(tmp_path, "imagenet-val", max_samples=5)
    for i in range(8):
        w.write(f"{i:06d}", {"jpg": _jpeg(i), "cls": str(i % 2).encode()})
    records = w.close()
    (tmp_path / "_info.json").write_text(json.dumps({"name": "tiny", "num_classes": 2, "splits": {"validation": {
        "name": "validation", "num_samples": 8, "filenames": [r.name for r in records],
        "shard_lengths": [r.num_samples for r in records]}}}))
    info = read_dataset_info(tmp_path)
    assert info.num_classes == 2 and info.splits["validation"].shard_counts == [5, 3]
    ev = build_eval_loader(DataConfig(path=str(tmp_path), val_split="validation", num_workers=0), 16, 3)
    assert sum(int(v.sum()) for _, _, v in ev) == 8


def test_label_parsing() -> None:
    raw = tario.RawSample("k", 0, {"cls": b" 7\n", "json": b'{"meta": {"y": 2}, "label": "3"}', "txt": b"x"})
    assert tario.parse_label(raw, "cls") == 7
    assert tario.parse_label(raw, "json") == 3
    assert tario.parse_label(raw, "json:meta.y") == 2
    for key, kind in [("txt", "bad_label"), ("json:nope", "missing_label"), ("png", "missing_label")]:
        with pytest.raises(tario.SampleError) as e:
            tario.parse_label(raw, key)
        assert e.value.kind == kind
    with pytest.raises(tario.SampleError, match="outside"):
        tario.parse_label(raw, "cls", num_classes=5)


# ----------------------------------------------------------------------------- dataset.json checks


@pytest.fixture
def small(tmp_path: Path) -> Path:
    write_dataset(synthetic_source(40, 2, 8), tmp_path, max_samples_per_shard=10, **QUIET)
    return tmp_path


def test_missing_dataset_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no dataset.json in .*make_shards.py"):
        read_dataset_info(tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        read_dataset_info(tmp_path / "nope")


def test_dataset_json_listing_a_missing_shard_is_an_error(small: Path) -> None:
    (small / "train-000001.tar").unlink()
    with pytest.raises(DataError, match=r"train-000001\.tar', which does not exist"):
        read_dataset_info(small)


def test_shard_rewritten_since_dataset_json_is_an_error(small: Path) -> None:
    shard = small / "train-000002.tar"
    shard.write_bytes(shard.read_bytes()[:-1024])
    with pytest.raises(DataError, match=r"train-000002\.tar' is \d+ bytes but the json says"):
        build_train_loader(DataConfig(path=str(small)), 8, 2, seed=0)


def test_counts_that_do_not_add_up_are_an_error(small: Path) -> None:
    data = json.loads((small / "dataset.json").read_text())
    data["splits"]["train"]["shards"][0]["num_samples"] += 1
    (small / "dataset.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match="num_samples is 32 but its shards hold 33"):
        read_dataset_info(small)


def test_shard_pattern_matching_nothing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="matches no files"):
        expand_shards(str(tmp_path / "*.tar"))
    with pytest.raises(DataError, match="does not exist"):
        expand_shards(str(tmp_path / "shard-{000..003}.tar"))


def test_stream_decodes_the_written_images(small: Path) -> None:
    cfg = DataConfig(path=str(small), num_workers=0, hflip=0.0, scale=(1.0, 1.0), ratio=(1.0, 1.0),
                     interpolation="bilinear")
    images, _ = next(iter(build_train_loader(cfg, 8, 4, seed=0)))
    # a full-image crop at the native size is the decoded image, normalised to [-1, 1]
    assert images.min() >= -1.0001 and images.max() <= 1.0001 and images.std() > 0.05
    assert torch.isfinite(images).all()


def test_eval_batches_equal_timm_per_image_transform(small: Path) -> None:
    """The fused per-batch normalisation gives what timm's ToTensor + Normalize gives per image."""
    from pipeline.data.transforms import eval_transform

    cfg = DataConfig(path=str(small), num_workers=0, mean=(0.4, 0.5, 0.6), std=(0.2, 0.3, 0.4))
    reference = eval_transform(cfg, (8, 8), to_float=True)
    expected = []
    for shard in read_dataset_info(small).splits["val"].shards:
        for raw in tario.iter_raw_samples(shard):
            expected.append(reference(tario.decode_image(tario.image_member(raw)[1])))
    got = torch.cat([images[valid] for images, _, valid in build_eval_loader(cfg, 8, 3)])
    assert got.shape == (len(expected), 3, 8, 8)
    torch.testing.assert_close(got, torch.stack(expected), atol=1e-5, rtol=0)


def test_shards_rewritten_under_a_run_are_refused_on_resume(tmp_path: Path) -> None:
    from pipeline.data.shards import file_sha256

    write_dataset(synthetic_source(64, 2, 8, val_fraction=0.0), tmp_path, max_samples_per_shard=16, **QUIET)
    info = json.loads((tmp_path / "dataset.json").read_text())
    entry = info["splits"]["train"]["shards"][0]
    assert entry["sha256"] == file_sha256(tmp_path / entry["name"])
    cfg = DataConfig(path=str(tmp_path), num_workers=0, cache_dir=str(tmp_path / "cache"))
    loader = build_train_loader(cfg, 8, 4, seed=0, ids_only=True)
    next(loader)
    state = loader.state_dict()
    build_train_loader(cfg, 8, 4, seed=0, ids_only=True).load_state_dict(state)  # unchanged: fine
    # the same names and counts, written again from another shuffle: other samples at the same positions
    write_dataset(synthetic_source(64, 2, 8, val_fraction=0.0, seed=1), tmp_path, max_samples_per_shard=16,
                  overwrite=True, **QUIET)
    with pytest.raises(DataError, match=r"the shards were rewritten since the checkpoint \(the sha256 digests"):
        build_train_loader(cfg, 8, 4, seed=0, ids_only=True).load_state_dict(state)


def test_a_runs_dataset_json_at_a_url_is_read_with_its_data_retry_settings(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer reads dataset.json through dataset_info_of: data.retry_* apply, not RetryPolicy's defaults."""
    import pipeline.remote.storage as storage
    from pipeline.data import dataset_info_of

    write_dataset(synthetic_source(8, 2, 8), tmp_path, **QUIET)
    seen = []

    def read_bytes(url: str, policy: storage.RetryPolicy | None = None) -> bytes:
        seen.append((url, policy))
        return (tmp_path / "dataset.json").read_bytes()

    monkeypatch.setattr(storage, "read_bytes", read_bytes)
    cfg = DataConfig(path="s3://bucket/digits", retry_attempts=3, retry_time_s=7.0, read_timeout_s=2.0)
    info = dataset_info_of(cfg)
    assert info.splits["train"].num_samples > 0
    [(url, policy)] = seen
    assert url == "s3://bucket/digits/dataset.json"
    assert policy == storage.RetryPolicy.from_config(cfg)
    assert (policy.attempts, policy.total_s, policy.timeout_s) == (3, 7.0, 2.0)
