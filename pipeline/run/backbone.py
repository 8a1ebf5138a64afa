"""The backbone a run (or a weights file) produced, as a plain `VisionTransformer` outside training: what
launch/evaluate.py judges, launch/embed.py embeds and launch/export_weights.py --format timm/onnx exports.

    found = load_backbone("runs/demo-dino-pretrain", tag="step_0000100")   # a checkpoint of a run
    found = load_backbone("runs/demo-mae-pretrain")                         # its export, else its newest tag
    found = load_backbone("dinov2_vits14_pretrain.pth")                     # a file: ours, Meta's, timm's

What a run exports, as its objective reads it from a checkpoint (`Objective.weights_from_checkpoint`: a
DINOv2 run's teacher backbone, an MAE run's encoder with its fixed sin-cos table), in our layout
(`layouts.recognise`), built with the architecture its config.yaml records (a weights file: the one its
metadata records, as our exports write it, or the one Meta's DINOv2 files hold).
"""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.config import Config, DataConfig
from pipeline.model.layouts import is_ours, recognise
from pipeline.model.mae import sincos_pos_embed_2d
from pipeline.model.variants import model_kwargs_from_config, pair
from pipeline.model.vit import VisionTransformer
from pipeline.model.weights import WeightsError, load_weights, weights_metadata
from pipeline.run.finetune import find_source, objective_of_run
from pipeline.train import checkpoint as ckpt


@dataclass
class Backbone:
    model: VisionTransformer
    """float32, eval mode, on the CPU; its head kept where the source has one (a supervised run)."""
    kwargs: dict[str, Any]
    """Its constructor arguments."""
    data: DataConfig
    """The source run's data.* (its normalisation and eval transform); the defaults for a bare file."""
    source: Path
    tag: str | None
    """The checkpoint read (None: an export or a file)."""
    config: Config | None
    """The source run's config, when it has one."""

    @property
    def step(self) -> int | None:
        return ckpt.tag_step(self.tag) if self.tag else None


def complete_tags(run_dir: Path) -> list[str]:
    """Every complete checkpoint tag of a run, oldest first."""
    return sorted((t for t in ckpt.all_tags(run_dir) if ckpt.check_tag(ckpt.checkpoint_dir(run_dir) / t) is None),
                  key=ckpt.tag_step)


def tag_of_step(run_dir: Path, step: int) -> str:
    """The complete tag of `step`; WeightsError of one line naming the steps there are."""
    tag = ckpt.tag_for(step)
    tags = complete_tags(run_dir)
    if tag not in tags:
        have = ", ".join(str(ckpt.tag_step(t)) for t in tags) or "none"
        raise WeightsError(f"{run_dir}: no complete checkpoint of step {step} in {ckpt.checkpoint_dir(run_dir)} "
                           f"(complete steps: {have})")
    return tag


def _metadata_arch(metadata: dict[str, str]) -> dict[str, Any]:
    """The architecture our exports write into a safetensors file's metadata (values as their repr)."""
    out: dict[str, Any] = {}
    for key in VisionTransformer.ARCH_KEYS:
        if key in metadata:
            try:
                out[key] = ast.literal_eval(metadata[key])
            except (ValueError, SyntaxError):
                out[key] = metadata[key]  # a bare string ('mlp', 'token')
    return out


def load_backbone(source: str | Path, tag: str | None = None) -> Backbone:
    """The backbone of `source` (a run directory, at `tag` or its export/newest complete tag; or a weights
    file). WeightsError (one line) for weights in no known layout or that do not fit the architecture."""
    src = find_source(str(source))
    cfg, path = src.config, src.path
    if path.is_dir():
        if tag is None and (path / "model.safetensors").is_file():
            state = load_weights(path / "model.safetensors")
        else:
            tag = tag or ckpt.newest_complete_tag(path)
            state = objective_of_run(cfg).weights_from_checkpoint(path, tag, cfg)
        ours = True
    else:
        state, ours = load_weights(path), cfg is not None or is_ours(weights_metadata(path))
    where = f"{path}" + (f" ({tag})" if tag else "")
    found = recognise(state, where, ours=ours)
    head = found.state.get("head.weight")
    classes = int(head.shape[0]) if head is not None else 0
    if found.complete:  # Meta's DINOv2: the file says the whole architecture
        kwargs = {**found.arch, "num_classes": 0}
    elif cfg is not None:
        kwargs = model_kwargs_from_config(dataclasses.replace(cfg.model, num_classes=classes), classes)
    elif path.is_file() and _metadata_arch(weights_metadata(path)):
        kwargs = {**_metadata_arch(weights_metadata(path)), "num_classes": classes}
    else:
        raise WeightsError(f"{where}: the file does not say its architecture (heads, width); give its run "
                           f"directory, a file with config.yaml beside it, or one written by launch/export_weights.py")
    kwargs.update(mask_token=False, drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.0)
    if cfg is not None and cfg.model.objective == "dinov2":
        kwargs["dynamic_img_size"] = True  # as the run built its backbone (local crops)
    if found.mismatch(kwargs):
        a = found.arch
        raise WeightsError(f"{where}: the weights do not fit the architecture {_describe(kwargs)}: they are patch "
                           f"{a['patch_size']}, width {a['embed_dim']}, depth {a['depth']} ({found.layout})")
    model = VisionTransformer(**kwargs)
    weights = dict(found.state)
    if "pos_embed" not in weights:  # an MAE run's checkpoint holds parameters; its table is the fixed sin-cos
        h, w = pair(kwargs["img_size"])
        p = model.patch_embed.patch_size[0]
        weights["pos_embed"] = sincos_pos_embed_2d(model.embed_dim, (h // p, w // p))
    expected = model.state_dict()
    missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    wrong = [k for k in expected if k in weights and tuple(weights[k].shape) != tuple(expected[k].shape)]
    if missing or extra or wrong:
        what = (f"missing {', '.join(missing[:4])}" if missing else f"unexpected {', '.join(extra[:4])}" if extra
                else f"'{wrong[0]}' is {tuple(weights[wrong[0]].shape)}, the model's {tuple(expected[wrong[0]].shape)}")
        raise WeightsError(f"{where}: the weights do not fit the architecture {_describe(kwargs)}: {what}")
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    model.eval()
    return Backbone(model, kwargs, cfg.data if cfg is not None else DataConfig(), path, tag, cfg)


def _describe(kwargs: dict[str, Any]) -> str:
    return (f"(patch {kwargs.get('patch_size')}, width {kwargs.get('embed_dim')}, depth {kwargs.get('depth')}, "
            f"{kwargs.get('num_heads')} heads)")


@torch.no_grad()
def backbone_features(model: VisionTransformer, images: torch.Tensor) -> torch.Tensor:
    """`pipeline.eval.features.embedding` of a batch through a plain backbone (what a run's eval.sets reads)."""
    from pipeline.eval.features import embedding  # noqa: PLC0415 - kept beside its one use
    return embedding(model.forward_features(images), model)
