"""The trained model of a distillation: the student backbone (the ViT model.* describes, or a timm model named by
`distill.students`: pipeline/model/timm_backbone.py) and the projections that map its tokens to the teacher's
width. Only the backbone is exported (the projections serve the loss alone): a ViT's in its own names, a timm
model's in timm's."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pipeline.model.dino import gather_rows, redraw_head
from pipeline.model.dino_head import DINOHead, DINOv3Head
from pipeline.model.dinov3 import backbone_class
from pipeline.model.timm_backbone import TimmBackbone

PREFIX = "backbone."
TIMM_PREFIX = PREFIX + "model."  # a TimmBackbone's timm model: its export is in timm's names


class DistillStudent(nn.Module):
    """`backbone` (VisionTransformer or DINOv3ViT, no head; or a TimmBackbone: its pooled feature and its feature
    map's cells as tokens) and two Linear(student width, teacher width): one for the class token, one for the
    patch tokens (different statistics: a pooled summary, local features). On a timm model's map the patch
    Linear is a 1x1 convolution: it maps each cell to the teacher's width, and the teacher's patch grid is
    resized to the map (objective.py), so the projection is what aligns the two."""

    def __init__(self, teacher_dim: int, heads: dict[str, Any] | None = None, **backbone_kwargs: Any) -> None:
        super().__init__()
        self.backbone = student_class(backbone_kwargs)(**backbone_kwargs)
        width = self.backbone.embed_dim
        # distill.targets features: the projections; heads (`heads`, heads.py's head_arguments): a DINO and an
        # iBOT head sized as the teacher's, the projections unused (Identity: no parameters, no state).
        self.cls_proj = nn.Linear(width, teacher_dim) if heads is None else nn.Identity()
        self.patch_proj = nn.Linear(width, teacher_dim) if heads is None else nn.Identity()
        self.dino_head = self.ibot_head = nn.Identity()
        if heads is not None:
            self.dino_head = dino_head(heads, width, heads["head_n_prototypes"], heads["head_bottleneck_dim"])
            self.ibot_head = dino_head(heads, width, heads["ibot_head_n_prototypes"], heads["ibot_head_bottleneck_dim"])
        self.heads = heads is not None

    def forward(self, images: torch.Tensor, features: bool = False, local_crops: torch.Tensor | None = None,
                mask_indices: torch.Tensor | None = None) -> Any:
        """(projected class token (B, Dt), projected patch tokens (B, N, Dt)); with `features`, the backbone's
        tokens after its final norm (what eval.sets judges). With heads, `images` the global crops (2B, ...):
        {global_cls: their class tokens (KoLeo's), global: the DINO head's outputs, local: those of
        `local_crops` (when given), masked: the iBOT head's on the patches `mask_indices` gathers (when given)},
        the crops unmasked as in Meta's distillation (the positions are iBOT's masks)."""
        if features:
            return self.backbone.forward_features(images)
        tokens = self.backbone.forward_tokens(images)
        if not self.heads:
            return self.cls_proj(tokens.cls_token), self.patch_proj(tokens.patch_tokens)
        out = {"global_cls": tokens.cls_token, "global": self.dino_head(tokens.cls_token)}
        if local_crops is not None:
            out["local"] = self.dino_head(self.backbone.forward_tokens(local_crops).cls_token)
        if mask_indices is not None:
            out["masked"] = self.ibot_head(gather_rows(tokens.patch_tokens, None, mask_indices))
        return out

    def no_weight_decay(self) -> set[str]:
        own = getattr(self.backbone, "no_weight_decay", set)()  # a timm model: its 1-D parameters (optim.py)
        return {PREFIX + name for name in own}

    def group_matcher(self, coarse: bool = False) -> dict[str, str]:
        """The backbone's layers; the projections are the last layer (lr scale 1), as a head."""
        return {k: "^" + PREFIX.replace(".", r"\.") + v.lstrip("^") for k, v in self.backbone.group_matcher(coarse).items()}

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.backbone.set_grad_checkpointing(enable)


class DistillStudents(nn.Module):
    """Several students on one teacher forward (`distill.students` of two or more), one module under one engine:
    `students[name]` a DistillStudent each. Each is drawn from the random state it was built in, as if it were
    the only one (the state restored before each), and its parameters appear in no other student's loss, so its
    gradients, and its AdamW steps, are those of the same student distilled alone."""

    ARCH_KEYS = ("students",)  # (not lr_scales: an optimizer setting, which a resumed run takes from its config)

    def __init__(self, teacher_dim: int, students: dict[str, dict[str, Any]],
                 img_size: tuple[int, int] | None = None, lr_scales: dict[str, float] | None = None) -> None:
        super().__init__()
        self.img_size = img_size  # every student's input size (the trainer's loaders read it from the arguments)
        self.lr_scales = {name: (lr_scales or {}).get(name, 1.0) for name in students}
        cpu = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        built = {}
        for name, kwargs in students.items():
            torch.set_rng_state(cpu)  # each student's draws as alone, from the seed's state
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
            built[name] = DistillStudent(teacher_dim, **kwargs)
        self.students = nn.ModuleDict(built)

    def forward(self, images: torch.Tensor, features: bool = False, student: str | None = None, **heads: Any) -> Any:
        """{name: (projected class token, projected patch tokens)} (or with heads, `heads` the further crops:
        {name: its heads' outputs}); with `features`, the tokens of `student`'s backbone (the first's by
        default: what eval.sets judges)."""
        if features:
            return self.students[student or next(iter(self.students))](images, features=True)
        return {name: s(images, **heads) for name, s in self.students.items()}

    def no_weight_decay(self) -> set[str]:
        return {f"students.{n}.{k}" for n, s in self.students.items() for k in s.no_weight_decay()}

    def param_roles(self) -> dict[str, str]:
        """Each student's parameters a role, so groups of their own (pipeline/train/optim.py), whatever its scale."""
        return {f"student_{name}": rf"^students\.{re.escape(name)}\." for name in self.students}

    def clip_apart(self) -> tuple[str, ...]:
        """The roles whose gradients train.grad_clip clips each by its own norm: every student's, so that its
        update is the one it would take alone (Meta's one engine per student; pipeline/train/ds_step.py)."""
        return tuple(self.param_roles())

    def lr_multipliers(self) -> dict[str, float]:
        """Each student's `lr_scale` on the run's schedule (distill.students[i].lr_scale)."""
        return {f"student_{name}": scale for name, scale in self.lr_scales.items()}

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        for s in self.students.values():
            s.set_grad_checkpointing(enable)


def backbone_kwargs(model_kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in model_kwargs.items() if k not in ("teacher_dim", "heads")}


def dino_head(heads: dict[str, Any], width: int, prototypes: int, bottleneck: int) -> DINOHead:
    """A head of the teacher's class (DINOv3's plain prototypes, or DINOv2's weight-normalised ones) and sizes,
    from the student's width; its Linears drawn again as DINOv2Model's (`redraw_head`: under
    deepspeed.zero.Init they were partitioned when built, and a draw on an empty shard draws nothing)."""
    return redraw_head((DINOv3Head if heads["kind"] == "dinov3" else DINOHead)(
        width, prototypes, hidden_dim=heads["head_hidden_dim"], bottleneck_dim=bottleneck, nlayers=heads["head_nlayers"]))


def student_class(model_kwargs: dict[str, Any]) -> type[nn.Module]:
    if "timm_model" in model_kwargs:
        return TimmBackbone
    return backbone_class(backbone_kwargs(model_kwargs))


def exported(state: dict[str, torch.Tensor], student: str | None = None) -> dict[str, torch.Tensor]:
    """The backbone's weights of a DistillStudent's state dict (of DistillStudents': `student`'s), in the
    backbone's own names (a timm model's in timm's: what `timm.create_model(name, num_classes=0, **kwargs)`
    loads)."""
    outer = f"students.{student}." if student is not None else ""
    prefix = outer + (TIMM_PREFIX if any(k.startswith(outer + TIMM_PREFIX) for k in state) else PREFIX)
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
