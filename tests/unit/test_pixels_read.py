"""Pixels as they are, read (issue 62): array members through the train and eval loaders as C-channel float
tensors normalised by dataset.json's statistics, what is refused on such a set (one line), NaN pixels counted as
bad, and a supervised run of a few steps on 1-channel 16-bit and 4-channel shards."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config import DataConfig
from pipeline.data import DataError, build_eval_loader, build_train_loader
from pipeline.data.pixels import encode_array
from pipeline.data.shards import ShardWriter, folder_source, write_dataset
from tests.integration.runs import TINY, metrics, run, run_here

QUIET = dict(progress=False, log=lambda s: None)
NORMALISED = dict(mean=None, std=None, num_workers=0)


def array_set(root: Path, channels: int, dtype: str, n: int = 32, size: int = 16, classes: int = 2) -> Path:
    """A labelled folder of .npy images (class c brighter in channel 0) written as shards; the shards' folder."""
    rng = np.random.default_rng(channels)
    hi = 60000 if dtype == "uint16" else 1.0
    for i in range(n):
        c = i % classes
        img = rng.uniform(0, hi / 2, (size, size, channels))
        img[..., 0] += c * hi / 2
        (root / "src" / str(c)).mkdir(parents=True, exist_ok=True)
        np.save(root / "src" / str(c) / f"{i}.npy", img.astype(dtype))
    write_dataset(folder_source(str(root / "src"), val_fraction=0.25), root / "shards", max_samples_per_shard=8,
                  **QUIET)
    return root / "shards"


def test_train_and_eval_batches_have_the_sets_channels_normalised(tmp_path):
    shards = array_set(tmp_path, 4, "uint16")
    info = json.loads((shards / "dataset.json").read_text())
    cfg = DataConfig(path=str(shards), hflip=0.0, scale=(1.0, 1.0), ratio=(1.0, 1.0), **NORMALISED)
    images, _ = next(iter(build_train_loader(cfg, 16, 8, seed=0)))
    assert images.shape == (8, 4, 16, 16) and images.dtype.is_floating_point
    # the whole image at its own size: the crop is the identity, the values (x - mean) / std of dataset.json's
    per_channel = images.transpose(0, 1).reshape(4, -1)
    assert (per_channel.mean(1).abs() < 0.6).all() and ((per_channel.std(1) - 1).abs() < 0.5).all()
    assert len(info["mean"]) == 4
    ev_images, _, _ = next(iter(build_eval_loader(DataConfig(path=str(shards), crop_pct=1.0, **NORMALISED), 16, 4)))
    assert ev_images.shape == (4, 4, 16, 16)


