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


def backbone_kwargs(model_kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in model_kwargs.items() if k != "teacher_dim"}


def student_class(model_kwargs: dict[str, Any]) -> type[nn.Module]:
    if "timm_model" in model_kwargs:
        return TimmBackbone
    return backbone_class(backbone_kwargs(model_kwargs))


def exported(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The backbone's weights of a DistillStudent's state dict, in the backbone's own names (a timm model's in
    timm's: what `timm.create_model(name, num_classes=0, **kwargs)` loads)."""
    prefix = TIMM_PREFIX if any(k.startswith(TIMM_PREFIX) for k in state) else PREFIX
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
