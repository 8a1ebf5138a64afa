"""The `adapt` config section (light: read with the run config, before torch) and what it does to a run that
starts from a foundation model's weights (`launch/pretrain.py --init SOURCE`; docs/adapt.md):

    adapt.init                 the source (set by --init); its backbone is the student's, the teacher's (and
                               DINOv3's Gram teacher's) start; what it lacks (heads, decoder) starts fresh
    adapt.freeze_backbone_steps  only the fresh parts train: the backbone's parameter groups at lr 0
    adapt.backbone_warmup_steps  then the backbone's lr ramps from 0 to the schedule's (train.layer_decay
                               still scales it per layer)
    adapt.anchor               DINOv3's Gram loss against the frozen source (taken at step 0, never again), at
                               this weight: DINOv3's own Gram term (`anchored`), DINOv2's dino/anchor.py
    adapt.warn_drop            the log warns when an eval.sets k-NN falls more than this many points below the
                               source's (pipeline/run/init_source.py's versus_init)

The freeze and the warm-up are a function of the step applied to the optimizer's groups before each step
(`backbone_lr_schedule`, from the objective's `before_step`, as DINOv2's frozen prototypes): no state of their
own, so a resumed run takes them up exactly. The model marks its fresh parts with a parameter role (`FRESH_ROLES`)
when this section asks for a schedule, so that their groups are told from the backbone's on any ZeRO stage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pipeline.config import Check, Config

FRESH_ROLES = ("head", "last_layer", "decoder")  # the roles of what a source does not hold (pipeline/model/dino.py, mae.py)
ADAPT_RECIPES = ("dinov2", "dinov3", "mae")  # the recipes --init starts from a foundation model
ANCHORED = ("dinov2", "dinov3")  # the recipes adapt.anchor applies to (the Gram loss: patch features of DINO)


@dataclass
class AdaptConfig:
    init: str | None = None
    """The weights the run starts from (`launch/pretrain.py --init SOURCE`): anything `launch/finetune.py --from` reads (Meta's DINOv2, DINOv3 and MAE files, timm's, our exports, a run directory, which brings its heads along when it has them). The student's and the teacher's backbone start as the source's, the architecture is the source's; the heads (or MAE's decoder) start fresh. A resume reads its own checkpoint, not the source (docs/adapt.md)."""
    init_digest: str | None = None
    """Written by the run at its first start: the source's SHA-256, so that a resume with another --init is refused. Not to be set by hand."""
    freeze_backbone_steps: int = 0
    """Steps during which only the fresh parts (heads, decoder) train: the backbone's parameter groups at lr 0 (it does not move, bit for bit). 0: none."""
    backbone_warmup_steps: int = 0
    """After the freeze, steps over which the backbone's lr ramps linearly from 0 to the schedule's (times train.layer_decay's per-layer scale). 0: it joins at the full rate."""
    anchor: float = 0.0
    """DINOv2 and DINOv3: the weight of DINOv3's Gram loss between the student's patch features of the global crops and the frozen source's (taken at step 0, never updated; gram.normalized, remove_neg, remove_only_teacher_neg and img_level say how the loss is computed). 0: off."""
    normalise: str = "run"
    """The inputs' normalisation: 'run' (data.mean and data.std as the config writes them; a source trained with another is said in one line at the first start) or 'source' (the source's, as its run's config or its authors give it: ImageNet's for Meta's and timm's files), recorded in the run's config.yaml so that a resume keeps it."""
    warn_drop: float | None = 5.0
    """The log warns when an eval.sets figure (k-NN top-1) falls more than this many points (percent) below the source's at step 0. null: never."""


def adapt_checks(cfg: Config) -> list[Check]:
    """The section's checks (pipeline.config.validate's form)."""
    a = cfg.adapt
    schedule = a.freeze_backbone_steps > 0 or a.backbone_warmup_steps > 0
    return [
        ("adapt.freeze_backbone_steps", a.freeze_backbone_steps >= 0, ">= 0"),
        ("adapt.backbone_warmup_steps", a.backbone_warmup_steps >= 0, ">= 0"),
        ("adapt.anchor", a.anchor >= 0, ">= 0 (0: off)"),
        ("adapt.anchor", a.anchor == 0 or cfg.model.objective in ANCHORED,
         f"0 with model.objective={cfg.model.objective}: the anchor is a Gram loss on DINO's patch features "
         f"({' or '.join(ANCHORED)})"),
        ("adapt.normalise", a.normalise in ("run", "source"), "'run' (data.mean/std) or 'source' (the source's)"),
        ("adapt.warn_drop", a.warn_drop is None or a.warn_drop >= 0, ">= 0 points, or null (never warn)"),
        # (a run's saved config.yaml holds the gram section `anchored` made: the anchor's own weight)
        ("adapt.anchor", a.anchor == 0 or cfg.model.objective != "dinov3" or cfg.gram.loss_weight in (0.0, a.anchor),
         "0 when gram.loss_weight > 0: the anchor is the Gram loss against the source; use one or the other"),
        ("adapt.freeze_backbone_steps", not schedule or cfg.model.objective in ADAPT_RECIPES,
         f"0 with model.objective={cfg.model.objective}: the backbone warm-up is for {', '.join(ADAPT_RECIPES)}"),
    ]


def wants_roles(cfg: Config) -> bool:
    """Whether the model marks its fresh parts (FRESH_ROLES): only when a schedule needs to find them, so that
    every other run keeps its parameter groups (and its checkpoints' optimizer state) as they were."""
    a = cfg.adapt
    return a.freeze_backbone_steps > 0 or a.backbone_warmup_steps > 0


def backbone_lr_factor(a: AdaptConfig, step: int) -> float:
    """The backbone's lr as a fraction of the schedule's before optimizer step `step` (steps done)."""
    if step < a.freeze_backbone_steps:
        return 0.0
    if a.backbone_warmup_steps:
        return min(1.0, (step - a.freeze_backbone_steps + 1) / a.backbone_warmup_steps)
    return 1.0


def backbone_lr_schedule(groups: list[dict[str, Any]], a: AdaptConfig, step: int) -> None:
    """The backbone's groups (every group whose role is not a fresh part's) at `backbone_lr_factor` of the lr
    the trainer's schedule set them to after the previous step: AdamW at lr 0 moves neither by its step nor
    by its decoupled weight decay. Nothing to restore after: the schedule sets every group's lr again."""
    factor = backbone_lr_factor(a, step)
    if factor == 1.0:
        return
    for group in groups:
        if group.get("role") not in FRESH_ROLES:
            group["lr"] = group["lr"] * factor


def anchored(cfg: Config) -> Config:
    """adapt.anchor of a DINOv3 run as the gram section says it: the Gram loss at that weight from step 0, the
    Gram teacher taken at step 0 (the student, the teacher: the source) and never again. (DINOv2's anchor reads
    adapt.anchor itself: pipeline/objectives/dino/anchor.py.)"""
    if cfg.adapt.anchor <= 0 or cfg.model.objective != "dinov3":
        return cfg
    gram = dataclasses.replace(cfg.gram, loss_weight=cfg.adapt.anchor, start_step=0, max_updates=0)
    return dataclasses.replace(cfg, gram=gram)
