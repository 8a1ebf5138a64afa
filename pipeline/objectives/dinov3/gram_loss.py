"""DINOv3's Gram loss (Meta's dinov3/loss/gram_loss.py): same name, constructor arguments and forward, written
from the paper's definition (Siméoni et al. 2025, Sec. 4.2): the mean squared difference between the Gram
matrices (all pairwise similarities) of the student's and the Gram teacher's patch features.

Where we differ from Meta's code: the negatives are removed with `torch.where` rather than by assigning into
the similarity matrices in place; the values and the gradient (0 where an entry is removed) are the same.
With `remove_only_teacher_neg`, Meta's code zeroes the teacher's negatives, then the student's entries where
both are negative, testing the teacher's sign after zeroing it: no entry of the student is ever removed, and
that is what we compute."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GramLoss(nn.Module):
    """MSE(S S^T, T T^T) over the patch features S (student) and T (Gram teacher), each L2-normalised per patch
    when `apply_norm`: per image (`img_level`, (B, N, D) -> B Gram matrices N x N) or over every patch of the
    batch ((B N, D) -> one). `remove_neg`: negative similarities set to 0 in both matrices;
    `remove_only_teacher_neg`: in the teacher's only."""

    def __init__(self, apply_norm: bool = True, img_level: bool = True, remove_neg: bool = True,  # noqa: ARG002 - Meta's signature (forward takes img_level)
                 remove_only_teacher_neg: bool = False) -> None:
        super().__init__()
        if remove_neg and remove_only_teacher_neg:
            raise ValueError("GramLoss: remove_neg and remove_only_teacher_neg are exclusive")
        self.apply_norm = apply_norm
        self.remove_neg = remove_neg
        self.remove_only_teacher_neg = remove_only_teacher_neg

    def _similarities(self, feats: torch.Tensor, img_level: bool) -> torch.Tensor:
        feats = feats.float()
        if self.apply_norm:
            feats = F.normalize(feats, dim=-1)
        if not img_level and feats.ndim == 3:
            feats = feats.flatten(0, 1)
        return feats @ feats.transpose(-1, -2)

    def forward(self, output_feats: torch.Tensor, target_feats: torch.Tensor, img_level: bool = True) -> torch.Tensor:
        """`output_feats` the student's, `target_feats` the Gram teacher's: (B, N, D), or (M, D) patches when
        not `img_level`."""
        if img_level and (output_feats.ndim != 3 or target_feats.ndim != 3):
            raise ValueError(f"GramLoss at image level takes (B, N, D) features, got {tuple(output_feats.shape)} and "
                             f"{tuple(target_feats.shape)}")
        target = self._similarities(target_feats, img_level)
        student = self._similarities(output_feats, img_level)
        if self.remove_neg:
            target = torch.where(target < 0, 0.0, target)
            student = torch.where(student < 0, 0.0, student)
        elif self.remove_only_teacher_neg:
            target = torch.where(target < 0, 0.0, target)
        return F.mse_loss(student, target)
