"""The backbone a run (or a weights file) produced, as its own class outside training: what
launch/evaluate.py judges, launch/embed.py embeds and launch/export_weights.py --format timm/onnx exports.

    found = load_backbone("runs/demo-dino-pretrain", tag="step_0000100")   # a checkpoint of a run
    found = load_backbone("runs/demo-mae-pretrain")                         # its export, else its newest tag
    found = load_backbone("dinov2_vits14_pretrain.pth")                     # a file: ours, Meta's, timm's

What a run exports, as its objective reads it from a checkpoint (`Objective.weights_from_checkpoint`: a
DINOv2 or DINOv3 run's teacher backbone, an MAE run's encoder with its fixed sin-cos table), in our layout
(`layouts.recognise`), built as its recipe says (`Recipe.read_back`: VisionTransformer, or DINOv3ViT with its
RoPE and storage tokens) with the architecture its config.yaml records. A weights file: the architecture its
metadata records, as our exports write it, or the one Meta's DINOv2 and DINOv3 files and timm's DINOv3 files
hold (a DINOv3 file is built at model.img_size's default, 224: RoPE runs at any size).
"""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.config import Config, ConfigFiles, DataConfig, ModelConfig
from pipeline.data.multicrop import IMAGENET_MEAN, IMAGENET_STD
from pipeline.model.dinov3 import DINOv3ViT, backbone_class
from pipeline.model.layouts import OURS_DINOV3, OURS_MAE, OURS_VIT, Recognised, is_ours, recognise
from pipeline.model.mae import sincos_pos_embed_2d
from pipeline.model.timm_backbone import METADATA_KEYS, TimmBackbone, from_metadata
from pipeline.model.variants import model_kwargs_from_config, pair
from pipeline.model.vit import VisionTransformer
from pipeline.model.weights import WeightsError, load_weights, weights_metadata
from pipeline.objectives.recipe import ReadBack
from pipeline.objectives.source import find_source, meta_arch_config, objective_of_run
from pipeline.train import checkpoint as ckpt

MODEL_CLASSES: dict[str, type[nn.Module]] = {"vit": VisionTransformer, "dinov3": DINOv3ViT}  # ReadBack.model


