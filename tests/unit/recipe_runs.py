"""Tiny runs of every recipe and files in every foreign layout, for tests/unit/test_recipe_matrix.py: what each
downstream command reads, made without training (a run directory as the trainer leaves it: config.yaml and
model.safetensors with its metadata) and with the features each one must give (the reference).

A run's reference is its objective's own `features` (what eval.sets judged during training: a DINO run's
teacher, an MAE run's encoder), a file's is the model that wrote it (timm's, or Meta's layout made from
timm's tensors by the key tables of test_layouts.py and test_dinov3_official.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import timm
import torch
from torch import nn

from pipeline.config import ConfigFiles, DataConfig, save_config
from pipeline.data import dataset_info_of
from pipeline.data.pixels import resolve_pixels
from pipeline.eval.features import embedding
from pipeline.model.weights import save_weights
from pipeline.objectives import RECIPES, ObjectivesConfig, build_objective, load_config

ROOT = Path(__file__).resolve().parents[2]
SHRINK = ["model.depth=2", "model.grad_checkpointing=false", "data.num_workers=0", "tracking.enabled=false"]
Features = Callable[[torch.Tensor], torch.Tensor]  # images -> embedding rows (class token, mean patch token)


@dataclass
class Source:
    path: Path  # what --from names
    reference: Features
    img_size: int  # the size it was trained at (the exports are checked there)
    timm_class: str | None  # the class timm builds its export as (None: timm has none, the export is refused)
    finetune: list[str]  # what `launch/finetune.py` needs beside --from (a --config for a bare file)
    in_chans: int = 3  # the images' channels (a run on an array set: its set's, issue 62)


def demo_config(recipe: str) -> Path:
    """The recipe's demo (configs/pretrain/*demo*.yaml whose model.objective is the recipe, the shortest name):
    a recipe added later is in the matrix once it has one."""
    files = ConfigFiles(ObjectivesConfig)
    found = sorted((p for p in (ROOT / "configs/pretrain").glob("*demo*.yaml")
                    if files.load(p).model.objective == recipe), key=lambda p: len(p.name))
    assert found, f"recipe {recipe!r} has no demo config (configs/pretrain/<name>_demo.yaml): the matrix needs one"
    return found[0]


def randomise(*modules: nn.Module) -> None:
    """Every parameter random, of a size that keeps activations O(1): LayerScale's 1e-5 and the zero biases
    would hide the blocks, and a read-back that drops them would go unseen."""
    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                p.copy_(torch.randn_like(p) / (math.sqrt(p[0].numel()) if p.ndim > 1 else 4.0))


def recipe_needs(recipe: str, folder: Path) -> list[str]:
    """Overrides for what a recipe's demo config names outside the repository, made in `folder`: a
    distillation's teacher (timm's DINOv3 layout: patch 16, a grid resized to the student's)."""
    if recipe == "distill":
        return [f"distill.teacher={foreign_file('timm_dinov3', folder).path}"]
    return []


def tiny_run(recipe: str, run_dir: Path, data: Path, extra: tuple[str, ...] = ()) -> Source:
    """A run directory of `recipe` as its trainer leaves it (config.yaml; model.safetensors with the trainer's
    metadata), from the objective's own models, random; `extra`: overrides of the demo config (a model option)."""
    needs = recipe_needs(recipe, run_dir.with_name(run_dir.name + "-needs"))
    cfg = load_config(demo_config(recipe), [*SHRINK, f"data.path={data}", f"run.dir={run_dir}", *needs, *extra])
    info = dataset_info_of(cfg.data)
    cfg = resolve_pixels(cfg, info)  # as the trainer does: model.in_chans and data.mean/std of the set's pixels
    objective = build_objective(cfg, info)
    kwargs = objective.model_kwargs()
    torch.manual_seed(0)
    model = objective.build_all(kwargs)
    randomise(model, *(m for m in vars(objective).values() if isinstance(m, nn.Module)))
    model.eval()
    state = objective.exported_weights(_Engine(model))
    metadata = {"variant": cfg.model.variant, "step": "1",
                **{k: str(v) for k, v in objective.exported_architecture(kwargs).items()}}
    run_dir.mkdir(parents=True)
    save_config(cfg, run_dir / "config.yaml")
    save_weights(state, run_dir / "model.safetensors", metadata=metadata)

    def reference(images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), objective.features(_Engine(model)) as features:
            return features(images)

    rope = "rope_temperature" in kwargs
    timm_class = None if cfg.model.stem != "patch" else "Eva" if rope else "VisionTransformer"  # a conv stem: none
    return Source(run_dir, reference, cfg.model.img_size, timm_class, [],
                  cfg.model.in_chans or 3)


