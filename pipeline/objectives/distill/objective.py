"""Feature distillation (`model.objective: distill`): a frozen teacher read from any source (teacher.py) teaches
the student (model.*, student.py) through its features: the student's class token and patch tokens, each
through a learned Linear to the teacher's width, regressed onto the teacher's (loss.py), the teacher's patch
grid resized to the student's. Both see the same augmented view of each image (the train transform: "consistent"
teaching, Beyer et al. 2022). A DINOv2/DINOv3 run of ours (heads.py) teaches instead through its DINO and iBOT
heads, each student through heads of its own (head_loss.py: DINOv3's distillation; `distill.targets`). The
student's backbone is the run's product (model.safetensors), read back as any ViT of model.variant
(config.py: RECIPE). docs/distill.md has the recipe and what is tested.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import Config, ConfigError, ConfigFiles
from pipeline.data import label_free, raise_if_any_failed
from pipeline.dist import DistEnv, say
from pipeline.errors import reading_source
from pipeline.eval.features import Features, class_tokens, embedding, extract
from pipeline.eval.knn import knn_loaders, knn_top1
from pipeline.model.dino_head import dino_head_flops
from pipeline.model.timm_backbone import TimmBackboneError, feature_grid, timm_flops
from pipeline.model.variants import model_flops, model_kwargs_from_config, pair
from pipeline.model.vit import architecture
from pipeline.model.weights import WeightsError
from pipeline.objectives.backbone import Backbone, load_backbone
from pipeline.objectives.base import EvalResult, FeaturesContext, Objective, TrainView
from pipeline.objectives.dino.masked import mask_bound, masked_rows
from pipeline.objectives.dino.view import crop_major
from pipeline.objectives.dinov3.gram_teacher import resize_patches
from pipeline.objectives.distill.head_loss import HeadLoss
from pipeline.objectives.distill.heads import (
    head_arguments,
    head_teacher_problem,
    head_view,
    read_head_teacher,
)
from pipeline.objectives.distill.loss import FeatureLoss
from pipeline.objectives.distill.student import (
    DistillStudent,
    DistillStudents,
    backbone_kwargs,
    exported,
    student_class,
)
from pipeline.objectives.distill.teacher import Teacher
from pipeline.train import ds_compat
from pipeline.train.checkpoint import consolidate, full_fp32_state_dict
from pipeline.train.optim import role_lr


class Distill(Objective):
    """The student learns the teacher's features; the teacher is state only by its digest (never saved)."""

    model_class = DistillStudent

    def __init__(self, cfg: Config, info: Any):
        super().__init__(cfg, info)
        self.d = cfg.distill
        self.feature_loss = FeatureLoss(self.d.loss, self.d.cls_weight, self.d.patch_weight)
        self.found: Backbone | None = None  # the teacher as read (model_kwargs needs its width)
        self.heads: bool | None = None  # distill.targets as decided for this teacher (read_teacher)
        self.head_loss: HeadLoss | None = None  # with heads (model_kwargs, when the teacher's sizes are known)
        self.teacher: Teacher | None = None  # built in build_companions
        self.teacher_forwards = 0  # teacher forwards in training (tests count them)
        self.judged_teacher = False
        self._window: dict[str, torch.Tensor] = {}
        self._count = 0

    # -- the models
    def read_teacher(self) -> Backbone:
        if self.found is None:
            files = ConfigFiles(type(self.cfg))
            with reading_source(f"distill.teacher={self.d.teacher}"):
                self.heads = self.wants_heads(files)
                self.found = (read_head_teacher(self.d.teacher, files) if self.heads else
                              load_backbone(self.d.teacher, files, flag="distill.teacher"))
        return self.found

    def wants_heads(self, files: ConfigFiles) -> bool:
        """distill.targets: 'auto' is heads where the teacher brings them (a DINOv2/DINOv3 run of ours with a
        checkpoint), 'heads' of a teacher without them one line."""
        if self.d.targets == "features":
            return False
        problem = head_teacher_problem(self.d.teacher, files)
        if problem and self.d.targets == "heads":
            raise ConfigError(f"distill.targets=heads: distill.teacher={self.d.teacher} is {problem}; give such a "
                              f"run, or distill.targets: features")
        return not problem

    def model_kwargs(self) -> dict[str, Any]:
        """One student: its own arguments (DistillStudent's, as before distill.students). Two or more:
        {"students": {name: arguments}} (DistillStudents'). `self.grids`: each student's token grid."""
        entries = self.d.students or [None]
        self.grids: dict[str, tuple[int, int]] = {}
        self.variants: dict[str, str] = {}  # each student's model.variant, or its timm model's name
        students = {(e.name if e else "student"): self.student(i, e) for i, e in enumerate(entries)}
        self.names = list(students)
        found = self.read_teacher()
        dim = (found.model.backbone if self.heads else found.model).embed_dim
        if self.heads:
            self.with_heads(found, students, entries)
        if len(students) == 1:
            kwargs = next(iter(students.values()))
            self.model_class = student_class(kwargs)  # what a resume compares (its ARCH_KEYS)
            self.student_kwargs = {name: {**kwargs, "teacher_dim": dim} for name in students}
            return {**kwargs, "teacher_dim": dim}
        self.model_class = DistillStudents
        self.student_kwargs = {name: {**kw, "teacher_dim": dim} for name, kw in students.items()}
        return {"teacher_dim": dim, "students": students, "img_size": pair(self.cfg.model.img_size),
                "lr_scales": {e.name: e.lr_scale for e in entries}}

    def student(self, i: int, entry: Any) -> dict[str, Any]:
        """A student's constructor arguments (a ViT's from model.* and its entry's `model`, or a timm model's),
        its grid into `self.grids`."""
        name = entry.name if entry else "student"
        if entry is not None and entry.timm:
            kwargs = self.timm_student(i, entry.timm, entry.kwargs)
            self.grids[name], self.variants[name] = self._timm_grid, entry.timm
            return kwargs
        try:
            model = dataclasses.replace(self.cfg.model, **(entry.model if entry else {}))
        except TypeError as e:
            raise ConfigError(f"distill.students[{i}].model: {e} (model.* keys expected)") from None
        kwargs = model_kwargs_from_config(model, 0)
        kwargs["num_classes"] = 0  # the student is a backbone: its head is fitted by whoever uses it
        self.variants[name] = model.variant
        self.grids[name] = tuple(s // kwargs["patch_size"] for s in pair(kwargs["img_size"]))
        return kwargs

    def timm_student(self, i: int, name: str, timm_kwargs: dict[str, Any]) -> dict[str, Any]:
        """A timm student's arguments (TimmBackbone's), its feature map's grid found from its shapes alone: the
        teacher's patch grid is resized to it, which needs the two grids of one shape (a map of another aspect
        than the teacher's grid would be stretched onto it: a stride that does not divide model.img_size)."""
        img, patch = pair(self.cfg.model.img_size), self.read_teacher().model.patch_embed.patch_size[0]
        try:
            _, grid = feature_grid(name, timm_kwargs, img)
        except TimmBackboneError as e:
            raise ConfigError(f"distill.students[{i}].timm: {e}") from None
        teacher = (img[0] // patch, img[1] // patch)
        if grid[0] * teacher[1] != grid[1] * teacher[0]:
            raise ConfigError(f"distill.students[{i}]: timm's {name!r} gives a {grid[0]}x{grid[1]} feature map at "
                              f"model.img_size={list(img)}, the teacher a {teacher[0]}x{teacher[1]} patch grid: "
                              f"they cannot be aligned (another shape); give a model.img_size the student's "
                              f"stride divides")
        self._timm_grid = grid
        return {"timm_model": name, "timm_kwargs": dict(timm_kwargs), "img_size": img}

    def with_heads(self, found: Backbone, students: dict[str, dict[str, Any]], entries: list[Any]) -> None:
        """distill.targets heads: each student's heads sized as the teacher's (its `heads` argument), a ViT's
        position table resized for the local crops; its grid the teacher's (iBOT's positions are the teacher's
        patches: DINOv3 asserts the same patch size); the view and the loss."""
        heads, img = head_arguments(found.model, found.kwargs), pair(self.cfg.model.img_size)
        patch = found.model.backbone.patch_embed.patch_size[0]
        for i, (name, kwargs) in enumerate(students.items()):
            grid = self.grids[name]
            if self.d.ibot_weight > 0 and grid != (img[0] // patch, img[1] // patch):
                key = f"distill.students[{i}]" if entries[i] is not None else "model.patch_size"
                raise ConfigError(f"{key}: a {grid[0]}x{grid[1]} token grid at model.img_size={list(img)}, the "
                                  f"teacher's patches {img[0] // patch}x{img[1] // patch}: distill.targets heads "
                                  f"scores iBOT on the teacher's patch positions (set distill.ibot_weight 0, or "
                                  f"distill.targets features)")
            if "timm_model" not in kwargs and "rope_temperature" not in kwargs:
                kwargs["dynamic_img_size"] = True  # the local crops' size: its position table resized to them
            kwargs["heads"] = heads
        if img[0] != img[1]:
            raise ConfigError(f"model.img_size={list(img)}: distill.targets heads takes square global crops; give one side")
        self.view = head_view(found.config, found.model, self.cfg, img[0])
        self.head_loss = HeadLoss(heads["head_n_prototypes"], heads["ibot_head_n_prototypes"], self.d.dino_weight,
                                  self.d.ibot_weight, self.d.koleo_weight, self.d.teacher_temp,
                                  self.d.global_ignore_diagonal)
        say(f"distill: through the teacher's heads ({found.config.model.objective} run, {found.tag}): DINO "
            f"{self.d.dino_weight}, iBOT {self.d.ibot_weight}, KoLeo {self.d.koleo_weight}, "
            f"{self.view.multicrop.cfg.local_crops_number} local crops")

    def build_model(self, model_kwargs: dict[str, Any]) -> nn.Module:
        return (DistillStudents if "students" in model_kwargs else DistillStudent)(**model_kwargs)

    def build_companions(self, model: nn.Module, model_kwargs: dict[str, Any],  # noqa: ARG002 - the interface
                         init: Callable[[], AbstractContextManager[Any]]) -> None:
        side = pair(self.cfg.model.img_size)
        with reading_source(f"distill.teacher={self.d.teacher}"):
            self.teacher = Teacher(self.read_teacher(), self.d.teacher, side, init)
        self.found = None  # its weights are in the teacher now
        say(f"distill: teacher {self.teacher.source} (width {self.teacher.dim}, patch {self.teacher.patch}, "
            f"sha256 {self.teacher.digest[:12]})")
        flops = ", ".join(f"{name} {v / 1e9:.3g}" for name, v in self.model_flops(model_kwargs).items())
        say(f"distill: forward GFLOPs per image: {flops}")

    @classmethod
    def exported_architecture(cls, model_kwargs: dict[str, Any]) -> dict[str, Any]:
        """The (first) student's backbone's: what model.safetensors holds."""
        if "students" in model_kwargs:
            model_kwargs = next(iter(model_kwargs["students"].values()))
        return architecture(student_class(model_kwargs), backbone_kwargs(model_kwargs))

    # -- the data: the train transform's one view of each sample, seen by both models; labels unread
    def train_view(self, model_kwargs: dict[str, Any]) -> TrainView:  # noqa: ARG002 - the interface
        if self.heads:  # the teacher run's multi-crop and iBOT masks, drawn in the workers from each sample's seed
            return TrainView(label_free(self.cfg.data), sample=self.view)
        return TrainView(label_free(self.cfg.data))

    def build_eval(self, env: DistEnv, img_size: tuple[int, int], batch: int) -> list[Any]:
        self.val_loader, self.knn_loader = knn_loaders(self.cfg.data, self.info, env, img_size, batch,
                                                       self.d.knn_k, self.d.knn_train_samples)
        return [x for x in (self.val_loader, self.knn_loader) if x is not None]

    # -- a step
    def before_step(self, engine: Any, step: int) -> None:  # noqa: ARG002 - the interface
        self.teacher.to(engine.device)

    def loss(self, engine: Any, images: Any, targets: torch.Tensor,  # noqa: ARG002 - the interface
             extras: torch.Tensor | None) -> torch.Tensor:  # noqa: ARG002 - the interface
        # The teacher under the run's autocast dtype where its inputs are low precision on a GPU (float32
        # weights, as DINOv2's teacher); float32 on a CPU.
        first = images[0] if self.heads else images
        low = first.dtype if engine.device.type == "cuda" and first.dtype != torch.float32 else None
        per_student = self.head_terms(engine, images, low) if self.heads else self.feature_terms(engine, images, low)
        total = 0
        for name, terms in per_student.items():
            total = total + sum(terms.values())  # each student's parameters only in its own terms
            with torch.no_grad():
                for term, value in terms.items():
                    key = term if len(per_student) == 1 else f"{name}/{term}"  # train/<student>/cls_loss
                    self._window[key] = self._window.get(key, 0) + value.detach().float()
        self._count += 1
        return total

    def feature_terms(self, engine: Any, images: torch.Tensor, low: torch.dtype | None) -> dict[str, dict]:
        """Each student's weighted feature terms (loss.py) on one teacher forward."""
        t_cls, t_map, t_grid = self.teacher.native(images, low)  # once for every student
        self.teacher_forwards += 1
        out = engine(images)
        out = out if isinstance(out, dict) else {self.names[0]: out}  # one student: its own pair
        return {name: self.feature_loss(s_cls, s_patches, t_cls,
                                        resize_patches(t_map, t_grid, self.grids[name], self.d.resize_method))
                for name, (s_cls, s_patches) in out.items()}

    def head_terms(self, engine: Any, images: Any, low: torch.dtype | None) -> dict[str, dict]:
        """Each student's weighted head terms (head_loss.py) on one teacher forward: the view's global crops,
        local crops and iBOT masks crop-major, the masked positions a gather of a fixed size (no host read:
        dino/masked.py), the teacher's head outputs Sinkhorn-Knopp-centred once for every student."""
        global_crops, local_crops, masks = (crop_major(x) for x in images[:3])
        local = local_crops if images[1].shape[1] else None
        indices = valid = None
        if self.d.ibot_weight > 0:
            indices, valid = masked_rows(masks, mask_bound(masks, self.view.mask_probability, self.view.mask_ratio))
        cls_out, masked_out = self.teacher.head_outputs(global_crops, indices, low)
        self.teacher_forwards += 1
        t_cls, t_masked = self.head_loss.teacher_targets(cls_out, masked_out, masks, valid)
        out = engine(global_crops, local_crops=local, mask_indices=indices)
        out = out if len(self.names) > 1 else {self.names[0]: out}  # one student: its own outputs
        return {name: self.head_loss(s_out, t_cls, t_masked, masks, indices, valid) for name, s_out in out.items()}

    def train_metrics(self) -> dict[str, torch.Tensor]:
        window, count, self._window, self._count = self._window, self._count, {}, 0
        return {name: value / max(count, 1) for name, value in window.items()}

    def lr_metrics(self, groups: list[dict[str, Any]]) -> dict[str, float]:
        """Two or more students: each one's lr (train/<name>/lr, beside its losses), its lr_scale on the schedule;
        train/lr alone is the largest of them (every group has a student's role)."""
        return {f"{name}/lr": role_lr(groups, f"student_{name}") for name in self.names} if len(self.names) > 1 else {}

    # -- evaluation
    @contextmanager
    def features(self, engine: Any, student: str | None = None) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        """A student backbone's (what it exports; the first's by default), eval mode."""
        model = engine.module if hasattr(engine, "module") else engine
        dtype, was = next(model.parameters()).dtype, model.training
        several = isinstance(model, DistillStudents)
        backbone = model.students[student or self.names[0]].backbone if several else model.backbone
        extra = {"student": student or self.names[0]} if several else {}
        model.eval()
        try:
            yield lambda images: embedding(engine(images.to(dtype), features=True, **extra), backbone)
        finally:
            model.train(was)

    def model_names(self) -> dict[str, str]:
        """Each student's model (a timm model's name, a ViT's variant, its entry's `model.variant` included)."""
        return self.variants

    def judged_features(self, engine: Any) -> dict[str, FeaturesContext]:
        """eval.sets judges every student: one as the run's own (eval/<set>/...), two or more each under its name
        (eval/<student>/<set>/...)."""
        if len(self.names) == 1:
            return {"": self.features(engine)}
        return {name: self.features(engine, name) for name in self.names}

    def reference_features(self, engine: Any) -> dict[str, FeaturesContext]:
        """The teacher, judged by eval.sets at step 0 (eval/teacher/<set>/...): the figure each student reads
        against."""
        return {"teacher": self.teacher_features(engine.device)}

    @contextmanager
    def teacher_features(self, device: torch.device) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        """The teacher's embedding rows (class token, mean patch token after its final norm), float32 as it runs on
        a CPU; gathered once for the whole pass under ZeRO-3 (collective)."""
        self.teacher.to(device)  # (at step 0 no step has moved it yet)
        backbone = self.teacher.backbone  # (with heads: the model's backbone; the whole model gathered)
        with ds_compat.gathered(self.teacher.module):
            yield lambda images: embedding(backbone.forward_features(images.float()), backbone)

    def model_flops(self, model_kwargs: dict[str, Any]) -> dict[str, float]:
        """Each student's backbone forward per image (what it costs deployed: no projection) and the teacher's."""
        students = model_kwargs.get("students") or {self.names[0]: model_kwargs}
        return {**{name: backbone_flops(backbone_kwargs(k)) for name, k in students.items()},
                "teacher": model_flops(self.teacher.flops_kwargs)}

    @torch.no_grad()
    def evaluate(self, engine: Any, dtype: torch.dtype, run_dir: Path | None, step: int) -> EvalResult:  # noqa: ARG002 - the interface
        """Each student's k-NN top-1 (its L2-normalised class token: eval/knn_top1, or eval/<student>/knn_top1
        for two or more), and at the first evaluation of the process the teacher's, the figure they read
        against."""
        device, metrics = engine.device, {}
        for name in self.names:
            with self.features(engine, name) as student:
                key = "eval/knn_top1" if len(self.names) == 1 else f"eval/{name}/knn_top1"
                metrics.update(self._knn(lambda x, f=student: class_tokens(f(x)), device, dtype, key))
        if not self.judged_teacher:
            self.teacher.to(device)
            t_dtype = next(self.teacher.module.parameters()).dtype
            with ds_compat.gathered(self.teacher.module):
                metrics.update(self._knn(lambda x: F.normalize(
                    self.teacher.backbone.forward_tokens(x).cls_token.float(), dim=-1), device, t_dtype,
                    "eval/teacher_knn_top1"))
            self.judged_teacher = True
        line = " | ".join(f"{k.removeprefix('eval/')} {100 * v:.2f}%" for k, v in metrics.items() if "knn" in k)
        return EvalResult(metrics, f"eval step {step}" + (f" | {line}" if line else ""))

    def _knn(self, fn: Callable[[torch.Tensor], torch.Tensor], device: torch.device, dtype: torch.dtype,
             name: str) -> dict[str, float]:
        if self.knn_loader is None:
            raise_if_any_failed(self.val_loader)
            return {}
        val = Features()
        for images, targets, valid in self.val_loader:
            val.add(fn(images.to(device, dtype, non_blocking=True)), targets, valid)
        memory = extract(self.knn_loader, fn, device, dtype)
        raise_if_any_failed(self.val_loader, self.knn_loader)
        return {name: knn_top1(*val.tensors(), *memory.tensors(), self.d.knn_k)["eval/knn_top1"]}

    # -- cost, export, state
    def flops_per_image(self, model_kwargs: dict[str, Any]) -> float:
        """Each student's forward and its projections, plus the teacher's forward once (forward only: a third,
        as MFU counts each image's FLOPs 3x)."""
        students = model_kwargs.get("students") or {"": model_kwargs}
        teacher = (model_flops(self.teacher.flops_kwargs) if self.teacher is not None  # as built, or as read
                   else model_flops({**self.read_teacher().kwargs, "img_size": pair(self.cfg.model.img_size)}))
        if self.heads:
            return self.head_flops(students, teacher)
        return sum(student_flops(backbone_kwargs(k), model_kwargs["teacher_dim"]) for k in students.values()) + teacher / 3

    def head_flops(self, students: dict[str, dict[str, Any]], teacher: float) -> float:
        """distill.targets heads: each student's forward on the 2 global and the local crops, its DINO head on
        their class tokens and its iBOT head on the expected masked patches (2 crops x probability x mean ratio
        of the grid); a third of the teacher's forward on the 2 global crops and its heads on the same tokens."""
        crops, v = self.view.multicrop.cfg, self.view
        masked = 2 * v.mask_probability * v.grid[0] * v.grid[1] * sum(v.mask_ratio) / 2 if self.d.ibot_weight else 0

        def heads(kw: dict[str, Any], dim: int, cls_tokens: int) -> float:  # DINO on the class tokens, iBOT on masked
            return (cls_tokens * dino_head_flops(kw, dim, kw["head_n_prototypes"]) + masked * dino_head_flops(
                {**kw, "head_bottleneck_dim": kw["ibot_head_bottleneck_dim"]}, dim, kw["ibot_head_n_prototypes"]))

        total = (2 * teacher + heads(head_arguments(self.teacher.module, self.teacher.kwargs), self.teacher.dim, 2)) / 3
        for kwargs in students.values():
            own = backbone_kwargs(kwargs)
            width, size = student_flops(own, 0, width_only=True), (crops.local_crops_size,) * 2
            local = (timm_flops(own["timm_model"], own["timm_kwargs"], size) if "timm_model" in own
                     else model_flops(own, size))
            total += (2 * backbone_flops(own) + crops.local_crops_number * local
                      + heads(kwargs["heads"], width, 2 + crops.local_crops_number))
        return total

    def exported_weights(self, engine: Any) -> dict[str, torch.Tensor]:
        """The (first) student's backbone."""
        return exported(full_fp32_state_dict(engine), self.names[0] if len(self.names) > 1 else None)

    def extra_exports(self, engine: Any) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]]:
        """Each student named in distill.students: its export at students/<name>/model.safetensors."""
        if not self.d.students:
            return {}
        state, several = full_fp32_state_dict(engine), len(self.names) > 1
        return {f"students/{name}/model.safetensors": (
            exported(state, name if several else None), {"variant": self.variants[name], **{
                k: str(v) for k, v in self.exported_architecture(self.student_kwargs[name]).items()}})
            for name in self.names}

    checkpoint_weights = "the (first) student's backbone (DeepSpeed's, consolidated to fp32)"

    @classmethod
    def weights_from_checkpoint(cls, run_dir: Path, tag: str, cfg: Config) -> dict[str, torch.Tensor]:
        students = cfg.distill.students
        return exported(consolidate(run_dir, tag), students[0].name if len(students) > 1 else None)

    def state_dict(self) -> dict[str, Any]:
        return {"teacher_digest": self.teacher.digest, "teacher_source": self.teacher.source}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "teacher_digest" in state and state["teacher_digest"] != self.teacher.digest:
            raise WeightsError(f"distill.teacher={self.d.teacher}: the checkpoint was distilled from another teacher "
                               f"({state.get('teacher_source')}, sha256 {state['teacher_digest'][:12]}; this one "
                               f"{self.teacher.digest[:12]}): give that teacher, or start a new run.dir")


def backbone_flops(student: dict[str, Any]) -> float:
    """A student backbone's forward FLOPs per image (multiply-adds x 2): a timm model's by torch's FLOP counter
    on the meta device, a ViT's from its arguments."""
    if "timm_model" in student:
        return timm_flops(student["timm_model"], student["timm_kwargs"], pair(student["img_size"]))
    return model_flops(student)


def student_flops(student: dict[str, Any], teacher_dim: int, width_only: bool = False) -> float:
    """A student's forward FLOPs per image and its two projections' (multiply-adds x 2); `width_only`: its width."""
    h, w = pair(student["img_size"])
    if "timm_model" in student:
        width, grid = feature_grid(student["timm_model"], student["timm_kwargs"], (h, w))
        tokens = 1 + grid[0] * grid[1]
    else:
        width, tokens = student["embed_dim"], 1 + (h // student["patch_size"]) * (w // student["patch_size"])
    return width if width_only else backbone_flops(student) + 2 * 2 * tokens * width * teacher_dim  # two Linears
