"""The feature distillation loss (docs/distill.md): the student's projected class token and patch tokens
against the teacher's, each term weighted, one per token kind."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_loss(student: torch.Tensor, teacher: torch.Tensor, kind: str) -> torch.Tensor:
    """The mean over tokens (every leading dimension) of the per-token loss of (..., D) features, float32.

    'cosine': 1 - cos(student, teacher), indifferent to the teacher's feature norms (different for every model,
    and with high-norm outlier tokens in the large DINOv2s); 'smooth_l1': Huber with beta 1 on the features,
    summed over the channels (a token's distance, as an L2 regression would count it, outliers linear)."""
    s, t = student.float(), teacher.float()
    if kind == "cosine":
        return (1 - F.cosine_similarity(s, t, dim=-1)).mean()
    if kind == "smooth_l1":
        return F.smooth_l1_loss(s, t, reduction="none").sum(-1).mean()
    raise ValueError(f"distill.loss: {kind!r} is not 'cosine' or 'smooth_l1'")


class FeatureLoss:
    """cls_weight x token_loss(class tokens) + patch_weight x token_loss(patch tokens); the patch grids already
    aligned (the teacher's resized to the student's)."""

    def __init__(self, kind: str, cls_weight: float, patch_weight: float) -> None:
        self.kind, self.cls_weight, self.patch_weight = kind, cls_weight, patch_weight

    def __call__(self, student_cls: torch.Tensor, student_patches: torch.Tensor, teacher_cls: torch.Tensor,
                 teacher_patches: torch.Tensor) -> dict[str, torch.Tensor]:
        """The weighted terms (they sum to the loss), named as they are logged."""
        terms = {}
        if self.cls_weight > 0:
            terms["cls_loss"] = self.cls_weight * token_loss(student_cls, teacher_cls, self.kind)
        if self.patch_weight > 0:
            terms["patch_loss"] = self.patch_weight * token_loss(student_patches, teacher_patches, self.kind)
        return terms
