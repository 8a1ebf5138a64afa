"""MAE pretraining around the model: the config, each sample's mask from its global position (the same on
any layout and after a resume), label-free shards, the k-NN vote."""

from __future__ import annotations

import dataclasses
import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.config import ConfigError, DataConfig
from pipeline.data import build_train_loader, read_dataset_info
from pipeline.data.shards import index_shards, synthetic_source, write_dataset
from pipeline.data.sources import folder_source
from pipeline.eval.knn import knn_top1
from pipeline.objectives import load_config
from pipeline.objectives.mae.objective import eval_noise, mae_model_kwargs, train_noise, train_noise_fn


def test_config_selects_the_objective_and_builds_the_papers_decoder():
    cfg = load_config("configs/pretrain/mae_demo.yaml")
    assert cfg.model.objective == "mae" and cfg.mae.mask_ratio == 0.75
    kwargs = mae_model_kwargs(load_config(None, ["model.objective=mae", "model.variant=vit_l16"]))
    assert (kwargs["embed_dim"], kwargs["depth"], kwargs["decoder_embed_dim"], kwargs["decoder_depth"],
            kwargs["decoder_num_heads"], kwargs["norm_pix_loss"]) == (1024, 24, 512, 8, 16, True)
    with pytest.raises(ConfigError, match="unknown key 'mae.mask'"):
        load_config(None, ["mae.mask=0.5"])
    with pytest.raises(ConfigError, match="'mae.mask_ratio' must be in \\[0, 1\\)"):
        load_config(None, ["mae.mask_ratio=1.0"])
    with pytest.raises(ConfigError, match="'data.mixup' must be 0 with model.objective 'mae'"):
        load_config(None, ["model.objective=mae", "data.cutmix=1.0"])
    with pytest.raises(ConfigError, match="model.objective"):
        load_config(None, ["model.objective=byol"])


@pytest.mark.parametrize("recipe", ["mae_vit_b16", "mae_vit_l16"])
def test_paper_recipes_load(recipe):
    cfg = load_config(f"configs/pretrain/{recipe}.yaml")
    assert cfg.model.objective == "mae" and cfg.train.betas == (0.9, 0.95) and cfg.train.weight_decay == 0.05
    assert cfg.data.scale == (0.2, 1.0) and cfg.mae.norm_pix_loss
    # base lr 1.5e-4 x batch / 256
    assert cfg.train.lr == pytest.approx(1.5e-4 * cfg.train.global_batch_size / 256)


def test_noise_is_a_function_of_seed_and_position_only():
    a = train_noise(0, [5, 6, 7], 196)
    assert a.shape == (3, 196) and a.dtype == torch.float64
    assert torch.equal(a[1:], train_noise(0, [6, 7], 196))  # the same row whatever comes with it
    assert not torch.equal(a, train_noise(1, [5, 6, 7], 196))  # the seed matters
    assert not torch.equal(train_noise(0, [5], 196), eval_noise(0, [5], 196))  # its own stream
    assert len(set(a[0].tolist())) == 196  # no ties to break


def id_shards(folder: Path, n: int = 48) -> DataConfig:
    write_dataset(synthetic_source(n, 4, 8), folder, max_samples_per_shard=10, progress=False, log=lambda s: None)
    return DataConfig(path=str(folder), num_workers=0, shuffle_span=16)


def masks_by_sample(cfg: DataConfig, world: int, micro: int, steps: int, G: int, start_step: int = 0):
    """{step: {sample id: noise row}} over all ranks of a layout, as the trainer draws them."""
    out: dict[int, dict[int, tuple]] = {}
    for rank in range(world):
        loader = build_train_loader(cfg, 8, micro, seed=3, rank=rank, world_size=world, global_batch_size=G,
                                    ids_only=True)
        if start_step:
            loader.load_state_dict({**loader.state_dict(), "position": start_step * G})
        for step in range(start_step, steps):
            for _ in range(loader.accum):
                ids, _ = next(loader)
                noise = train_noise(3, loader.last_positions, 4)
                for sid, row in zip(ids.tolist(), noise):
                    out.setdefault(step, {})[sid] = tuple(row.tolist())
    return out


