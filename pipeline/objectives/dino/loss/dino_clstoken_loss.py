"""DINO's class-token loss (Meta's dinov2/loss/dino_clstoken_loss.py): same name, arguments, `center` buffer
and methods. The centre update is applied at once, not lazily (see pipeline/objectives/dino/loss/__init__.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.objectives.dino.loss.sinkhorn_knopp import all_reduce_sum, sinkhorn_knopp, world_size


class DINOLoss(nn.Module):
    """DINO's class-token loss: cross-entropy of the student's softmax (temperature `student_temp`)
    against the teacher's centred-and-sharpened softmax or its Sinkhorn-Knopp assignment, summed over
    every (student crop, teacher crop) pair given. The `center` buffer (1, out_dim) is an EMA
    (`center_momentum`) of the teacher's mean output over the global batch."""

    def __init__(self, out_dim: int, student_temp: float = 0.1, center_momentum: float = 0.9) -> None:
        super().__init__()
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.register_buffer("center", torch.zeros(1, out_dim))

    @torch.no_grad()
    def softmax_center_teacher(self, teacher_output: torch.Tensor, teacher_temp: float) -> torch.Tensor:
        return F.softmax((teacher_output - self.center) / teacher_temp, dim=-1)

    @torch.no_grad()
    def sinkhorn_knopp_teacher(self, teacher_output: torch.Tensor, teacher_temp: float,
                               n_iterations: int = 3) -> torch.Tensor:
        # Every rank holds the same number of samples (Meta's assumption too): B = local * world.
        return sinkhorn_knopp(teacher_output, teacher_temp, teacher_output.shape[0] * world_size(),
                               n_iterations)

    def forward(self, student_output_list: list[torch.Tensor],
                teacher_out_softmaxed_centered_list: list[torch.Tensor]) -> torch.Tensor:
        total_loss = 0
        for s in student_output_list:
            lsm = F.log_softmax(s / self.student_temp, dim=-1)
            for t in teacher_out_softmaxed_centered_list:
                total_loss -= torch.sum(t * lsm, dim=-1).mean()
        return total_loss

    def crops_losses(self, student_output: torch.Tensor, teacher_probs: torch.Tensor) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
        """What `forward` computes from lists of crops, for every crop of a step in one pass (Meta's DINOv3
        `DINOLoss` takes its crops stacked too): `student_output` (S B, K) the student's head outputs of S crops,
        crop-major, the 2 global crops first; `teacher_probs` (2, B, K) the targets of the global crops, already
        swapped (row 0 is the target of the student's crop 0). Returns (global, local): each global crop against
        its target, summed over the 2 pairs; every local crop against both targets, summed over the 2 (S - 2)
        pairs; a pair's cross-entropy a mean over the batch, as in `forward`."""
        batch = teacher_probs.shape[1]
        # One log-softmax over every crop's rows, where `forward` runs one per student crop.
        lsm = F.log_softmax(student_output.float() / self.student_temp, dim=-1).view(-1, *teacher_probs.shape[1:])
        global_loss = -(lsm[:2] * teacher_probs).sum() / batch
        # The cross-entropy is bilinear: the sum over all (local crop, target) pairs is the product of the
        # local crops' summed log-probabilities with the summed targets: one product, not 2 (S - 2).
        local_loss = -(lsm[2:].sum(0) * teacher_probs.sum(0)).sum() / batch
        return global_loss, local_loss

    @torch.no_grad()
    def update_center(self, teacher_output: torch.Tensor) -> None:
        batch_center = all_reduce_sum(teacher_output.sum(dim=0, keepdim=True))
        batch_center /= teacher_output.shape[0] * world_size()
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)

    def apply_center_update(self) -> None:
        """Kept for code written against Meta's class: `update_center` has already applied the update."""
