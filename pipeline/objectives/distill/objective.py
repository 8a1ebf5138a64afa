"""Feature distillation (`model.objective: distill`): a frozen teacher read from any source (teacher.py) teaches
the student (model.*, student.py) through its features: the student's class token and patch tokens, each
through a learned Linear to the teacher's width, regressed onto the teacher's (loss.py), the teacher's patch
grid resized to the student's. Both see the same augmented view of each image (the train transform: "consistent"
teaching, Beyer et al. 2022). The student's backbone is the run's product (model.safetensors), read back as any
ViT of model.variant (distill_config.RECIPE). docs/distill.md has the recipe and what is tested.
"""

from __future__ import annotations

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
from pipeline.objectives.base import EvalResult, Objective, TrainView
from pipeline.objectives.distill.loss import FeatureLoss
from pipeline.objectives.distill.student import DistillStudent, backbone_kwargs, exported, student_class
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
        student = self.d.students[0] if self.d.students else None
        if student is not None and student.timm:
            kwargs = self.timm_student(student.timm, student.kwargs)
        else:
            kwargs = model_kwargs_from_config(self.cfg.model, 0)
            kwargs["num_classes"] = 0  # the student is a backbone: its head is fitted by whoever uses it
            self.student_grid = tuple(s // kwargs["patch_size"] for s in pair(kwargs["img_size"]))
        self.model_class = student_class(kwargs)  # what a resume compares (its ARCH_KEYS)
        self.student_kwargs = {**kwargs, "teacher_dim": self.read_teacher().model.embed_dim}  # extra_exports' metadata
        return self.student_kwargs

    def timm_student(self, name: str, timm_kwargs: dict[str, Any]) -> dict[str, Any]:
        """A timm student's arguments (TimmBackbone's), its feature map's grid found from its shapes alone: the
        teacher's patch grid is resized to it, which needs the two grids of one shape (a map of another aspect
        than the teacher's grid would be stretched onto it: a stride that does not divide model.img_size)."""
        img, patch = pair(self.cfg.model.img_size), self.read_teacher().model.patch_embed.patch_size[0]
        try:
            _, grid = feature_grid(name, timm_kwargs, img)
        except TimmBackboneError as e:
            raise ConfigError(f"distill.students[0].timm: {e}") from None
        teacher = (img[0] // patch, img[1] // patch)
        if grid[0] * teacher[1] != grid[1] * teacher[0]:
            raise ConfigError(f"distill.students[0]: timm's {name!r} gives a {grid[0]}x{grid[1]} feature map at "
                              f"model.img_size={list(img)}, the teacher a {teacher[0]}x{teacher[1]} patch grid: "
                              f"they cannot be aligned (another shape); give a model.img_size the student's "
                              f"stride divides")
        self.student_grid = grid
        return {"timm_model": name, "timm_kwargs": dict(timm_kwargs), "img_size": img}

    def build_model(self, model_kwargs: dict[str, Any]) -> nn.Module:
        return DistillStudent(**model_kwargs)

    def build_companions(self, model: nn.Module, model_kwargs: dict[str, Any],  # noqa: ARG002 - the interface
                         init: Callable[[], AbstractContextManager[Any]]) -> None:
        side = pair(model_kwargs["img_size"])
        with reading_source(f"distill.teacher={self.d.teacher}"):
            self.teacher = Teacher(self.read_teacher(), self.d.teacher, side, init)
        self.found = None  # its weights are in the teacher now
        say(f"distill: teacher {self.teacher.source} (width {self.teacher.dim}, patch {self.teacher.patch}, "
            f"sha256 {self.teacher.digest[:12]})")

    @classmethod
    def exported_architecture(cls, model_kwargs: dict[str, Any]) -> dict[str, Any]:
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
        t_cls, t_patches = self.teacher.tokens(images, self.student_grid, self.d.resize_method, low)
        self.teacher_forwards += 1
        s_cls, s_patches = engine(images)
        terms = self.feature_loss(s_cls, s_patches, t_cls, t_patches)
        total = sum(terms.values())
        with torch.no_grad():
            for name, value in terms.items():
                self._window[name] = self._window.get(name, 0) + value.detach().float()
            self._count += 1
        return total

    def train_metrics(self) -> dict[str, torch.Tensor]:
        window, count, self._window, self._count = self._window, self._count, {}, 0
        return {name: value / max(count, 1) for name, value in window.items()}

    # -- evaluation
    @contextmanager
    def features(self, engine: Any) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        """The student backbone's (what it exports), eval mode."""
        model = engine.module if hasattr(engine, "module") else engine
        dtype, was = next(model.parameters()).dtype, model.training
        model.eval()
        try:
            yield lambda images: embedding(engine(images.to(dtype), features=True), model.backbone)
        finally:
            model.train(was)

    @torch.no_grad()
    def evaluate(self, engine: Any, dtype: torch.dtype, run_dir: Path | None, step: int) -> EvalResult:  # noqa: ARG002 - the interface
        """The student's k-NN top-1 (its L2-normalised class token), and at the first evaluation of the
        process the teacher's, the figure the student reads against."""
        device = engine.device
        with self.features(engine) as student:
            metrics = self._knn(lambda x: class_tokens(student(x)), device, dtype, "eval/knn_top1")
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
        """The student's forward and its projections, plus the teacher's forward (forward only: a third, as
        MFU counts each image's FLOPs 3x)."""
        student = backbone_kwargs(model_kwargs)
        h, w = pair(student["img_size"])
        if "timm_model" in student:  # a timm model: counted by torch's FLOP counter on the meta device
            width, grid = feature_grid(student["timm_model"], student["timm_kwargs"], (h, w))
            tokens, own = 1 + grid[0] * grid[1], timm_flops(student["timm_model"], student["timm_kwargs"], (h, w))
        else:
            width, own = student["embed_dim"], model_flops(student)
            tokens = 1 + (h // student["patch_size"]) * (w // student["patch_size"])
        proj = 2 * 2 * tokens * width * model_kwargs["teacher_dim"]  # two Linears, multiply-adds x 2
        teacher = model_flops(self.teacher.flops_kwargs) if self.teacher is not None else 0.0
        return own + proj + teacher / 3

    def exported_weights(self, engine: Any) -> dict[str, torch.Tensor]:
        return exported(full_fp32_state_dict(engine))

    def extra_exports(self, engine: Any) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]]:
        """A student named in distill.students: its export again at students/<name>/model.safetensors."""
        if not self.d.students:
            return {}
        arch = self.exported_architecture(self.student_kwargs)
        return {f"students/{self.d.students[0].name}/model.safetensors": (
            self.exported_weights(engine), {k: str(v) for k, v in arch.items()})}

    checkpoint_weights = "the student's backbone (DeepSpeed's, consolidated to fp32)"

    @classmethod
    def weights_from_checkpoint(cls, run_dir: Path, tag: str, cfg: Config) -> dict[str, torch.Tensor]:  # noqa: ARG003 - the interface
        return exported(consolidate(run_dir, tag))

    def state_dict(self) -> dict[str, Any]:
        return {"teacher_digest": self.teacher.digest, "teacher_source": self.teacher.source}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "teacher_digest" in state and state["teacher_digest"] != self.teacher.digest:
            raise WeightsError(f"distill.teacher={self.d.teacher}: the checkpoint was distilled from another teacher "
                               f"({state.get('teacher_source')}, sha256 {state['teacher_digest'][:12]}; this one "
                               f"{self.teacher.digest[:12]}): give that teacher, or start a new run.dir")
