"""DINOv3 (Siméoni et al. 2025, arXiv 2508.10104; Meta's dinov3 `SSLMetaArch` as the reference): the objective
`model.objective: dinov3`. DINOv2's recipe (pipeline/objectives/dino/: the same DINO, iBOT and KoLeo losses,
Sinkhorn-Knopp, heads, teacher EMA, its evaluation and collapse monitoring) on the DINOv3 backbone
(`DINOv3Model`: RoPE, storage tokens), as DINOv3 configures it (the dinov3 section: constant weight decay and
momentum), plus:

    RoPE augmentation   each crop's boxes drawn in the loader workers (view.py), given to the student's forward
    Gram anchoring      gram_teacher.py (a frozen copy of the EMA teacher, state) and gram_loss.py, from
                        gram.start_step, weight gram.loss_weight
    high resolution     the step's crop sizes drawn from dinov3.resolutions (view.py)
    later stages        dinov3.continue_from: a finished run's student, teachers and centres (continuation.py)

docs/dinov3.md has the recipe, the stages and what differs from Meta's loop.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.config import Config
from pipeline.data import label_free
from pipeline.dist import say
from pipeline.errors import reading_source
from pipeline.model.dino import HEAD_KEYS, DINOv3Model
from pipeline.model.dinov3 import DINOv3ViT
from pipeline.model.rope import RopeAugment
from pipeline.model.vit import model_flops
from pipeline.objectives.base import TrainView
from pipeline.objectives.dino.objective import DINOv2, Views, crop_major
from pipeline.objectives.dinov3.continuation import (
    load_student,
    objective_state,
    source_checkpoint,
    starts_here,
)
from pipeline.objectives.dinov3.gram_loss import GramLoss
from pipeline.objectives.dinov3.gram_teacher import GramTeacher
from pipeline.objectives.dinov3.view import DINOv3View, resolution_configs

ROPE_KEYS = ("rope_shift_coords", "rope_jitter_coords", "rope_rescale_coords")


@dataclass
class Dinov3Views(Views):
    gram_crops: torch.Tensor | None = None
    """(2B, 3, S, S) the global crops at the Gram teacher's side, crop-major; None without Gram anchoring"""


