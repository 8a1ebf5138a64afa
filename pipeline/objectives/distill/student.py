"""The trained model of a distillation: the student backbone (the ViT model.* describes, or a timm model named by
`distill.students`: pipeline/model/timm_backbone.py) and the projections that map its tokens to the teacher's
width. Only the backbone is exported (the projections serve the loss alone): a ViT's in its own names, a timm
model's in timm's."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipeline.model.dinov3 import backbone_class
from pipeline.model.timm_backbone import TimmBackbone

PREFIX = "backbone."
TIMM_PREFIX = PREFIX + "model."  # a TimmBackbone's timm model: its export is in timm's names


class DistillStudent(nn.Module):
    """`backbone` (VisionTransformer or DINOv3ViT, no head; or a TimmBackbone: its pooled feature and its feature
    map's cells as tokens) and two Linear(student width, teacher width): one for the class token, one for the
    patch tokens (different statistics: a pooled summary, local features). On a timm model's map the patch
    Linear is a 1x1 convolution: it maps each cell to the teacher's width, and the teacher's patch grid is
    resized to the map (objective.py), so the projection is what aligns the two."""

    def __init__(self, teacher_dim: int, **backbone_kwargs: Any) -> None:
        super().__init__()
        self.backbone = student_class(backbone_kwargs)(**backbone_kwargs)
        width = self.backbone.embed_dim
        self.cls_proj = nn.Linear(width, teacher_dim)
        self.patch_proj = nn.Linear(width, teacher_dim)

    def forward(self, images: torch.Tensor, features: bool = False) -> Any:
        """(projected class token (B, Dt), projected patch tokens (B, N, Dt)); with `features`, the backbone's
        tokens after its final norm (what eval.sets judges)."""
        if features:
            return self.backbone.forward_features(images)
        tokens = self.backbone.forward_tokens(images)
        return self.cls_proj(tokens.cls_token), self.patch_proj(tokens.patch_tokens)

    def no_weight_decay(self) -> set[str]:
        own = getattr(self.backbone, "no_weight_decay", set)()  # a timm model: its 1-D parameters (optim.py)
        return {PREFIX + name for name in own}

    def group_matcher(self, coarse: bool = False) -> dict[str, str]:
        """The backbone's layers; the projections are the last layer (lr scale 1), as a head."""
        return {k: "^" + PREFIX.replace(".", r"\.") + v.lstrip("^") for k, v in self.backbone.group_matcher(coarse).items()}

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.backbone.set_grad_checkpointing(enable)


class DistillStudents(nn.Module):
    """Several students on one teacher forward (`distill.students` of two or more), one module under one engine:
    `students[name]` a DistillStudent each. Each is drawn from the random state it was built in, as if it were
    the only one (the state restored before each), and its parameters appear in no other student's loss, so its
    gradients, and its AdamW steps, are those of the same student distilled alone."""

    ARCH_KEYS = ("students",)

    def __init__(self, teacher_dim: int, students: dict[str, dict[str, Any]],
                 img_size: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.img_size = img_size  # every student's input size (the trainer's loaders read it from the arguments)
        cpu = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        built = {}
        for name, kwargs in students.items():
            torch.set_rng_state(cpu)  # each student's draws as alone, from the seed's state
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
            built[name] = DistillStudent(teacher_dim, **kwargs)
        self.students = nn.ModuleDict(built)

    def forward(self, images: torch.Tensor, features: bool = False, student: str | None = None) -> Any:
        """{name: (projected class token, projected patch tokens)}; with `features`, the tokens of `student`'s
        backbone (the first's by default: what eval.sets judges)."""
        if features:
            return self.students[student or next(iter(self.students))](images, features=True)
        return {name: s(images) for name, s in self.students.items()}

    def no_weight_decay(self) -> set[str]:
        return {f"students.{n}.{k}" for n, s in self.students.items() for k in s.no_weight_decay()}

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        for s in self.students.values():
            s.set_grad_checkpointing(enable)


def backbone_kwargs(model_kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in model_kwargs.items() if k != "teacher_dim"}


def student_class(model_kwargs: dict[str, Any]) -> type[nn.Module]:
    if "timm_model" in model_kwargs:
        return TimmBackbone
    return backbone_class(backbone_kwargs(model_kwargs))


def exported(state: dict[str, torch.Tensor], student: str | None = None) -> dict[str, torch.Tensor]:
    """The backbone's weights of a DistillStudent's state dict (of DistillStudents': `student`'s), in the
    backbone's own names (a timm model's in timm's: what `timm.create_model(name, num_classes=0, **kwargs)`
    loads)."""
    outer = f"students.{student}." if student is not None else ""
    prefix = outer + (TIMM_PREFIX if any(k.startswith(outer + TIMM_PREFIX) for k in state) else PREFIX)
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
