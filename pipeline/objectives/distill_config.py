"""Distillation's declaration, light (read with the config, before torch): the `distill` config section, its
checks, and the recipe `model.objective: distill` (the objective itself: distill/)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipeline.config import Check, Config
from pipeline.objectives.recipe import ReadBack, Recipe


@dataclass
class DistillConfig:
    """Feature distillation (docs/distill.md): a frozen teacher read from any source, the student (model.*) trained
    to give the teacher's class token and patch tokens through a learned projection, both on the same augmented
    view of each image ("consistent" teaching, Beyer et al. 2022, arXiv 2106.05237)."""

    teacher: str | None = None
    """The teacher: anything `launch/finetune.py --from` reads (a run directory of ours, its export, Meta's DINOv2/DINOv3/MAE files, timm's files). Read at every start, never checkpointed; its digest is kept in the objective's state and a resume against another teacher is refused."""
    loss: Literal["cosine", "smooth_l1"] = "cosine"
    """Per token: 1 - cosine similarity (scale-free: a teacher's feature norms, which differ by model and carry high-norm outlier tokens, set no scale; the default), or smooth-L1 on the features (keeps their magnitude)."""
    cls_weight: float = 1.0
    """Weight of the class-token term."""
    patch_weight: float = 1.0
    """Weight of the patch-token term (the teacher's grid resized to the student's, as DINOv3 resizes its Gram teacher's)."""
    resize_method: Literal["bicubic", "bilinear"] = "bicubic"
    """How the teacher's patch grid is resized to the student's when they differ (a /14 teacher, a /16 student)."""
    knn_k: int = 20
    """Evaluation: neighbours voting in the student's k-NN top-1 (0 disables it; only where the validation split has labels). At the first evaluation the teacher's is given too."""
    knn_train_samples: int = 10000
    """Evaluation: labelled training samples (the first of the train split) that make the k-NN memory."""


def distill_checks(cfg: Config) -> list[Check]:
    """The `distill` section's values, and what a distillation cannot have (none for another objective)."""
    if cfg.model.objective != "distill":
        return []
    d = cfg.distill
    return [
        ("distill.teacher", bool(d.teacher), "the teacher's source (a run directory or a weights file)"),
        ("distill.cls_weight", d.cls_weight >= 0, ">= 0"),
        ("distill.patch_weight", d.patch_weight >= 0 and d.cls_weight + d.patch_weight > 0,
         ">= 0, and distill.cls_weight + distill.patch_weight > 0"),
        ("distill.knn_k", d.knn_k >= 0, ">= 0"),
        ("data.mixup", cfg.data.mixup == 0 and cfg.data.cutmix == 0,
         "0 with model.objective 'distill' (as data.cutmix: the teacher teaches on the images, not on labels)"),
    ]


def _objective() -> type:
    # When a run builds it: the config is read before torch.
    from pipeline.objectives.distill.objective import Distill

    return Distill


RECIPE = Recipe("distill", _objective, section="distill", config=DistillConfig, checks=distill_checks,
                read_back=ReadBack(model="variant"))