class DINOv3(DINOv2):
    """DINOv3 self-distillation: `DINOv2` with the dinov3 section, the DINOv3 backbone and the terms above. The
    Gram teacher, when gram.loss_weight > 0, is built beside the teacher, taken from it before the steps
    `GramTeacher.takes_copy` names, saved with the objective's state and exported nowhere (the teacher is
    the product, as in DINOv2)."""

    model_class = DINOv3Model
    section = "dinov3"
    anchors_source = False  # adapt.anchor is its Gram term against the source (adapt.anchored)

    def __init__(self, cfg: Config, info: Any):
        super().__init__(cfg, info)
        g = cfg.gram
        self.gram: GramTeacher | None = None  # built in build_companions when gram.loss_weight > 0
        self.gram_carried = False  # the Gram teacher came with dinov3.continue_from: its first copy is skipped
        self.gram_loss = GramLoss(apply_norm=g.normalized, remove_neg=g.remove_neg,
                                  remove_only_teacher_neg=g.remove_only_teacher_neg)
        self.rope = any(getattr(self.d, k) is not None for k in ROPE_KEYS)  # the student takes RoPE boxes

    # -- the models
    def model_kwargs(self) -> dict[str, Any]:
        kwargs = super().model_kwargs()
        kwargs.update({k: getattr(self.d, k) for k in ROPE_KEYS if getattr(self.d, k) is not None})
        return kwargs

    def build_companions(self, model: nn.Module, model_kwargs: dict[str, Any],
                         init: Callable[[], AbstractContextManager[Any]]) -> None:
        super().build_companions(model, model_kwargs, init)
        g = self.cfg.gram
        if g.loss_weight > 0:
            # The teacher's backbone's structure (the same parameters in the same order, partitioned alike
            # under ZeRO-3), float32, in eval mode: no stochastic depth, no RoPE augmentation.
            backbone = {k: v for k, v in model_kwargs.items() if k not in HEAD_KEYS}
            with init():
                module = DINOv3ViT(**{**backbone, "num_classes": 0, "mask_token": True, "drop_path_rate": 0.0})
            self.gram = GramTeacher(module, g.start_step, g.update_every, g.max_updates)
        if self.d.continue_from and starts_here(Path(self.cfg.run.dir)):
            self.continue_run(model, model_kwargs)

    def continue_run(self, model: nn.Module, model_kwargs: dict[str, Any]) -> None:
        """This run starts from dinov3.continue_from's newest checkpoint (continuation.py)."""
        with reading_source(f"dinov3.continue_from={self.d.continue_from}"):  # a reader's error: one line, exit 1
            run_dir, tag = source_checkpoint(self.d.continue_from, self.model_class, model_kwargs)
            load_student(model, run_dir, tag)
            state = objective_state(run_dir, tag)
        self.teacher_ema.load_state_dict(state["teacher"])
        self.dino_loss.center = state["dino_center"].clone()
        self.ibot_loss.center = state["ibot_center"].clone()
        carried = ["student", "teacher", "centres"]
        if self.gram is not None and "gram_teacher" in state:
            self.gram.load_state_dict(state["gram_teacher"])
            self.gram_carried = True
            carried.append("Gram teacher")
        say(f"dinov3.continue_from: {run_dir}, checkpoint {tag}: its {', '.join(carried)} are this run's start")

    # -- the data
    def train_view(self, model_kwargs: dict[str, Any]) -> TrainView:
        d, g = self.d, self.cfg.gram
        gram = g.loss_weight > 0

        def gram_size(global_size: int, given: int | None) -> int | None:
            if not gram:
                return None
            return given or (g.crops_size if global_size == base.global_crops_size and g.crops_size else 2 * global_size)

        base = self.crop_config(model_kwargs, gram_no_distortions=g.no_distortions)
        configs, weights = resolution_configs(base, d.resolutions, gram_size)
        rope = RopeAugment(d.rope_shift_coords, d.rope_jitter_coords, d.rope_rescale_coords,
                           blocks=model_kwargs["depth"]) if self.rope else None
        view = DINOv3View(configs, weights, model_kwargs["patch_size"], d.mask_probability, tuple(d.mask_ratio), rope,
                          self.cfg.train.seed)
        return TrainView(label_free(self.cfg.data), sample=view)

    # -- the schedules: DINOv3's are constant after their warm-up (None ends: config.py)
    def momentum(self, step: int) -> float:
        return self.d.momentum_teacher if self.d.final_momentum_teacher is None else super().momentum(step)

    def weight_decay(self, step: int) -> float:
        return self.cfg.train.weight_decay if self.d.weight_decay_end is None else super().weight_decay(step)

    @torch.no_grad()
    def before_step(self, engine: Any, step: int) -> None:
        super().before_step(engine, step)
        if self.gram is None:
            return
        self.gram.to(engine.device)
        if self.gram.takes_copy(step) and not (self.gram_carried and step == self.gram.start):
            self.gram.take(self.teacher.backbone)
            say(f"gram: the Gram teacher is the EMA teacher of step {step} (copy {self.gram.copies_taken(step)})")

    # -- a step
    def views(self, images: Any) -> Dinov3Views:
        v = super().views(images)
        rest = list(images[3:])
        out = Dinov3Views(v.global_crops, v.local_crops, v.masks, v.batch, v.n_local)
        if self.rope:
            # The boxes travel as int32 bits of float32 (the loader casts floating parts to the run's dtype).
            g_boxes, l_boxes, *rest = rest
            out.student["rope_aug"] = (crop_major(g_boxes.view(torch.float32)),
                                       crop_major(l_boxes.view(torch.float32)) if v.n_local else None)
        if self.gram is not None:
            out.gram_crops = crop_major(rest[0])
        return out

    def loss_terms(self, engine: Any, views: Views, out: dict[str, torch.Tensor], t_dino: torch.Tensor,
                   t_ibot: torch.Tensor | None) -> dict[str, torch.Tensor]:
        losses = super().loss_terms(engine, views, out, t_dino, t_ibot)
        if self.gram is None:
            return losses
        g = self.cfg.gram
        if self.step < g.start_step:  # logged as 0 until then: the same terms in every log window
            losses["gram_loss"] = out["global"].new_zeros((), dtype=torch.float32)
            return losses
        patch = self.teacher.backbone.patch_embed.patch_size
        grid = (views.global_crops.shape[-2] // patch[0], views.global_crops.shape[-1] // patch[1])
        crops = views.gram_crops
        low = crops.dtype if engine.device.type == "cuda" and crops.dtype != torch.float32 else None
        target = self.gram.patch_features(crops, grid, g.resize_method, g.resize_antialias, low)
        student = out["global_patch"]
        if g.tokens_used != "all" and views.masks is not None:
            keep = views.masks if g.tokens_used == "masked" else ~views.masks
            student, target = student[keep], target[keep]
        losses["gram_loss"] = g.loss_weight * self.gram_loss(student, target, img_level=g.img_level)
        return losses

    # -- cost and state
    def flops_per_image(self, model_kwargs: dict[str, Any], local_size: int | None = None) -> float:  # noqa: ARG002 - the sizes are the view's
        """DINOv2's count at each resolution's sizes, weighted by how often a step is at it, plus the Gram
        teacher's forward on the 2 global crops at its side (forward only: a third, as the teacher's)."""
        base = self.train_view(model_kwargs).sample
        total = 0.0
        for view, weight in zip(base.views, base.weights):
            c = view.multicrop.cfg
            flops = super().flops_per_image({**model_kwargs, "img_size": c.global_crops_size}, c.local_crops_size)
            if c.gram_crops_size:
                flops += 2 * model_flops(model_kwargs, c.gram_crops_size) / 3
            total += weight * flops
        return total / sum(base.weights)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.gram is not None:  # collective under ZeRO-3, as the teacher's
            state.update(gram_carried=self.gram_carried)
            if self.cfg.adapt.anchor <= 0:  # an anchor (the source, never updated) is read again at a resume
                state.update(gram_teacher=self.gram.state_dict())
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.gram is None:
            return
        if self.cfg.adapt.anchor > 0 and "gram_teacher" not in state:  # adapt.anchor: the source, not stored
            self._source_reader()(self.gram.backbone, "adapt.anchor (the Gram teacher)")
            self.gram_carried = bool(state.get("gram_carried", False))
            return
        if "gram_teacher" not in state:  # gram.loss_weight turned on at a resume: start from the teacher
            say("gram: the checkpoint holds no Gram teacher (gram.loss_weight was 0 when it was written); it is "
                "taken from the resumed EMA teacher now")
            self.gram.take(self.teacher.backbone)
            return
        self.gram.load_state_dict(state["gram_teacher"])
        self.gram_carried = bool(state.get("gram_carried", False))
