"""A teacher that brings its DINO and iBOT heads (`distill.targets: heads`): a DINOv2 or DINOv3 run directory of
ours, read from its newest complete checkpoint, whose objective state holds the EMA teacher whole (backbone and
heads: DINOv2.state_dict). What the student's heads are sized as (the teacher's), and the view of the data the
head loss takes: the multi-crop and iBOT masks of the teacher's own run (its dino.* or dinov3.* crops and masks,
as Meta's distilled config repeats its teacher's), at the student's model.img_size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from pipeline.config import Config, ConfigError, ConfigFiles
from pipeline.model.dino import HEAD_KEYS, DINOv2Model, DINOv3Model
from pipeline.model.weights import WeightsError
from pipeline.objectives.backbone import Backbone
from pipeline.objectives.dino.objective import dinov2_model_kwargs
from pipeline.objectives.dino.view import MultiCropView
from pipeline.objectives.source import objective_of_run
from pipeline.train import checkpoint as ckpt

HEADED = ("dinov2", "dinov3")  # the recipes whose checkpoints hold a teacher with heads


def head_teacher_problem(source: str, files: ConfigFiles) -> str:
    """'' when `source` is a run directory of ours whose newest complete checkpoint holds a teacher with heads;
    else what it is instead (for the one line `distill.targets: heads` gives)."""
    path = Path(source).expanduser()
    if not path.is_dir() or not (path / "config.yaml").is_file():
        return "not a run directory of ours (a weights file carries the backbone alone)"
    objective = files.load(path / "config.yaml").model.objective
    if objective not in HEADED:
        return f"a model.objective={objective} run (heads come with a DINOv2 or DINOv3 run)"
    if ckpt.newest_complete_tag(path) is None:
        return "a run without a complete checkpoint (its export, model.safetensors, holds the backbone alone)"
    return ""


def read_head_teacher(source: str, files: ConfigFiles) -> Backbone:
    """The run's EMA teacher whole (`DINOv2Model` or `DINOv3Model`: backbone, DINO head, iBOT head), float32,
    eval mode, from its newest complete checkpoint; `kwargs` its constructor arguments (the run's)."""
    path = Path(source).expanduser().resolve()
    cfg = files.load(path / "config.yaml")
    tag = ckpt.newest_complete_tag(path)
    state = (ckpt.read_client_state(path, tag).get("objective") or {}).get("teacher")
    if state is None:
        raise WeightsError(f"distill.teacher={source}: {ckpt.checkpoint_dir(path) / tag} holds no teacher in its "
                           f"objective state (model.objective={cfg.model.objective} runs save one)")
    objective = objective_of_run(cfg)
    kwargs = {**dinov2_model_kwargs(cfg, objective.section), "drop_path_rate": 0.0}
    model: nn.Module = objective.model_class(**kwargs)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise WeightsError(f"distill.teacher={source} ({tag}): the teacher does not fit its config.yaml "
                           f"({str(e).splitlines()[0]})") from None
    return Backbone(model.float().eval(), kwargs, cfg.data, path, tag, cfg)


def head_arguments(teacher: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The student's heads' arguments: the teacher's (HEAD_KEYS: prototypes, widths, layers), an iBOT head of its
    own (DINOv3's distillation always separates them), and the teacher's head class ('dinov3': plain prototypes)."""
    heads = {k: kwargs[k] for k in HEAD_KEYS if k != "ibot_separate_head"}
    if not kwargs["ibot_separate_head"]:  # the teacher's iBOT targets come from its DINO head: sized as it
        heads.update(ibot_head_n_prototypes=kwargs["head_n_prototypes"],
                     ibot_head_bottleneck_dim=kwargs["head_bottleneck_dim"])
    return {**heads, "kind": "dinov3" if isinstance(teacher, DINOv3Model) else "dinov2"}


def head_view(teacher_cfg: Config, teacher_model: DINOv2Model, cfg: Config, img_size: int) -> MultiCropView:
    """The teacher run's multi-crop and masks, its global crops at `img_size` (the student's), normalised by this
    run's data.*; the mask grid the teacher's patch grid (the student's must be the same, the objective checks)."""
    objective = objective_of_run(teacher_cfg)(teacher_cfg, None)
    local, patch = getattr(teacher_cfg, objective.section).local_crops_size, teacher_model.backbone.patch_embed.patch_size[0]
    if img_size % patch or local % patch:
        raise ConfigError(f"model.img_size ({img_size}) and the teacher's {objective.section}.local_crops_size "
                          f"({local}) must be multiples of its patch ({patch}) for distill.targets heads")
    crops = objective.crop_config({"img_size": img_size}, mean=tuple(cfg.data.mean), std=tuple(cfg.data.std))
    d = objective.d
    return MultiCropView(crops, (img_size // patch, img_size // patch), d.mask_probability, tuple(d.mask_ratio))