class _Engine(nn.Module):
    """What the objectives' hooks take of DeepSpeed's engine outside it: `.module`, and the forward."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.module = model

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def _of(model: nn.Module) -> Features:
    model.eval()
    return lambda images: embedding(model.forward_features(images), model)


def foreign_file(layout: str, folder: Path) -> Source:
    """A file in one of the layouts the recipes read, written as its makers write it, with the reference."""
    from tests.unit.test_dinov3 import TINY, randomised
    from tests.unit.test_dinov3_official import to_meta
    from tests.unit.test_layouts import DINOV2_REG, MAE, random_tensors, sizes

    folder.mkdir(parents=True)
    torch.manual_seed(0)
    if layout in ("timm_dinov3", "meta_dinov3"):
        # timm's with SwiGLU (S+: the export must keep its separate gate and value), Meta's with the GELU MLP.
        name = "vit_small_plus_patch16_dinov3_qkvb" if layout == "timm_dinov3" else "vit_small_patch16_dinov3_qkvb"
        theirs = timm.create_model(name, pretrained=False, **TINY, num_classes=0, global_pool="token")
        theirs.load_state_dict(randomised(theirs.state_dict()))
        path = folder / ("model.safetensors" if layout == "timm_dinov3" else "dinov3_vits16_pretrain.pth")
        if layout == "timm_dinov3":
            save_weights(theirs.state_dict(), path)
        else:
            torch.save(to_meta(theirs.state_dict(), swiglu=False), path)
        config = ["--config", "configs/finetune/demo.yaml", "--res", "64"]
        return Source(path, _of(theirs), 224, "Eva", config)
    if layout == "meta_dinov2":
        size = sizes(img=28, P=14, D=128, L=2, R=4)
        state = random_tensors(DINOV2_REG, size)
        path = folder / "dinov2_vits14_reg4_pretrain.pth"
        torch.save(state, path)
        from pipeline.model.layouts import recognise
        from pipeline.model.vit import VisionTransformer

        found = recognise(state)
        model = VisionTransformer(**{**found.arch, "num_classes": 0})
        model.load_state_dict(found.state)
        return Source(path, _of(model), 28, "VisionTransformer", ["--config", "configs/finetune/demo.yaml",
                                                                  "--res", "28"])
    # Meta's MAE checkpoint and timm's ViT say patch, width and depth, not the heads: a config.yaml beside
    # them says the rest (docs/evaluation.md), as a user writes one.
    arch = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2)
    overrides = [f"model.{k}={v}" for k, v in arch.items()] + ["model.variant=vit_ti16"]
    if layout == "meta_mae":
        state = random_tensors(MAE, sizes(img=16, P=4, D=32, L=2, Dd=16, Ld=1))
        path = folder / "checkpoint-399.pth"
        torch.save({"model": state}, path)
        model = timm.models.vision_transformer.VisionTransformer(**arch, num_classes=0)
        model.load_state_dict({k: v for k, v in state.items() if not k.startswith("decoder")
                               and k != "mask_token"})
        cfg = load_config(demo_config("mae"), [*SHRINK, *overrides, "mae.decoder_embed_dim=16", "mae.decoder_depth=1",
                                               "mae.decoder_num_heads=2"])
    else:
        model = timm.models.vision_transformer.VisionTransformer(**arch, num_classes=3)
        randomise(model)
        path = folder / "model.safetensors"
        save_weights(model.state_dict(), path)
        cfg = load_config(demo_config("supervised"), [*SHRINK, *overrides])
    save_config(cfg, folder / "config.yaml")
    return Source(path, _of(model), 16, "VisionTransformer", [])


FOREIGN = ("meta_mae", "meta_dinov2", "meta_dinov3", "timm_vit", "timm_dinov3")
OPTIONS = {"conv_stem": ("supervised", ("model.stem=conv",))}
"""A model option that changes the weights' layout, as a run of a recipe with it (model.stem: conv)."""
SOURCES = [*(f"run-{name}" for name in RECIPES), *(f"file-{layout}" for layout in FOREIGN),
           *(f"option-{name}" for name in OPTIONS)]


def labelled_set(out: Path) -> Path:
    """48 synthetic 16 px images of 4 classes, a train and a val split."""
    from pipeline.data.shards import synthetic_source, write_dataset

    write_dataset(synthetic_source(48, 4, 16, val_fraction=0.25), out, max_samples_per_shard=12, progress=False,
                  log=lambda _: None)
    assert dataset_info_of(DataConfig(path=str(out))).num_classes == 4
    return out
