"""Distillation's declaration, light (read with the config, before torch): the `distill` config section, its
checks, and the recipe `model.objective: distill` (the objective itself: distill/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.config import Check, Config
from pipeline.objectives.recipe import ReadBack, Recipe
from pipeline.source_config import name_problem


@dataclass
class StudentConfig:
    """One student of `distill.students`: a timm model (`timm`), or a ViT of ours (`model.*`)."""

    name: str = ""
    """The student's name: its export is `<run.dir>/students/<name>/model.safetensors`."""
    timm: str | None = None
    """A timm model name (any with `forward_features` giving a feature map: a ResNet, a ConvNeXt, an EfficientNet), built with pretrained=False and no classifier; its export is in timm's names. None: the ViT `model.*` describes."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """timm's own keyword arguments for `timm` (e.g. output_stride: 8, for a finer feature map)."""
    model: dict[str, Any] = field(default_factory=dict)
    """A ViT student's `model.*` keys that differ from model.* (e.g. {variant: vit_s16, embed_dim: 384}); empty: model.* as written."""
    lr_scale: float = 1.0
    """This student's learning rate: the run's schedule (train.lr, warmup, decay) times lr_scale, its own parameter groups (two or more students; one takes train.lr). A resumed run takes the config's."""


@dataclass
class DistillConfig:
    """Distillation (docs/distill.md): a frozen teacher read from any source, the student (model.*) trained to give
    the teacher's class token and patch tokens through a learned projection, both on the same augmented view of
    each image ("consistent" teaching, Beyer et al. 2022, arXiv 2106.05237); or, from a DINOv2/DINOv3 run of ours
    (`targets`), its DINO and iBOT heads' outputs through heads of its own (DINOv3's distillation)."""

    teacher: str | None = None
    """The teacher: anything `launch/finetune.py --from` reads (a run directory of ours, its export, Meta's DINOv2/DINOv3/MAE files, timm's files). Read at every start, never checkpointed; its digest is kept in the objective's state and a resume against another teacher is refused."""
    targets: Literal["auto", "heads", "features"] = "auto"
    """What the student learns: 'heads', the teacher's DINO and iBOT head outputs through heads of its own (DINOv3's distillation: a DINOv2/DINOv3 run directory of ours with a checkpoint, whose teacher heads it holds); 'features', the teacher's class and patch tokens through a learned projection (any teacher); 'auto': heads where the teacher has them, else features."""
    dino_weight: float = 1.0
    """targets heads: weight of the DINO terms (the student's global and local class tokens against the teacher's global ones)."""
    ibot_weight: float = 1.0
    """targets heads: weight of the iBOT term (the student's patch head at iBOT's mask positions against the teacher's)."""
    koleo_weight: float = 0.1
    """targets heads: weight of KoLeo on the student's global class tokens (DINOv3's distillation: 0.1)."""
    teacher_temp: float = 0.07
    """targets heads: the temperature of the teacher's Sinkhorn-Knopp assignments (DINOv3's distillation: 0.07)."""
    global_ignore_diagonal: bool = True
    """targets heads: a student global crop is not scored against the teacher's output of the same crop (DINOv3's distilled config)."""
    loss: Literal["cosine", "smooth_l1"] = "cosine"
    """Per token: 1 - cosine similarity (scale-free: a teacher's feature norms, which differ by model and carry high-norm outlier tokens, set no scale; the default), or smooth-L1 on the features (keeps their magnitude)."""
    cls_weight: float = 1.0
    """Weight of the class-token term."""
    patch_weight: float = 1.0
    """Weight of the patch-token term (the teacher's grid resized to the student's, as DINOv3 resizes its Gram teacher's)."""
    resize_method: Literal["bicubic", "bilinear"] = "bicubic"
    """How the teacher's patch grid is resized to the student's when they differ (a /14 teacher, a /16 student)."""
    students: list[StudentConfig] = field(default_factory=list)
    """Empty: one student, the ViT `model.*` describes, exported as model.safetensors. Otherwise each entry a student (`{name: cnn, timm: resnet10t, kwargs: {output_stride: 8}}`, `{name: vit_s, model: {embed_dim: 384}}`), all on one teacher forward per micro batch, each exported as students/<name>/model.safetensors (the first also as model.safetensors); `model.img_size` is every student's input size. With two or more, train.grad_clip clips each student by its own gradient norm (as alone; docs/distill.md)."""
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
        ("distill.dino_weight", min(d.dino_weight, d.ibot_weight, d.koleo_weight) >= 0
         and d.dino_weight + d.ibot_weight > 0, ">= 0, as distill.ibot_weight and distill.koleo_weight, and "
         "distill.dino_weight + distill.ibot_weight > 0"),
        ("distill.teacher_temp", d.teacher_temp > 0, "> 0"),
        ("distill.students", not students_problem(d.students), students_problem(d.students)),
        ("deepspeed.zero_stage", cfg.deepspeed.zero_stage < 3 or not any(s.timm for s in d.students),
         "below 3 with a timm student (timm initialises its weights in place, which a ZeRO-3 partitioned "
         "parameter does not take)"),
        ("data.mixup", cfg.data.mixup == 0 and cfg.data.cutmix == 0,
         "0 with model.objective 'distill' (as data.cutmix: the teacher teaches on the images, not on labels)"),
    ]


def students_problem(students: list[StudentConfig]) -> str:
    """What is wrong with the entries of distill.students ('' when nothing), naming the entry."""
    for i, s in enumerate(students):
        if name_problem(s.name):
            return f"a list whose entry {i} has a plain name ({name_problem(s.name)})"
        if s.kwargs and s.timm is None:
            return f"a list whose entry {i} ('{s.name}') has kwargs only with a `timm` model"
        if s.model and s.timm is not None:
            return f"a list whose entry {i} ('{s.name}') has model keys only without a `timm` model"
        if not s.lr_scale > 0 or (len(students) == 1 and s.lr_scale != 1):
            return (f"a list whose entry {i} ('{s.name}') has an lr_scale > 0" +
                    (", and 1 for a single student (its lr is train.lr)" if len(students) == 1 else ""))
    if len({s.name for s in students}) != len(students):
        return f"a list of unique names (got {[s.name for s in students]})"
    return ""


def _objective() -> type:
    # When a run builds it: the config is read before torch.
    from pipeline.objectives.distill.objective import Distill

    return Distill


RECIPE = Recipe("distill", _objective, section="distill", config=DistillConfig, checks=distill_checks,
                read_back=ReadBack(model="variant"))