def test_the_crop_is_the_array_itself_when_it_covers_it(tmp_path):
    shards = array_set(tmp_path, 1, "uint16", n=8)
    info = json.loads((shards / "dataset.json").read_text())
    cfg = DataConfig(path=str(shards), val_split="val", crop_pct=1.0, **NORMALISED)
    ev_images, _, _ = next(iter(build_eval_loader(cfg, 16, 2)))
    import tarfile
    with tarfile.open(shards / "val-000000.tar") as tar:
        first = np.load(io.BytesIO(tar.extractfile(sorted(m for m in tar.getnames() if m.endswith(".npy"))[0]).read()))
    expected = (first[..., 0].astype(np.float64) - info["mean"][0]) / info["std"][0]
    np.testing.assert_allclose(ev_images[0, 0].numpy(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("overrides, match", [
    (dict(color_jitter=0.4), "data.color_jitter=0.4: colour transforms are defined for 8-bit RGB, and .* holds "
                             "4-channel uint16 images"),
    (dict(auto_augment="rand-m9-mstd0.5"), "data.auto_augment='rand-m9-mstd0.5': colour transforms"),
    (dict(mean=(0.4, 0.4, 0.4)), r"data.mean has 3 values and .* holds 4-channel uint16 images \(data.mean: null"),
])
def test_what_an_array_set_refuses_is_one_line(tmp_path, overrides, match):
    shards = array_set(tmp_path, 4, "uint16", n=8)
    cfg = DataConfig(path=str(shards), **{**NORMALISED, **overrides})
    with pytest.raises(DataError, match=match):
        build_train_loader(cfg, 16, 4, seed=0)


def test_an_array_set_under_the_rgb_default_statistics_takes_its_own(tmp_path):
    """data.mean/std left at their 8-bit RGB default mean dataset.json's statistics for an array set, 3 channels
    included (0.5 in uint16 counts would normalise silently wrong); values set otherwise are kept."""
    from pipeline.data import read_dataset_info
    from pipeline.data.pixels import resolve_data

    shards = array_set(tmp_path, 3, "uint16", n=8)
    info = read_dataset_info(shards)
    got = resolve_data(DataConfig(path=str(shards), num_workers=0), info)
    assert got.mean == tuple(info.pixels["mean"]) and got.std == tuple(info.pixels["std"])
    assert got.mean[0] > 1  # uint16 counts, not [0, 1]
    mine = resolve_data(DataConfig(path=str(shards), num_workers=0, mean=(100.0,) * 3, std=(10.0,) * 3), info)
    assert mine.mean == (100.0,) * 3 and mine.std == (10.0,) * 3


def test_an_eval_set_of_other_channels_than_the_runs_is_one_line_before_anything_is_read(tmp_path):
    from types import SimpleNamespace

    from pipeline.dist import DistEnv
    from pipeline.eval.sets import EvalSets

    env = DistEnv(0, 0, 1, "127.0.0.1", 0, "test")
    four = array_set(tmp_path / "four", 4, "uint16", n=8)
    sets = SimpleNamespace(sets={"bands": str(four)}, train_split="train", val_split="val", memory_samples=0)
    with pytest.raises(DataError, match=r"eval.sets.bands: .* holds 4-channel images and the run's model takes 3"):
        EvalSets.build(sets, DataConfig(path="elsewhere", num_workers=0), env, (16, 16), 4)
    one = array_set(tmp_path / "one", 1, "uint16", n=8)
    run_data = DataConfig(path=str(one), num_workers=0, mean=(100.0,), std=(10.0,))  # a 1-channel run's, resolved
    with pytest.raises(DataError, match=r"eval.sets.bands: .* holds 4-channel images and the run's model takes 1"):
        EvalSets.build(sets, run_data, env, (16, 16), 4)
    assert EvalSets.build(SimpleNamespace(**{**vars(sets), "sets": {"own": str(one)}}), run_data, env, (16, 16), 4)


def test_null_statistics_of_an_rgb_set_is_one_line(tmp_path):
    from PIL import Image
    (tmp_path / "src" / "a").mkdir(parents=True)
    for i in range(4):
        Image.new("RGB", (8, 8), (i * 9, 0, 0)).save(tmp_path / "src" / "a" / f"{i}.png")
    write_dataset(folder_source(str(tmp_path / "src"), val_fraction=0), tmp_path / "shards", **QUIET)
    with pytest.raises(DataError, match="data.mean: null takes dataset.json's statistics, and .* has none"):
        build_train_loader(DataConfig(path=str(tmp_path / "shards"), **NORMALISED), 8, 4, seed=0)


def test_nan_pixels_are_counted_as_bad_samples(tmp_path):
    rng = np.random.default_rng(0)
    writer = ShardWriter(tmp_path, "train", 16)
    for i in range(16):
        img = rng.normal(0, 1, (8, 8, 2)).astype(np.float32)
        if i == 5:
            img[3, 3, 1] = np.inf
        writer.write(f"{i:06d}", {"npy": encode_array(img), "cls": b"0"})
    records = writer.close()
    (tmp_path / "dataset.json").write_text(json.dumps({
        "format": "vit-pipeline-shards", "version": 1, "num_classes": 1, "class_names": ["0"], "image_format": "npy",
        "label_key": "cls", "channels": 2, "dtype": "float32", "mean": [0.0, 0.0], "std": [1.0, 1.0],
        "splits": {"train": {"num_samples": 16, "shards": [{"name": r.name, "num_samples": r.num_samples}
                                                           for r in records]}}}))
    loader = build_train_loader(DataConfig(path=str(tmp_path), **NORMALISED), 8, 16, seed=0)
    images, _ = next(iter(loader))
    counters = loader.counters()
    assert sum(counters.bad.values()) == 1 and "1 NaN/inf pixels" in str(counters.causes)
    assert np.isfinite(images.numpy()).all()


def test_the_digits_as_16_bit_arrays_keep_their_17_grey_levels(tmp_path):
    """make_shards --source digits --dtype uint16 (the 16-bit MAE demo's data): at their own 8 px, each image is the
    digit's levels 0-16 x 65535/16, one channel, and dataset.json's statistics are NumPy's over the train split."""
    from sklearn.datasets import load_digits

    from pipeline.data import read_dataset_info
    from pipeline.data.shards import digits_source

    write_dataset(digits_source(8, 0.2, 0, "uint16"), tmp_path, **QUIET)
    info = read_dataset_info(tmp_path)
    assert (info.pixels["channels"], info.pixels["dtype"], info.image_format) == (1, "uint16", "npy")
    import tarfile
    seen = []
    for shard in info.splits["train"].shards:
        with tarfile.open(shard) as tar:
            seen += [np.load(io.BytesIO(tar.extractfile(m).read())) for m in tar.getmembers() if m.name.endswith(".npy")]
    assert all(a.shape == (8, 8, 1) and a.dtype == np.uint16 for a in seen)
    grey = {int(round(k * 65535 / 16)) for k in range(17)}  # at their own size: the levels, scaled, nothing between
    assert set(np.unique(np.stack(seen)).tolist()) == grey == set(np.round(np.unique(load_digits().images) * 65535 / 16))
    seen = [a.astype(np.float64) for a in seen]
    stack = np.stack(seen)
    assert len(seen) == info.splits["train"].num_samples
    np.testing.assert_allclose(info.pixels["mean"], [stack.mean()], rtol=1e-6)
    np.testing.assert_allclose(info.pixels["std"], [stack.std()], rtol=1e-6)


MAE = ["model.objective=mae", "mae.decoder_embed_dim=16", "mae.decoder_depth=1", "mae.decoder_num_heads=2",
       "mae.knn_train_samples=16", "mae.recon_images=2", "train.grad_clip=0.0"]  # tests/integration/test_mae.py's
# tests/integration/test_dino.py's and test_dinov3.py's, smaller (crops of 16 and 8 px on the TINY ViT)
DINOV2 = ["model.objective=dinov2", "dino.local_crops_number=2", "dino.local_crops_size=8",
          "dino.head_n_prototypes=64", "dino.head_hidden_dim=32", "dino.head_bottleneck_dim=16",
          "dino.knn_train_samples=16", "dino.pca_images=2", "train.grad_clip=0.0"]
DINOV3 = ["model.objective=dinov3", "model.variant=dinov3_vits16", "dinov3.local_crops_number=2",
          "dinov3.local_crops_size=8", "dinov3.head_n_prototypes=64", "dinov3.head_hidden_dim=32",
          "dinov3.head_bottleneck_dim=16", "dinov3.ibot_head_n_prototypes=48", "dinov3.ibot_head_bottleneck_dim=16",
          "dinov3.knn_train_samples=16", "dinov3.pca_images=0", "gram.loss_weight=1.0", "gram.start_step=2",
          "gram.update_every=2", "gram.max_updates=1", "train.grad_clip=0.0"]


@pytest.mark.slow
@pytest.mark.parametrize("channels, dtype, config, recipe, judged", [
    (4, "float32", "configs/pretrain/demo.yaml", [], "eval/top1"),
    (4, "uint16", "configs/pretrain/mae_demo.yaml", MAE, "eval/recon_loss"),
    (1, "uint16", "configs/pretrain/dino_demo.yaml", DINOV2, "eval/knn_top1"),
    (4, "uint16", "configs/pretrain/dinov3_demo.yaml", DINOV3, "eval/knn_top1"),
], ids=["supervised-4ch-float32", "mae-4ch-uint16", "dinov2-1ch-uint16",
        "dinov3-4ch-uint16-gram"])
def test_a_run_trains_on_c_channel_shards(tmp_path, channels, dtype, config, recipe, judged):
    """A 4-step run of each recipe, one process; the other channel count of each trains (and resumes on another
    layout) in tests/integration/test_pixels_resume.py: supervised, MAE and DINOv3 on 1 channel, DINOv2 on 4."""
    shards = array_set(tmp_path, channels, dtype)
    run_dir = tmp_path / "run"
    out = run_here("pretrain.py", config,
                   [*TINY, *recipe, f"data.path={shards}", "data.mean=null", "data.std=null", f"run.dir={run_dir}",
                    "train.steps=4", "train.eval_every=4", "deepspeed.bf16=false"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    saved = (run_dir / "config.yaml").read_text()
    assert f"in_chans: {channels}" in saved
    losses = [m["metrics"]["train/loss"] for m in metrics(run_dir) if "train/loss" in m["metrics"]]
    assert losses and all(np.isfinite(losses))
    assert any(judged in m["metrics"] for m in metrics(run_dir))
    if recipe is MAE:  # the reconstructions of C channels are drawn (the first channel, in grey)
        assert list((run_dir / "reconstructions").glob("*.png"))
    if recipe is DINOV2:  # and DINOv2's PCA figure
        assert list((run_dir / "pca").glob("*.png"))
    if recipe in (DINOV2, DINOV3):  # the recipe's colour transforms are off on an array set (pixels.py)
        assert "color_jitter_p: 0.0" in saved and "solarize_p: 0.0" in saved


@pytest.mark.slow  # one process (DeepSpeed's engine is built once per process: not in pytest's)
def test_mae_trains_a_few_steps_on_13_bands(tmp_path):
    """A Sentinel-2-like set (13 float32 bands): MAE's patches of 4 x 4 x 13 through the trainer, two steps."""
    from tests.integration.runs import weights

    shards, run_dir = array_set(tmp_path, 13, "float32", n=16), tmp_path / "run"
    out = run("pretrain.py", "configs/pretrain/mae_demo.yaml",
              [*TINY, *MAE, f"data.path={shards}", "data.mean=null", "data.std=null", f"run.dir={run_dir}",
               "train.steps=2", "train.global_batch_size=8", "train.eval_every=0", "deepspeed.bf16=false"], ranks=1)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "in_chans: 13" in (run_dir / "config.yaml").read_text()
    exported = weights(run_dir)  # Meta's MAE layout: the encoder's projection and the decoder's pixel target
    assert exported["patch_embed.proj.weight"].shape == (32, 13, 4, 4)
    assert exported["decoder_pred.weight"].shape == (4 * 4 * 13, 16)
    losses = [m["metrics"]["train/loss"] for m in metrics(run_dir) if "train/loss" in m["metrics"]]
    assert len(losses) == 1 and np.isfinite(losses).all(), losses


def test_an_objective_that_does_not_read_arrays_yet_and_another_in_chans_are_one_line(tmp_path):
    from pipeline.config import Config
    from pipeline.data import read_dataset_info
    from pipeline.data.pixels import resolve_pixels

    shards = array_set(tmp_path, 4, "uint16", n=8)
    info = read_dataset_info(shards)
    cfg = Config()
    cfg.data = DataConfig(path=str(shards), **NORMALISED)
    resolved = resolve_pixels(cfg, info)
    assert resolved.model.in_chans == 4 and len(resolved.data.mean) == 4 and cfg.model.in_chans is None
    cfg.model.in_chans = 3
    with pytest.raises(DataError, match="model.in_chans=3, and .* holds 4-channel images"):
        resolve_pixels(cfg, info)
    cfg.model.in_chans, cfg.model.objective = None, "distill"
    with pytest.raises(DataError, match="model.objective=distill: .* the supervised, MAE, DINOv2 and DINOv3 obj"):
        resolve_pixels(cfg, info)


def test_the_multicrop_of_an_array_has_its_channels_and_no_colour_transform(tmp_path):
    """DINOv2's and DINOv3's crops of an H x W x C array: C-channel float crops (Gram's too) normalised in the
    pixels' units; on a constant image every crop is (v - mean) / std (bicubic, flip and blur keep a constant),
    which a colour transform would not. A colour probability set on such a set is one line; at the recipe's
    default it is turned off."""
    from pipeline.config import Config
    from pipeline.data import read_dataset_info
    from pipeline.data.multicrop import MultiCrop, MultiCropConfig
    from pipeline.data.pixels import resolve_pixels
    from pipeline.objectives import ObjectivesConfig

    for channels in (1, 4):
        mean, std = tuple(range(100, 100 + channels)), (7.0,) * channels
        cfg = MultiCropConfig(global_crops_size=16, local_crops_size=8, local_crops_number=2, gram_crops_size=24,
                              color_jitter_p=0, greyscale_p=0, solarize_p=0, mean=mean, std=std)
        image = np.full((20, 24, channels), 1000, np.uint16)
        crops = MultiCrop(cfg)(image, seed=3)
        for key, size in (("global_crops", 16), ("local_crops", 8), ("gram_crops", 24)):
            for crop in crops[key]:
                assert crop.shape == (channels, size, size) and crop.dtype == torch.float32
                expected = ((1000 - torch.tensor(mean, dtype=torch.float32)) / 7.0).view(-1, 1, 1).expand_as(crop)
                torch.testing.assert_close(crop, expected, rtol=1e-5, atol=1e-4)
    shards = array_set(tmp_path, 4, "uint16", n=8)
    info = read_dataset_info(shards)
    run = ObjectivesConfig()
    run.data, run.model.objective = DataConfig(path=str(shards), **NORMALISED), "dinov3"
    resolved = resolve_pixels(run, info)
    assert (resolved.dinov3.color_jitter_p, resolved.dinov3.greyscale_p, resolved.dinov3.solarize_p) == (0, 0, 0)
    run.model.objective, run.dino.solarize_p = "dinov2", 0.5
    with pytest.raises(DataError, match=r"dino.solarize_p=0.5: colour transforms are defined for 8-bit RGB, and .* "
                                        r"holds 4-channel uint16 images \(arrays\): set dino.solarize_p=0"):
        resolve_pixels(run, info)
    assert isinstance(run, Config)
