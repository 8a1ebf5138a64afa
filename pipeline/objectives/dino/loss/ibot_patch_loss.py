"""iBOT's patch-token loss (Meta's dinov2/loss/ibot_patch_loss.py): same name, arguments, `center` buffer
and methods, its dense and gathered (`forward_masked`) forms."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.objectives.dino.loss.sinkhorn_knopp import all_reduce_sum, sinkhorn_knopp, world_size


class iBOTPatchLoss(nn.Module):  # noqa: N801 - Meta's name, kept so their code moves across
    """iBOT's patch-token loss: the DINO cross-entropy on the masked patches of the global crops, each
    image's patches weighted 1 / (its number of masked patches), averaged over images. The `center`
    buffer (1, 1, patch_out_dim) is an EMA of the teacher's mean patch output."""

    def __init__(self, patch_out_dim: int, student_temp: float = 0.1, center_momentum: float = 0.9) -> None:
        super().__init__()
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.register_buffer("center", torch.zeros(1, 1, patch_out_dim))

    @torch.no_grad()
    def softmax_center_teacher(self, teacher_patch_tokens: torch.Tensor, teacher_temp: float) -> torch.Tensor:
        """(B, N, K) or gathered (1, M, K), as Meta's meta-arch passes them: the centre is (1, 1, K)."""
        return F.softmax((teacher_patch_tokens - self.center) / teacher_temp, dim=-1)

    @torch.no_grad()
    def sinkhorn_knopp_teacher(self, teacher_output: torch.Tensor, teacher_temp: float,
                               n_masked_patches_tensor: torch.Tensor, n_iterations: int = 3,
                               valid: torch.Tensor | None = None) -> torch.Tensor:
        """`teacher_output` is (local masked patches, K); `n_masked_patches_tensor` this rank's count,
        summed over ranks here (on a copy: Meta's all-reduces the caller's tensor in place); `valid` which
        rows are masked patches when the gather is padded to a fixed size (the others get zeros)."""
        n_total = all_reduce_sum(torch.as_tensor(n_masked_patches_tensor, device=teacher_output.device).clone())
        return sinkhorn_knopp(teacher_output, teacher_temp, n_total, n_iterations, valid)

    def forward(self, student_patch_tokens: torch.Tensor, teacher_patch_tokens: torch.Tensor,
                student_masks_flat: torch.Tensor) -> torch.Tensor:
        """Dense form: tokens (B, N, D), masks (B, N) boolean."""
        loss = torch.sum(teacher_patch_tokens * F.log_softmax(student_patch_tokens / self.student_temp, dim=-1),
                         dim=-1)
        loss = torch.sum(loss * student_masks_flat.float(), dim=-1) / student_masks_flat.sum(dim=-1).clamp(min=1.0)
        return -loss.mean()

    def forward_masked(self, student_patch_tokens_masked: torch.Tensor, teacher_patch_tokens_masked: torch.Tensor,
                       student_masks_flat: torch.Tensor, n_masked_patches: int | None = None,
                       masks_weight: torch.Tensor | None = None) -> torch.Tensor:
        """Gathered form: tokens (M, D) for the M masked patches in `student_masks_flat` (B, N) order;
        `n_masked_patches` keeps the first M' rows (Meta pads the gathered tokens to a fixed length)."""
        # float32 as Meta's (both its xFormers cross_entropy and its fallback end in float32 here).
        s = student_patch_tokens_masked.float()
        t = teacher_patch_tokens_masked.float()
        loss = torch.sum(t * F.log_softmax(s / self.student_temp, dim=-1), dim=-1)
        if masks_weight is None:
            per_image = 1 / student_masks_flat.sum(-1).clamp(min=1.0)
            masks_weight = per_image.unsqueeze(-1).expand_as(student_masks_flat)[student_masks_flat]
        if n_masked_patches is not None:
            loss = loss[:n_masked_patches]
        return -(loss * masks_weight).sum() / student_masks_flat.shape[0]

    @torch.no_grad()
    def update_center(self, teacher_patch_tokens: torch.Tensor) -> None:
        """`teacher_patch_tokens` (B, N, D): the centre moves toward the mean over images of each image's
        mean patch output, over the global batch."""
        batch_center = all_reduce_sum(teacher_patch_tokens.mean(1).sum(dim=0, keepdim=True))
        batch_center /= teacher_patch_tokens.shape[0] * world_size()
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)

    def apply_center_update(self) -> None:
        """Kept for code written against Meta's class: `update_center` has already applied the update."""