def test_a_samples_mask_is_the_same_on_1_and_2_ranks_and_after_a_resume(tmp_path):
    cfg = id_shards(tmp_path)
    G = 8
    one = masks_by_sample(cfg, 1, 4, 5, G)  # 1 rank, 2 micro batches per step
    two = masks_by_sample(cfg, 2, 4, 5, G)  # 2 ranks, 1 each
    assert one == two
    assert all(len(one[s]) == G for s in one)
    resumed = masks_by_sample(cfg, 2, 2, 5, G, start_step=3)  # resumed at step 3 on another micro batch
    assert {s: one[s] for s in (3, 4)} == resumed
    assert one[0] != one[1]


def test_the_workers_draw_the_noise_the_trainer_would(tmp_path):
    """The trainer takes each micro batch's mask noise from the loader (drawn in its DataLoader workers,
    off the training thread): row for row what train_noise gives for the batch's positions."""
    cfg = dataclasses.replace(id_shards(tmp_path), num_workers=2)
    loader = build_train_loader(cfg, 8, 4, seed=3, global_batch_size=8, per_batch=train_noise_fn(3, 4))
    try:
        for _ in range(5):
            next(loader)
            assert torch.equal(loader.last_per_batch, train_noise(3, loader.last_positions, 4))
    finally:
        loader.close()


def png_bytes(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_folder_without_classes_writes_label_free_shards(tmp_path):
    images = tmp_path / "photos"
    images.mkdir()
    for i in range(20):
        (images / f"img{i:02d}.png").write_bytes(png_bytes(i))
    out = tmp_path / "shards"
    write_dataset(folder_source(str(images), val_fraction=0.2), out, progress=False, log=lambda s: None)
    info = read_dataset_info(out)
    assert info.num_classes == 0 and info.class_names == [] and info.label_key == ""
    assert info.splits["train"].num_samples == 16 and info.splits["val"].num_samples == 4
    with tarfile.open(info.splits["train"].shards[0]) as tar:
        names = tar.getnames()
    assert names and all(n.endswith((".png", ".src")) for n in names)  # no .cls member; .src: the file's name
    # Shards written by others without labels index as label-free too.
    reindexed = tmp_path / "indexed"
    lines = []
    index_shards({"train": f"{out}/train-*.tar"}, reindexed, progress=False, log=lines.append)
    assert read_dataset_info(reindexed).num_classes == 0
    assert any("label-free" in line for line in lines)
    # And MAE's train stream reads them (labels come back as -1).
    loader = build_train_loader(DataConfig(path=str(out), num_workers=0, label_key=""), 8, 4, seed=0)
    images_batch, targets = next(loader)
    assert images_batch.shape == (4, 3, 8, 8) and targets.tolist() == [-1] * 4
    assert not loader.bad_counts()


def test_knn_vote_by_hand():
    mem = torch.nn.functional.normalize(torch.tensor([[1.0, 0], [0.9, 0.1], [0, 1.0], [0.1, 0.9], [0, 1]]), dim=1)
    mem_labels = torch.tensor([0, 0, 1, 1, -1])  # the last is padding: ignored
    val = torch.nn.functional.normalize(torch.tensor([[1.0, 0.05], [0.05, 1.0], [0.7, 0.7]]), dim=1)
    # k=2: the first votes 0, the second 1 (the third, label -1, is padding and not scored)
    assert knn_top1(val, torch.tensor([0, 1, -1]), mem, mem_labels, k=2)["eval/knn_top1"] == 1.0
    assert knn_top1(val, torch.tensor([1, 1, -1]), mem, mem_labels, k=2)["eval/knn_top1"] == 0.5
    assert knn_top1(val, torch.tensor([1, 0, -1]), mem, mem_labels, k=2)["eval/knn_top1"] == 0.0


def test_finetune_without_config_from_an_mae_run_uses_maes_recipe(tmp_path, monkeypatch):
    from pipeline.commands import finetune_config, parse_finetune_args
    from pipeline.config import save_config

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)
    run = tmp_path / "runs" / "mae"
    run.mkdir(parents=True)
    save_config(load_config(repo / "configs/pretrain/mae_demo.yaml", ["run.dir=runs/mae"]), run / "config.yaml")
    (run / "model.safetensors").write_bytes(b"w")
    cfg, _ = finetune_config(parse_finetune_args(["--res", "64"]))
    assert cfg.model.objective == "supervised" and cfg.model.global_pool == "avg"
    assert (cfg.model.embed_dim, cfg.model.depth, cfg.model.drop_path_rate) == (96, 4, 0.1)  # source's, recipe's
    assert (cfg.train.layer_decay, cfg.train.lr, cfg.train.betas) == (0.65, 2.0e-3, (0.9, 0.999))
    assert (cfg.data.mixup, cfg.data.cutmix, cfg.data.label_smoothing) == (0.8, 1.0, 0.1)
    assert cfg.data.auto_augment == "rand-m9-mstd0.5-inc1" and cfg.data.path == "data/digits"
    assert cfg.model.img_size == 64 and cfg.run.dir == "runs/mae-ft64"


