"""The KoLeo regulariser (Meta's dinov2/loss/koleo_loss.py): same name, methods and arithmetic, autocast off
for the input's device."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class KoLeoLoss(nn.Module):
    """The Kozachenko-Leonenko entropy estimator as a regulariser (Sablayrolles et al. 2018): minus the
    mean log distance of each L2-normalised vector to its nearest neighbour in the batch, which pushes the
    class tokens to spread out. Autocast is off (the input's own dtype is kept) and only this rank's vectors
    count, as in Meta's."""

    def __init__(self) -> None:
        super().__init__()
        self.pdist = nn.PairwiseDistance(2, eps=1e-8)

    def pairwise_NNs_inner(self, x: torch.Tensor) -> torch.Tensor:  # noqa: N802 - Meta's name
        """Index of each row's nearest neighbour among the others (largest inner product, unit vectors); (C, B,
        D): within each of the C sets."""
        dots = x @ x.transpose(-1, -2)
        dots.diagonal(dim1=-2, dim2=-1).fill_(-1)  # a vector is not its own neighbour; -1 is below any other cosine
        return dots.argmax(dim=-1)

    def forward(self, student_output: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
        """(B, D): Meta's scalar. (C, B, D): C sets apart (each row's neighbour within its set), one value per set,
        in one batched pass instead of a call per set (the objective's two global crops)."""
        with torch.autocast(device_type=student_output.device.type, enabled=False):
            x = F.normalize(student_output, eps=eps, p=2, dim=-1)
            nearest = self.pairwise_NNs_inner(x)
            distances = self.pdist(x, torch.take_along_dim(x, nearest.unsqueeze(-1), dim=-2))
            return -torch.log(distances + eps).mean(-1)
