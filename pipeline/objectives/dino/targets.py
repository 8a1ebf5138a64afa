"""Sinkhorn-Knopp's targets of a step's micro batches normalised together: the same global batch on any layout.

SwAV's Sinkhorn-Knopp (loss/sinkhorn_knopp.py) normalises the teacher's outputs over the samples it is given
and every rank's (its sums all-reduced): Meta's DINOv2 and DINOv3 give it one iteration's global batch. With
gradient accumulation a step is several rounds of micro batches, and normalising each round apart makes the
targets depend on the layout: 2 ranks of 1 micro batch normalise the step's 16 images together, 1 rank of 2
micro batches two groups of 8. `DINOv2.begin_step` runs the teacher on every micro batch of the step first and
normalises all of them here at once, so a sample's targets are a function of the step's global batch alone,
as Meta's are without accumulation (a resume on another world size ends where the uninterrupted run does)."""

from __future__ import annotations

import torch

from pipeline.objectives.dino.loss import DINOLoss, iBOTPatchLoss
from pipeline.objectives.dino.view import Views


def sinkhorn_knopp_targets(dino: DINOLoss, ibot: iBOTPatchLoss, t_cls: list[torch.Tensor],
                           t_masked: list[torch.Tensor | None], views: list[Views], temp: float,
                           ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each micro batch's (DINO targets, iBOT targets or None) from its teacher outputs (the class tokens' and
    the masked patches' head outputs, float32), normalised together over all of them and every rank's."""
    t_dino = dino.sinkhorn_knopp_teacher(torch.cat(t_cls), temp).split([len(t) for t in t_cls])
    if t_masked[0] is None:
        return [(t, None) for t in t_dino]
    valid = None if views[0].mask_valid is None else torch.cat([v.mask_valid for v in views])
    count = sum(v.masks.sum() for v in views)  # this rank's masked patches (the loss sums them over ranks)
    t_ibot = ibot.sinkhorn_knopp_teacher(torch.cat(t_masked), temp, count, valid=valid)
    return list(zip(t_dino, t_ibot.split([len(t) for t in t_masked])))
