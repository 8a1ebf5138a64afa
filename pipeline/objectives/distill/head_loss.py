"""The head-based distillation loss (`distill.targets: heads`, docs/distill.md): DINOv3's distillation
(Meta's dinov3/train/multidist_meta_arch.py, its `compute_losses`) on our DINO, iBOT and KoLeo losses
(pipeline/objectives/dino/loss/). The student's DINO head on the class tokens of its global and local crops
against the teacher's DINO head on the global crops, the student's iBOT head on the patches at iBOT's mask
positions against the teacher's at the same positions, each teacher output Sinkhorn-Knopp-centred (DINOv3's
distillation always centres so), and KoLeo on the student's global class tokens before its head."""

from __future__ import annotations

import torch

from pipeline.objectives.dino.loss import DINOLoss, KoLeoLoss, iBOTPatchLoss
from pipeline.objectives.dino.masked import masked_weights


class HeadLoss:
    """The weighted terms of one micro batch, named as Meta's loss_dict (they sum to the loss):

        dino_global_crops_loss = dino_weight x CE summed over (student global s, teacher global t) pairs / P
        dino_local_crops_loss  = dino_weight x CE summed over (student local s, teacher global t) pairs / P
        koleo_loss            = koleo_weight x sum over the 2 global crops of KoLeo(its class tokens)
        ibot_loss             = ibot_weight x iBOT's cross-entropy on the mask positions, per image 1/(its count)

    CE of one pair: the batch mean of -sum_k q_t(k) log softmax(s / student_temp)(k), q_t the teacher's
    Sinkhorn-Knopp assignment at `teacher_temp`. P counts every pair of both kinds: 2 x 2 global pairs, 2 when
    `ignore_diagonal` (a student crop not against the teacher's output of the same crop: DINOv3's distilled
    config), plus 2 x n_local local pairs; so the two DINO terms are Meta's global_scale x its mean over global
    pairs and local_scale x its mean over local pairs. KoLeo is Meta's koleo_scale (2) x its mean over crops."""

    def __init__(self, out_dim: int, patch_out_dim: int, dino_weight: float, ibot_weight: float,
                 koleo_weight: float, teacher_temp: float, ignore_diagonal: bool, student_temp: float = 0.1) -> None:
        self.dino = DINOLoss(out_dim, student_temp=student_temp)
        self.ibot = iBOTPatchLoss(patch_out_dim, student_temp=student_temp)
        self.koleo = KoLeoLoss()
        self.dino_weight, self.ibot_weight, self.koleo_weight = dino_weight, ibot_weight, koleo_weight
        self.teacher_temp, self.ignore_diagonal = teacher_temp, ignore_diagonal

    @torch.no_grad()
    def teacher_targets(self, cls_out: torch.Tensor, masked_out: torch.Tensor | None, masks: torch.Tensor | None,
                        valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The teacher's DINO head outputs (2B, K) and iBOT head outputs (M, K) -> their Sinkhorn-Knopp
        assignments: the class tokens of both global crops normalised together (Meta's `cls_after_head` of
        n_crops x B rows), the masked patches over their true count (`valid`: the rows of a padded gather)."""
        t_cls = self.dino.sinkhorn_knopp_teacher(cls_out.float(), self.teacher_temp)
        if masked_out is None:
            return t_cls, None
        t_masked = self.ibot.sinkhorn_knopp_teacher(masked_out.float(), self.teacher_temp, masks.sum(), valid=valid)
        return t_cls, t_masked

    def __call__(self, student: dict[str, torch.Tensor], t_cls: torch.Tensor, t_masked: torch.Tensor | None,
                 masks: torch.Tensor | None, mask_indices: torch.Tensor | None,
                 valid: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """`student`: its DINO head's outputs `global` (2B, K) and `local` (nB, K) or absent, its class tokens
        before the head `global_cls` (2B, D), its iBOT head's `masked` (M, K) at `mask_indices`; `t_cls` (2B, K)
        and `t_masked` (M, K) the teacher's assignments (teacher_targets)."""
        teacher = list(t_cls.chunk(2))  # crop-major: the teacher's first global crop of every image, then its second
        s_global = student["global"].float().chunk(2)
        n_local = student["local"].shape[0] // teacher[0].shape[0] if "local" in student else 0
        global_pairs = [(s, t) for s in range(2) for t in range(2) if not (self.ignore_diagonal and s == t)]
        pairs = len(global_pairs) + 2 * n_local
        terms = {}
        if self.dino_weight > 0:
            # DINOLoss sums the batch-mean cross-entropy over the pairs it is given: one call per pair here.
            terms["dino_global_crops_loss"] = self.dino_weight * sum(
                self.dino([s_global[s]], [teacher[t]]) for s, t in global_pairs) / pairs
            if n_local:
                terms["dino_local_crops_loss"] = self.dino_weight * self.dino(
                    student["local"].float().chunk(n_local), teacher) / pairs
        if self.koleo_weight > 0:  # each global crop's batch apart, never the two crops of one image
            terms["koleo_loss"] = self.koleo_weight * sum(self.koleo(c.float()) for c in student["global_cls"].chunk(2))
        if self.ibot_weight > 0 and t_masked is not None:
            weights = None if valid is None else masked_weights(masks, mask_indices, valid)
            terms["ibot_loss"] = self.ibot_weight * self.ibot.forward_masked(student["masked"].float(), t_masked, masks,
                                                                             masks_weight=weights)
        return terms