@dataclass
class Backbone:
    model: nn.Module
    """VisionTransformer or DINOv3ViT: float32, eval mode, on the CPU; its head kept where the source has one."""
    kwargs: dict[str, Any]
    """Its constructor arguments."""
    data: DataConfig
    """The source run's data.* (its normalisation and eval transform); for a release file without one, the
    defaults with its authors' normalisation (`release_data`)."""
    source: Path
    tag: str | None
    """The checkpoint read (None: an export or a file)."""
    config: Config | None
    """The source run's config, when it has one."""
    found: Recognised | None = None
    """What the weights were recognised as (their layout, the architecture a file says: `--init` reads it)."""

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
    """The architecture our exports write into a safetensors file's metadata (values as their repr): either
    class's ARCH_KEYS (a DINOv3 ViT's name its RoPE, which is how `backbone_class` tells them apart)."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys((*VisionTransformer.ARCH_KEYS, *DINOv3ViT.ARCH_KEYS)):
        if key in metadata:
            try:
                out[key] = ast.literal_eval(metadata[key])
            except (ValueError, SyntaxError):
                out[key] = metadata[key]  # a bare string ('mlp', 'token')
    return out


def _read(path: Path, cfg: Config | None, tag: str | None) -> tuple[dict[str, torch.Tensor], str | None, bool]:
    """(the state dict, the tag read, whether it is ours) of a run directory (its export, or a checkpoint as its
    objective reads one) or of a weights file."""
    if path.is_dir():
        if tag is None and (path / "model.safetensors").is_file():
            return load_weights(path / "model.safetensors"), None, True
        tag = tag or ckpt.newest_complete_tag(path)
        return objective_of_run(cfg).weights_from_checkpoint(path, tag, cfg), tag, True
    return load_weights(path), None, cfg is not None or is_ours(weights_metadata(path))


def read_back_of(cfg: Config | None) -> ReadBack | None:
    """How the run that `cfg` records reads its backbone back (its recipe's, pipeline/objectives/recipe.py)."""
    return type(cfg).recipes[cfg.model.objective].read_back if cfg is not None else None


def _arguments(found: Recognised, cfg: Config | None, path: Path, classes: int, where: str) -> dict[str, Any]:
    """The backbone's constructor arguments: from the file where it says them all (Meta's DINOv2, a DINOv3
    file), else from the run's config (with its recipe's own), else from our export's metadata."""
    if found.complete and "variant" in found.arch:  # a DINOv3 file (timm's, Meta's): a model config, no size
        model = dataclasses.replace(ModelConfig(), **meta_arch_config(found.arch), num_classes=classes)
        return model_kwargs_from_config(model)
    if found.complete:  # Meta's DINOv2: VisionTransformer's arguments
        return {**found.arch, "num_classes": classes}
    if cfg is not None:
        model = dataclasses.replace(cfg.model, num_classes=classes)
        if model.objective == "distill" and cfg.distill.students:  # the run exports its first student: its keys
            model = dataclasses.replace(model, **cfg.distill.students[0].model)
        return {**model_kwargs_from_config(model, classes), **dict(read_back_of(cfg).kwargs)}
    metadata = _metadata_arch(weights_metadata(path)) if path.is_file() else {}
    if metadata:
        return {**metadata, "num_classes": classes}
    raise WeightsError(f"{where}: the file does not say its architecture (heads, width); give its run "
                       f"directory, a file with config.yaml beside it, or one written by launch/export_weights.py")


def _model_class(kwargs: dict[str, Any], read_back: ReadBack | None) -> type[nn.Module]:
    """The recipe's class for its backbone; the arguments' (a DINOv3 ViT's name its RoPE) for a file alone."""
    if read_back is None or read_back.model == "variant":
        return backbone_class(kwargs)
    return MODEL_CLASSES[read_back.model]


def _expected_layout(cls: type[nn.Module], read_back: ReadBack | None) -> str | None:
    """Which of our layouts a run of the recipe exports (None: not a run's)."""
    if read_back is None:
        return None
    return OURS_MAE if read_back.keys == "mae" else OURS_DINOV3 if cls is DINOv3ViT else OURS_VIT


def load_backbone(source: str | Path, files: ConfigFiles, tag: str | None = None, flag: str = "--from") -> Backbone:
    """The backbone of `source` (a run directory, at `tag` or its export/newest complete tag; or a weights
    file), as the class its recipe reads it back as (`Recipe.read_back`). WeightsError (one line) for weights
    in no known layout, or that do not fit the architecture. `files`: the run configs' reader (`find_source`);
    `flag`: the command's name for the source."""
    src = find_source(str(source), files, flag=flag)
    cfg, path = src.config, src.path
    timm_student = _timm_backbone(path, cfg, tag, files)  # a distillation's timm student (its export, or the run)
    if timm_student is not None:
        return timm_student
    state, tag, ours = _read(path, cfg, tag)
    where = f"{path}" + (f" ({tag})" if tag else "")
    found = recognise(state, where, ours=ours)
    head = found.state.get("head.weight")
    kwargs = _arguments(found, cfg, path, int(head.shape[0]) if head is not None else 0, where)
    kwargs.update(mask_token=False, drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.0)
    read_back = read_back_of(cfg)
    cls = _model_class(kwargs, read_back)
    expected = _expected_layout(cls, read_back)
    if expected is not None and found.layout != expected:
        raise WeightsError(f"{where}: {cfg.model.objective} runs export {expected.removeprefix('ours ')}; these "
                           f"weights are {found.layout}")
    if found.mismatch(kwargs):
        a = found.arch
        raise WeightsError(f"{where}: the weights do not fit the architecture {_describe(kwargs)}: they are patch "
                           f"{a['patch_size']}, width {a['embed_dim']}, depth {a['depth']} ({found.layout})")
    model = _build(cls, kwargs, where)
    weights = dict(found.state)
    if found.layout == OURS_MAE and "pos_embed" not in weights:  # a checkpoint holds parameters: the fixed table
        h, w = pair(kwargs["img_size"])
        p = model.patch_embed.patch_size[0]
        weights["pos_embed"] = sincos_pos_embed_2d(model.embed_dim, (h // p, w // p))
    _load(model, weights, kwargs, where)
    student_run = None if cfg is not None or path.is_dir() else _student_run_config(path, files)
    data = cfg.data if cfg is not None else student_run.data if student_run is not None else release_data(found)
    return Backbone(model.eval(), kwargs, data, path, tag, cfg, found)


def release_data(found: Recognised) -> DataConfig:
    """The data.* defaults for weights read without a run config: ours keep the config's defaults (0.5, as our
    runs do unless they said otherwise); a release file of another layout takes ImageNet's mean and std, what
    Meta's MAE, DINOv2 and DINOv3 and timm's DINOv3 files were trained with (timm's VisionTransformer layout
    too: Meta's mae_pretrain_vit_*.pth are in it; timm's augreg ViTs used 0.5, the commands' --mean/--std)."""
    if found.layout in (OURS_VIT, OURS_MAE, OURS_DINOV3):
        return DataConfig()
    return DataConfig(mean=IMAGENET_MEAN, std=IMAGENET_STD)


def _timm_backbone(path: Path, cfg: Config | None, tag: str | None, files: ConfigFiles) -> Backbone | None:
    """A timm model a distillation exported (students/<name>/model.safetensors, or its run's model.safetensors:
    timm's names, the model in the metadata), or a checkpoint of such a run; None for any other source. Read
    beside its run's config.yaml, it takes that run's data.* (its normalisation)."""
    file = path if path.is_file() else path / "model.safetensors" if tag is None else None
    arch = from_metadata(weights_metadata(file)) if file is not None and file.is_file() else None
    if arch is None and path.is_dir() and cfg is not None and cfg.model.objective == "distill":
        tag = tag or ckpt.newest_complete_tag(path)  # a checkpoint: the student as the run built it
        built = ckpt.TrainerState.read(ckpt.checkpoint_dir(path) / tag).model if tag else {}
        built = next(iter(built["students"].values())) if "students" in built else built  # its first student
        arch = {k: built[k] for k in METADATA_KEYS} if "timm_model" in built else None
        state = objective_of_run(cfg).weights_from_checkpoint(path, tag, cfg) if arch is not None else {}
    elif arch is not None:
        state = load_weights(file)
    if arch is None:
        return None
    cfg = cfg or _student_run_config(path, files)
    where = f"{path}" + (f" ({tag})" if tag and path.is_dir() else "")
    model = _build(TimmBackbone, arch, where)
    try:
        model.model.load_state_dict({k: v.float() for k, v in state.items()})
    except RuntimeError as e:
        raise WeightsError(f"{where}: the weights do not fit timm's {arch['timm_model']} "
                           f"{arch['timm_kwargs']}: {str(e).splitlines()[1].strip()}") from None
    return Backbone(model.eval(), arch, cfg.data if cfg is not None else DataConfig(), path,
                    tag if path.is_dir() else None, cfg)


def _student_run_config(path: Path, files: ConfigFiles) -> Config | None:
    """The config of the distillation a students/<name>/model.safetensors belongs to (its data.*: the
    normalisation it was trained with), if the file is still in its run directory."""
    run_config = path.parent.parent.parent / "config.yaml"  # RUN/students/NAME/model.safetensors
    return files.load(run_config) if path.parent.parent.name == "students" and run_config.is_file() else None


def _build(cls: type[nn.Module], kwargs: dict[str, Any], where: str) -> nn.Module:
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # arguments one class does not take, or values it refuses
        what = "" if cls is TimmBackbone else f" {_describe(kwargs)}"
        raise WeightsError(f"{where}: cannot build {cls.__name__}{what}: {e}") from None


def _load(model: nn.Module, weights: dict[str, torch.Tensor], kwargs: dict[str, Any], where: str) -> None:
    expected = model.state_dict()
    missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    wrong = [k for k in expected if k in weights and tuple(weights[k].shape) != tuple(expected[k].shape)]
    if missing or extra or wrong:
        what = (f"missing {', '.join(missing[:4])}" if missing else f"unexpected {', '.join(extra[:4])}" if extra
                else f"'{wrong[0]}' is {tuple(weights[wrong[0]].shape)}, the model's {tuple(expected[wrong[0]].shape)}")
        raise WeightsError(f"{where}: the weights do not fit the architecture {_describe(kwargs)} "
                           f"({type(model).__name__}): {what}")
    model.load_state_dict({k: v.float() for k, v in weights.items()})


def _describe(kwargs: dict[str, Any]) -> str:
    return (f"(patch {kwargs.get('patch_size')}, width {kwargs.get('embed_dim')}, depth {kwargs.get('depth')}, "
            f"{kwargs.get('num_heads')} heads)")


@torch.no_grad()
def backbone_features(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """`pipeline.eval.features.embedding` of a batch through a plain backbone (what a run's eval.sets reads)."""
    from pipeline.eval.features import embedding  # noqa: PLC0415 - kept beside its one use
    return embedding(model.forward_features(images), model)