def test_probe_freezes_the_encoder_and_trains_a_batchnorm_linear_head(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from pipeline.commands import finetune_config, parse_finetune_args
    from pipeline.config import save_config
    from pipeline.model.mae import build_mae
    from pipeline.model.vit import build_vit
    from pipeline.run.finetune import Source, load_pretrained

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)
    run = tmp_path / "runs" / "mae"
    run.mkdir(parents=True)
    src_cfg = load_config(repo / "configs/pretrain/mae_demo.yaml", ["run.dir=runs/mae"])
    save_config(src_cfg, run / "config.yaml")
    mae = build_mae("vit_ti16", img_size=32, patch_size=4, embed_dim=96, depth=4, num_heads=3,
                    decoder_embed_dim=64, decoder_depth=2, decoder_num_heads=4)
    save_file({**{k: v.contiguous() for k, v in mae.state_dict().items()}}, str(run / "model.safetensors"))
    cfg, _ = finetune_config(parse_finetune_args(["--probe", "--res", "32"]))
    assert cfg.finetune.probe and cfg.train.optimizer == "sgd" and cfg.model.global_pool == "token"
    assert cfg.data.mixup == 0 and cfg.data.auto_augment is None  # the probe's recipe, not the fine-tune's

    vit = build_vit("vit_ti16", img_size=32, patch_size=4, embed_dim=96, depth=4, num_heads=3, num_classes=10)
    load_pretrained(vit, Source(run, src_cfg), 32, probe=True)
    trained = [n for n, p in vit.named_parameters() if p.requires_grad]
    assert trained == ["head.1.weight", "head.1.bias"]
    bn = vit.head[0]
    assert isinstance(bn, torch.nn.BatchNorm1d) and not bn.affine and bn.eps == 1e-6
    torch.testing.assert_close(vit.blocks[0].attn.qkv.weight, mae.blocks[0].attn.qkv.weight)
    assert vit(torch.randn(4, 3, 32, 32)).shape == (4, 10)


@pytest.mark.slow
def test_mae_bench_times_both_steps_and_predicts_the_ratio(monkeypatch):
    import argparse

    from benchmarks import mae as mae_bench
    from benchmarks.mae import bench_mae
    from pipeline.model.mae import mae_flops, mae_kwargs
    from pipeline.model.vit import model_flops, variant_kwargs

    monkeypatch.setattr(mae_bench, "device_peak_flops", lambda override=None: 1e9)  # MFU in (0.1, 10): 4 decimals
    figures = bench_mae(argparse.Namespace(mae_variant="vit_ti16", mae_res=32, mae_batch=2, mae_steps=1,
                                           mae_windows=1))
    flops = {"mae": mae_flops(mae_kwargs("vit_ti16", img_size=32)),
             "supervised": model_flops(variant_kwargs("vit_ti16", img_size=32, num_classes=1000))}
    for name, f in flops.items():  # MFU: 3 x forward FLOPs x images/s over the peak, as the trainer's
        assert figures[name]["mfu"] == pytest.approx(3 * f * figures[name]["img_s"] / 1e9, rel=0.01)
    assert figures["mae"]["step_ms"] > 0 and figures["supervised"]["step_ms"] > 0
    assert figures["mae_vs_supervised"] == pytest.approx(figures["mae"]["step_ms"] / figures["supervised"]["step_ms"],
                                                         rel=0.01)
    predicted = mae_flops(mae_kwargs("vit_ti16", img_size=32)) / model_flops(
        variant_kwargs("vit_ti16", img_size=32, num_classes=1000))
    assert figures["flop_ratio"] == pytest.approx(predicted, abs=1e-3)
