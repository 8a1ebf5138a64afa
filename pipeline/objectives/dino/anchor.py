"""adapt.anchor for DINOv2 (docs/adapt.md): DINOv3's Gram loss (pipeline/objectives/dinov3/gram_loss.py) between
the student's patch features of the global crops and the frozen source's, the source held as DINOv3 holds its
Gram teacher (gram_teacher.py: taken from the EMA teacher before step 0, when the teacher is the source, and
never again). gram.* says how the loss is computed (normalised, negatives, per image); the source sees the
student's own global crops, so nothing is resized. DINOv3 anchors with its own Gram term (adapt.anchored).

State: the source's backbone, float32, partitioned as the teacher under ZeRO-3, never stored in a checkpoint
(it never trains): a resumed run (any world size and stage) reads it again from the recorded source
(adapt.init, its SHA-256 checked at the command: pipeline/run/init_source.py's `reload_source`), loaded as the
first start loaded the student, so it anchors to the same weights, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from pipeline.config import Config
from pipeline.dist import say
from pipeline.model.dino import HEAD_KEYS


class SourceAnchor:
    """The frozen source (a `GramTeacher` that takes one copy, at step 0) and the Gram loss against it."""

    def __init__(self, backbone: nn.Module, weight: float, cfg: Config) -> None:
        # Here, not at the top: pipeline/objectives/dinov3/ imports DINOv2's objective, which imports this.
        from pipeline.objectives.dinov3.gram_loss import GramLoss
        from pipeline.objectives.dinov3.gram_teacher import GramTeacher

        g = cfg.gram
        self.source = GramTeacher(backbone, start=0, every=0, max_updates=0)
        self.loss = GramLoss(apply_norm=g.normalized, remove_neg=g.remove_neg,
                             remove_only_teacher_neg=g.remove_only_teacher_neg)
        self.weight, self.img_level, self.cfg = weight, g.img_level, cfg

    @torch.no_grad()
    def before_step(self, step: int, teacher_backbone: nn.Module, device: torch.device) -> None:
        """Before step 0 of a first start the EMA teacher is the source (the trainer built it from the student
        --init loaded): it becomes the anchor. A resumed run has it from its checkpoint."""
        self.source.to(device)
        if self.source.takes_copy(step):
            self.source.take(teacher_backbone)
            say("adapt.anchor: the source (the EMA teacher of step 0) is the Gram loss's frozen target")

    def term(self, global_crops: torch.Tensor, student_patches: torch.Tensor) -> torch.Tensor:
        """adapt.anchor x GramLoss(student's patch features, the source's) on the global crops (2B, 3, G, G)."""
        patch = self.source.backbone.patch_embed.patch_size
        grid = (global_crops.shape[-2] // patch[0], global_crops.shape[-1] // patch[1])
        # The source in the student's autocast dtype on a GPU (as DINOv3's Gram teacher), float32 on the CPU.
        low = global_crops.dtype if global_crops.device.type == "cuda" and global_crops.dtype != torch.float32 \
            else None
        target = self.source.patch_features(global_crops, grid, "bicubic", False, low)  # (the same grid: no resize)
        return self.weight * self.loss(student_patches, target, img_level=self.img_level)

    def state_dict(self) -> dict[str, Any]:
        return {}  # nothing: the source is read again from adapt.init at a resume (load_state_dict)

    def load_state_dict(self, state: dict[str, Any], read_source: Callable[[nn.Module, str], None]) -> None:
        """`read_source`: the objective's (the run's reader of adapt.init)."""
        if "anchor" in state:  # a checkpoint written when the anchor was stored with it
            self.source.load_state_dict(state["anchor"])
            return
        read_source(self.source.backbone, "adapt.anchor")


def source_anchor(cfg: Config, model_class: Any, model_kwargs: dict[str, Any],
                  init: Callable[[], AbstractContextManager[Any]]) -> SourceAnchor | None:
    """The anchor of a DINOv2 run with adapt.anchor > 0 (else None): a module of the teacher's backbone's
    structure (the same parameters in the same order, partitioned alike under ZeRO-3), float32, in eval mode."""
    if cfg.adapt.anchor <= 0:
        return None
    backbone = {k: v for k, v in model_kwargs.items() if k not in HEAD_KEYS}
    with init():
        module = model_class.backbone_class(**{**backbone, "num_classes": 0, "mask_token": True,
                                               "drop_path_rate": 0.0})
    return SourceAnchor(module, cfg.adapt.anchor, cfg)
