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

    @torch.no_grad()
    def update_center(self, teacher_output: torch.Tensor) -> None:
        batch_center = all_reduce_sum(teacher_output.sum(dim=0, keepdim=True))
        batch_center /= teacher_output.shape[0] * world_size()
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)

    def apply_center_update(self) -> None:
        """Kept for code written against Meta's class: `update_center` has already applied the update."""
