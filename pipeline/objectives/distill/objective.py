"""Feature distillation (`model.objective: distill`): a frozen teacher read from any source (teacher.py) teaches
the student (model.*, student.py) through its features: the student's class token and patch tokens, each
through a learned Linear to the teacher's width, regressed onto the teacher's (loss.py), the teacher's patch
grid resized to the student's. Both see the same augmented view of each image (the train transform: "consistent"
teaching, Beyer et al. 2022). The student's backbone is the run's product (model.safetensors), read back as any
ViT of model.variant (distill_config.RECIPE). docs/distill.md has the recipe and what is tested.
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
from pipeline.model.timm_backbone import TimmBackboneError, feature_grid, timm_flops
from pipeline.model.variants import model_flops, model_kwargs_from_config, pair
from pipeline.model.vit import architecture
from pipeline.model.weights import WeightsError
from pipeline.objectives.backbone import Backbone, load_backbone
from pipeline.objectives.base import EvalResult, FeaturesContext, Objective, TrainView
from pipeline.objectives.dinov3.gram_teacher import resize_patches
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


class Distill(Objective):
    """The student learns the teacher's features; the teacher is state only by its digest (never saved)."""

    model_class = DistillStudent

    def __init__(self, cfg: Config, info: Any):
        super().__init__(cfg, info)
        self.d = cfg.distill
        self.feature_loss = FeatureLoss(self.d.loss, self.d.cls_weight, self.d.patch_weight)
        self.found: Backbone | None = None  # the teacher as read (model_kwargs needs its width)
        self.teacher: Teacher | None = None  # built in build_companions
        self.teacher_forwards = 0  # teacher forwards in training (tests count them)
        self.judged_teacher = False
        self._window: dict[str, torch.Tensor] = {}
        self._count = 0

    # -- the models
    def read_teacher(self) -> Backbone:
        if self.found is None:
            with reading_source(f"distill.teacher={self.d.teacher}"):
                self.found = load_backbone(self.d.teacher, ConfigFiles(type(self.cfg)), flag="distill.teacher")
        return self.found

    def model_kwargs(self) -> dict[str, Any]:
        """One student: its own arguments (DistillStudent's, as before distill.students). Two or more:
        {"students": {name: arguments}} (DistillStudents'). `self.grids`: each student's token grid."""
        entries = self.d.students or [None]
        self.grids: dict[str, tuple[int, int]] = {}
        self.variants: dict[str, str] = {}  # each student's model.variant, or its timm model's name
        students = {(e.name if e else "student"): self.student(i, e) for i, e in enumerate(entries)}
        self.names = list(students)
        dim = self.read_teacher().model.embed_dim
        if len(students) == 1:
            kwargs = next(iter(students.values()))
            self.model_class = student_class(kwargs)  # what a resume compares (its ARCH_KEYS)
            self.student_kwargs = {name: {**kwargs, "teacher_dim": dim} for name in students}
            return {**kwargs, "teacher_dim": dim}
        self.model_class = DistillStudents
        self.student_kwargs = {name: {**kw, "teacher_dim": dim} for name, kw in students.items()}
        return {"teacher_dim": dim, "students": students, "img_size": pair(self.cfg.model.img_size)}

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
        return TrainView(label_free(self.cfg.data))

    def build_eval(self, env: DistEnv, img_size: tuple[int, int], batch: int) -> list[Any]:
        self.val_loader, self.knn_loader = knn_loaders(self.cfg.data, self.info, env, img_size, batch,
                                                       self.d.knn_k, self.d.knn_train_samples)
        return [x for x in (self.val_loader, self.knn_loader) if x is not None]

    # -- a step
    def before_step(self, engine: Any, step: int) -> None:  # noqa: ARG002 - the interface
        self.teacher.to(engine.device)

    def loss(self, engine: Any, images: torch.Tensor, targets: torch.Tensor,  # noqa: ARG002 - the interface
             extras: torch.Tensor | None) -> torch.Tensor:  # noqa: ARG002 - the interface
        # The teacher under the run's autocast dtype where its inputs are low precision on a GPU (float32
        # weights, as DINOv2's teacher); float32 on a CPU.
        low = images.dtype if engine.device.type == "cuda" and images.dtype != torch.float32 else None
        t_cls, t_map, t_grid = self.teacher.native(images, low)  # once for every student
        self.teacher_forwards += 1
        out = engine(images)
        out = out if isinstance(out, dict) else {self.names[0]: out}  # one student: its own pair
        total = 0
        for name, (s_cls, s_patches) in out.items():
            t_patches = resize_patches(t_map, t_grid, self.grids[name], self.d.resize_method)  # on its grid
            terms = self.feature_loss(s_cls, s_patches, t_cls, t_patches)
            total = total + sum(terms.values())  # each student's parameters only in its own terms
            with torch.no_grad():
                for term, value in terms.items():
                    key = term if len(out) == 1 else f"{name}/{term}"  # train/<student>/cls_loss
                    self._window[key] = self._window.get(key, 0) + value.detach().float()
        self._count += 1
        return total

    def train_metrics(self) -> dict[str, torch.Tensor]:
        window, count, self._window, self._count = self._window, self._count, {}, 0
        return {name: value / max(count, 1) for name, value in window.items()}

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
        module = self.teacher.module
        with ds_compat.gathered(module):
            yield lambda images: embedding(module.forward_features(images.float()), module)

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
                    self.teacher.module.forward_tokens(x).cls_token.float(), dim=-1), device, t_dtype,
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
        return sum(student_flops(backbone_kwargs(k), model_kwargs["teacher_dim"]) for k in students.values()) + teacher / 3

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


def student_flops(student: dict[str, Any], teacher_dim: int) -> float:
    """A student's forward FLOPs per image and its two projections' (multiply-adds x 2)."""
    h, w = pair(student["img_size"])
    if "timm_model" in student:
        width, grid = feature_grid(student["timm_model"], student["timm_kwargs"], (h, w))
        tokens = 1 + grid[0] * grid[1]
    else:
        width, tokens = student["embed_dim"], 1 + (h // student["patch_size"]) * (w // student["patch_size"])
    return backbone_flops(student) + 2 * 2 * tokens * width * teacher_dim  # two Linears
