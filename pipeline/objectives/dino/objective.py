"""DINOv2 (Oquab et al. 2023; issue 33): the objective `model.objective: dinov2`, with Meta's `SSLMetaArch` as
the reference. `DINOv2Model` (pipeline/model/dino.py: backbone + heads) is the student DeepSpeed trains and,
a second instance kept on the objective, the teacher (its EMA); each sample's multi-crop view and iBOT masks
are drawn in the loader workers from the sample's seed (view.py); the losses are Meta's (loss/); the k-NN
and PCA evaluation of the teacher is evaluate.py. docs/dino.md has the recipe and what differs from Meta's
loop.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.config import Config, ConfigError
from pipeline.data import label_free
from pipeline.data.multicrop import MultiCropConfig
from pipeline.dist import DistEnv, is_rank0
from pipeline.eval.features import embedding
from pipeline.eval.knn import knn_loaders
from pipeline.model.dino import HEAD_KEYS, DINOv2Model, backbone_state
from pipeline.model.vit import architecture, model_kwargs_from_config
from pipeline.objectives.adapt import backbone_lr_schedule, wants_roles
from pipeline.objectives.base import EvalResult, Objective, TrainView
from pipeline.objectives.dino.anchor import source_anchor
from pipeline.objectives.dino.collapse import CollapseMonitor, Figures, write_warning
from pipeline.objectives.dino.cost import flops_per_image
from pipeline.objectives.dino.evaluate import evaluate_teacher
from pipeline.objectives.dino.loss import DINOLoss, KoLeoLoss, iBOTPatchLoss
from pipeline.objectives.dino.masked import mask_bound, masked_rows, masked_weights
from pipeline.objectives.dino.targets import sinkhorn_knopp_targets
from pipeline.objectives.dino.view import MultiCropView, Views, crop_major
from pipeline.train import ds_compat
from pipeline.train.checkpoint import CheckpointError, checkpoint_dir, read_client_state
from pipeline.train.ema import Ema


def _cosine(step: int, total: int, start: float, end: float) -> float:
    """Meta's CosineScheduler without warm-up: `start` at step 0 toward `end` at step `total`."""
    return end + 0.5 * (start - end) * (1 + math.cos(math.pi * min(step, total) / max(total, 1)))


def dinov2_model_kwargs(cfg: Config, section: str = "dino") -> dict[str, Any]:
    """`DINOv2Model` arguments: the backbone from model.* (as a supervised ViT, no classifier, any input
    size for the local crops) and the heads from the recipe's section (dino.*; DINOv3's dinov3.*)."""
    d = getattr(cfg, section)
    vit = model_kwargs_from_config(cfg.model, 0)
    patch, img = vit["patch_size"], vit["img_size"]
    size = img if isinstance(img, int) else img[0]
    if not isinstance(img, int) and img[0] != img[1]:
        raise ConfigError(f"model.img_size={list(img)}: self-distillation's global crops are square; give one side")
    if size % patch or d.local_crops_size % patch:
        raise ConfigError(f"model.img_size ({size}) and {section}.local_crops_size ({d.local_crops_size}) must be "
                          f"multiples of the patch size ({patch}): the crops are cut into whole patches")
    if "rope_temperature" not in vit:  # a RoPE backbone takes any grid without being told
        vit.update(dynamic_img_size=True)
    vit.update(num_classes=0)
    return {**vit, **{k: getattr(d, k) for k in HEAD_KEYS}}


class DINOv2(Objective):
    """DINOv2 self-distillation (Oquab et al. 2023, Meta's `SSLMetaArch`): the student is the model DeepSpeed
    trains; the teacher, an EMA of it (momentum cosine from dino.momentum_teacher to 1 over train.steps),
    built beside it and kept here, gives the targets: DINO on the class tokens of 2 global and n local
    crops, iBOT on the masked patches of the global crops, KoLeo on the student's global class tokens.
    The teacher is what is evaluated (k-NN of its class token, PCA of its patch features, the collapse
    figures of collapse.py) and exported.

    Layout-free, as every guarantee asks: crops and masks come from each sample's seed; the centres move once
    per optimizer step from the teacher outputs of the whole global batch (sums all-reduced in `after_step`;
    Meta, without gradient accumulation, does the same per iteration); KoLeo's neighbours are those of the
    micro batch (the same samples on any layout with the same micro batch size); Sinkhorn-Knopp normalises
    over the step's global batch, with accumulation too (`begin_step`, targets.py).

    DINOv3 (pipeline/objectives/dinov3/) is this recipe on another backbone with more terms: it reads its own
    section (`section`), and extends `views` and `loss_terms`.
    """

    model_class = DINOv2Model
    section = "dino"  # the config section the recipe reads (DINOv3: dinov3)
    anchors_source = True  # adapt.anchor: the Gram loss against the source (anchor.py); DINOv3's is its Gram term
    # What each entry of the collapse monitor's sums since the last evaluation is (_entropy).
    SINCE = ("entropy", "micro_batches", "loss", "batch_entropy", "steps")

    def __init__(self, cfg: Config, info: Any):
        super().__init__(cfg, info)
        d = self.d
        self.teacher: DINOv2Model | None = None
        self.teacher_ema: Ema | None = None  # the teacher's update (built with it, in build_companions)
        self.dino_loss = DINOLoss(d.head_n_prototypes, student_temp=d.student_temp)
        self.ibot_loss = iBOTPatchLoss(d.ibot_head_n_prototypes if d.ibot_separate_head else d.head_n_prototypes,
                                       student_temp=d.student_temp)
        self.koleo_loss = KoLeoLoss()
        self.step = 0  # optimizer steps done (the schedules' position)
        self._sums: dict[str, torch.Tensor] = {}  # this step's teacher outputs for the centres: sum, count
        self._ahead: dict[int, tuple] = {}  # begin_step's views and targets per micro batch, by its first tensor
        self._window: torch.Tensor | None = None  # train_metrics: per-term sums on the device since the last log
        self._window_names: list[str] = []  # what each entry of _window is (its last: the micro batch count)
        # The collapse monitor's sums since the last evaluation, on the device (SINCE says which entry is
        # which; collapse.py). Rank 0 holds a resumed run's saved sums (state_dict all-reduces them).
        self._entropy: torch.Tensor | None = None
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")  # the engine's (before_step says): where collectives of the objective's own run
        self.collapse = CollapseMonitor(d.head_n_prototypes, d.collapse_evals, d.collapse_tolerance,
                                        d.collapse_stall_fraction, self.section)
        self.val_loader: Any = None  # the evaluation's loaders (build_eval)
        self.knn_loader: Any = None

    @property
    def d(self) -> Any:
        """The recipe's config section (dino.*)."""
        return getattr(self.cfg, self.section)

    # -- the models
    def model_kwargs(self) -> dict[str, Any]:
        return dinov2_model_kwargs(self.cfg, self.section)

    def build_model(self, model_kwargs: dict[str, Any]) -> nn.Module:
        return self.model_class(**model_kwargs, patch_embed_lr_mult=self.d.patch_embed_lr_mult,
                                fresh_roles=wants_roles(self.cfg))  # adapt.*: the heads' groups apart

    def build_companions(self, model: nn.Module, model_kwargs: dict[str, Any],
                         init: Callable[[], AbstractContextManager[Any]]) -> None:
        # The teacher: no stochastic depth (Meta's), never trained; float32 whatever the student's dtype (an
        # EMA at momentum 0.992-1 in bf16 would round most updates away; Meta's FSDP teacher keeps fp32
        # shards too), under ZeRO-3 partitioned as the student, so that its EMA runs on each rank's shard.
        with init():
            self.teacher = self.model_class(**{**model_kwargs, "drop_path_rate": 0.0})
        self.teacher.requires_grad_(False)
        self.teacher.eval()
        # Meta's update (teacher x m + student x (1 - m)) of the parameters, on each rank's own partitions at
        # ZeRO-3: the machinery of train.ema_decay's model EMA (pipeline/train/ema.py).
        self.teacher_ema = Ema(self.teacher, "scale_add", buffers=False)
        self.teacher_ema.update(model, 0.0)  # the teacher starts as the student
        self.anchor = source_anchor(self.cfg, self.model_class, model_kwargs, init) if self.anchors_source else None

    # -- the data
    def train_view(self, model_kwargs: dict[str, Any]) -> TrainView:
        # No labels read (DINOv2 trains on unlabelled shards); each sample's crops and masks in the workers.
        return TrainView(label_free(self.cfg.data), sample=self.multicrop_view(model_kwargs))

    def crop_config(self, model_kwargs: dict[str, Any], **overrides: Any) -> MultiCropConfig:
        """The section's crop settings under MultiCropConfig's names; the global crop's size is the model's,
        the normalisation the data's."""
        d, data = self.d, self.cfg.data
        img = model_kwargs["img_size"]
        shared = {f.name: (tuple(v) if isinstance(v := getattr(d, f.name), list) else v)
                  for f in dataclasses.fields(MultiCropConfig) if hasattr(d, f.name)}
        return MultiCropConfig(**{**shared, "global_crops_size": img if isinstance(img, int) else img[0],
                                  "mean": tuple(data.mean), "std": tuple(data.std), **overrides})

    def multicrop_view(self, model_kwargs: dict[str, Any]) -> MultiCropView:
        crops, patch = self.crop_config(model_kwargs), model_kwargs["patch_size"]
        side = crops.global_crops_size // patch
        return MultiCropView(crops, (side, side), self.d.mask_probability, tuple(self.d.mask_ratio))

    def build_eval(self, env: DistEnv, img_size: tuple[int, int], batch: int) -> list[Any]:
        self.val_loader, self.knn_loader = knn_loaders(self.cfg.data, self.info, env, img_size, batch,
                                                       self.d.knn_k, self.d.knn_train_samples)
        return [x for x in (self.val_loader, self.knn_loader) if x is not None]

    # -- the schedules
    def teacher_temp(self, step: int) -> float:
        d = self.d
        if step >= d.teacher_temp_warmup_steps:
            return d.teacher_temp
        return d.warmup_teacher_temp + (d.teacher_temp - d.warmup_teacher_temp) * step / d.teacher_temp_warmup_steps

    def momentum(self, step: int) -> float:
        d = self.d
        return _cosine(step, self.cfg.train.steps, d.momentum_teacher, d.final_momentum_teacher)

    def weight_decay(self, step: int) -> float:
        return _cosine(step, self.cfg.train.steps, self.cfg.train.weight_decay, self.d.weight_decay_end)

    @torch.no_grad()
    def before_step(self, engine: Any, step: int) -> None:
        """Before each optimizer step (also the first after a resume, whose restored optimizer carries
        train.weight_decay): the step's weight decay into every decayed parameter group (Meta's
        `apply_optim_scheduler`: wd x wd_multiplier, 0 or 1), lr 0 for the prototypes' groups (role
        `last_layer`) during the first dino.freeze_last_layer_steps (Meta's last_layer_lr schedule: gradients
        are computed, count in the clipping norm and fill AdamW's moments; with lr 0 neither the step nor the
        decoupled decay moves the weights), the teacher and the loss centres on the engine's device. The lr
        needs no restoring after the freeze: the trainer's schedule sets every group's lr after each
        optimizer step, before the next `before_step`. adapt.*'s backbone warm-up is the same mechanism."""
        wd = self.weight_decay(step)
        frozen = step < self.d.freeze_last_layer_steps
        for group in engine.optimizer.param_groups:
            if group.get("decay", group.get("weight_decay", 0.0) > 0):
                group["weight_decay"] = wd
            if frozen and group.get("role") == "last_layer":
                group["lr"] = 0.0
        backbone_lr_schedule(engine.optimizer.param_groups, self.cfg.adapt, step)
        self.device = device = engine.device
        self.teacher_ema.to(device)
        for loss in (self.dino_loss, self.ibot_loss):
            loss.to(device)
        if self.anchor is not None:
            self.anchor.before_step(step, self.teacher.backbone, device)

    def _accumulate(self, name: str, outputs: torch.Tensor, valid: torch.Tensor | None = None,
                    extra: torch.Tensor | None = None) -> None:
        """This micro batch's teacher outputs (the rows `valid` says) toward the step's centre update (sum,
        count); `extra`, a sum over the same rows, goes between them, all-reduced with them (the DINO
        targets' sum, for the collapse monitor's batch entropy: no collective of its own)."""
        w = outputs.new_ones(outputs.shape[0], dtype=torch.float64) if valid is None else valid.double()
        extra_sum = [] if extra is None else [extra.double()]
        total = torch.cat([(outputs.double() * w[:, None]).sum(0), *extra_sum, w.sum().reshape(1)])
        self._sums[name] = self._sums[name] + total if name in self._sums else total

    # -- a step
    def views(self, images: Any) -> Views:
        """The loader's per-sample stacks (the view's parts) as the models take them."""
        global_crops, local_crops, masks = images[:3]
        n_local = local_crops.shape[1]
        return Views(crop_major(global_crops), crop_major(local_crops) if n_local else None,
                     crop_major(masks) if self.d.ibot_loss_weight > 0 else None, global_crops.shape[0], n_local)

    @torch.no_grad()
    def teacher_outputs(self, engine: Any, views: Views) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The teacher's DINO head outputs of the global crops (the two crops of an image swapped) and its
        patch head outputs of the masked patches, float32."""
        teacher_dtype = next(self.teacher.parameters()).dtype
        crops = views.global_crops
        with ds_compat.gathered(self.teacher), torch.autocast(engine.device.type, dtype=crops.dtype,
                                                              enabled=engine.device.type == "cuda"
                                                              and crops.dtype != teacher_dtype):
            t_cls, t_masked = self.teacher.teacher_forward(crops.to(teacher_dtype), views.masks, views.mask_indices)
        return t_cls.float(), (t_masked.float() if t_masked is not None else None)

    def masked_views(self, images: Any) -> Views:
        """`views` with the masked patches' rows (a gather of a fixed size: no host read, masked.py)."""
        views = self.views(images)
        if views.masks is not None:
            bound = mask_bound(views.masks, self.d.mask_probability, self.d.mask_ratio)
            views.mask_indices, views.mask_valid = masked_rows(views.masks, bound)
        return views

    def targets(self, t_cls: torch.Tensor, t_masked: torch.Tensor | None, views: Views,
                temp: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One micro batch's DINO and iBOT targets: centred, or by Sinkhorn-Knopp over the micro batch's round."""
        if self.d.centering != "centering":
            return sinkhorn_knopp_targets(self.dino_loss, self.ibot_loss, [t_cls], [t_masked], [views], temp)[0]
        t_dino = self.dino_loss.softmax_center_teacher(t_cls, temp)
        self._accumulate("dino", t_cls, extra=t_dino.sum(0))
        if t_masked is not None:
            self._accumulate("ibot", t_masked, views.mask_valid)
        return t_dino, None if t_masked is None else \
            self.ibot_loss.softmax_center_teacher(t_masked.unsqueeze(0), temp).squeeze(0)

    def step_targets(self) -> bool:  # Sinkhorn-Knopp: over the step's global batch (targets.py)
        return self.d.centering != "centering"

    def begin_step(self, engine: Any, micro_batches: list[Any]) -> None:
        """With accumulation, Sinkhorn-Knopp's targets of every micro batch of the step normalised together
        (targets.py), kept with its views for `loss` by its first tensor (one the guard skips is not asked for)."""
        views = [self.masked_views(images) for images in micro_batches]
        outputs = [self.teacher_outputs(engine, v) for v in views]
        targets = sinkhorn_knopp_targets(self.dino_loss, self.ibot_loss, [o[0] for o in outputs],
                                         [o[1] for o in outputs], views, self.teacher_temp(self.step))
        self._ahead = {id(images[0]): (v, *t) for images, v, t in zip(micro_batches, views, targets)}

    def loss(self, engine: Any, images: Any, targets: torch.Tensor, extras: torch.Tensor | None) -> torch.Tensor:  # noqa: ARG002 - the interface
        ahead = self._ahead.pop(id(images[0]), None)  # begin_step's views and targets of this micro batch
        views = ahead[0] if ahead is not None else self.masked_views(images)
        t_dino, t_ibot = ahead[1:] if ahead is not None else \
            self.targets(*self.teacher_outputs(engine, views), views, self.teacher_temp(self.step))
        t_dino = t_dino.view(2, views.batch, -1)
        out = engine(views.global_crops, views.local_crops, views.masks, mask_indices=views.mask_indices,
                     **views.student)
        losses = self.loss_terms(engine, views, out, t_dino, t_ibot)
        total = sum(losses.values())
        self._log_terms(losses, t_dino, total)
        return total

    def loss_terms(self, engine: Any, views: Views, out: dict[str, torch.Tensor], t_dino: torch.Tensor,  # noqa: ARG002 - DINOv3's Gram term runs its teacher
                   t_ibot: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Each term of the loss, weighted as it is added (they sum to it), named as in Meta's loss_dict."""
        d, n_local = self.d, views.n_local
        terms = 2 + 2 * n_local  # (student crop, teacher crop) pairs: global-global (not the same crop) and local
        losses: dict[str, torch.Tensor] = {}
        # Every crop's class tokens in one pass (the head's outputs come as one tensor), not a call per crop.
        global_loss, local_loss = self.dino_loss.crops_losses(out["cls"], t_dino)
        if n_local:
            losses["dino_local_crops_loss"] = d.dino_loss_weight * local_loss / terms
        losses["dino_global_crops_loss"] = d.dino_loss_weight * global_loss / terms
        if d.koleo_loss_weight > 0:  # not between the two crops of one image: each crop's batch apart, batched
            losses["koleo_loss"] = d.koleo_loss_weight * self.koleo_loss(
                out["global_cls"].float().view(2, views.batch, -1)).sum()
        if views.masks is not None:
            valid = views.mask_valid
            weights = None if valid is None else masked_weights(views.masks, views.mask_indices, valid)
            # Meta's scale: x2 (the global crops together) x 1/2 (per global crop) = 1.
            losses["ibot_loss"] = d.ibot_loss_weight * self.ibot_loss.forward_masked(
                out["masked"].float(), t_ibot, views.masks, masks_weight=weights)
        if self.anchor is not None:
            losses["gram_loss"] = self.anchor.term(views.global_crops, out["global_patch"])
        return losses

    @torch.no_grad()
    def _log_terms(self, losses: dict[str, torch.Tensor], t_dino: torch.Tensor, total: torch.Tensor) -> None:
        """Adds this micro batch's terms to the log window, on the device (no sync), unless its loss is not
        finite (the trainer skips such a micro batch). Names as in Meta's loss_dict, each weighted as it is
        added to the loss, so that they sum to it (Meta logs ibot_loss at half of what it adds). The
        entropy of the teacher's DINO targets watches for collapse: log(K prototypes) when they are uniform
        (the centre has caught up with outputs that no longer differ between images), near 0 when every
        image gets one prototype; it is summed for the collapse monitor too (collapse.py)."""
        self._window_names = [*losses, "dino_teacher_entropy"]
        # One vector per micro batch (the terms, the entropy, a count of 1), zeroed when the loss is not
        # finite: a few kernels per micro batch, whatever the number of terms.
        entropy = torch.special.entr(t_dino).sum(-1).mean()
        values = torch.stack([*(v.float() for v in losses.values()), entropy, torch.ones_like(total)])
        values = torch.where(torch.isfinite(total), values, 0.0)
        self._window = values if self._window is None else self._window + values
        # (entropy, 1, loss, 0, 0), or zeros: the loss is the terms' sum, as the trainer's
        self._add_since(torch.cat([values[-2:], values[:-2].sum().reshape(1), values.new_zeros(2)]))

    def _add_since(self, values: torch.Tensor) -> None:
        values = values.double()
        self._entropy = values if self._entropy is None else self._entropy.to(values.device) + values

    def train_metrics(self) -> dict[str, torch.Tensor]:
        if self._window is None:
            return {}
        sums, self._window = self._window, None
        means = sums[:-1] / sums[-1].clamp_min(1)  # the last entry counts the finite micro batches
        return dict(zip(self._window_names, means.unbind()))

    @torch.no_grad()
    def after_step(self, engine: Any, step: int) -> None:
        self._ahead = {}  # begin_step's targets of micro batches the guard skipped
        # The centres move once per step, from the whole global batch's teacher outputs (layout-free).
        for name, loss in (("dino", self.dino_loss), ("ibot", self.ibot_loss)):
            if name not in self._sums:
                continue
            total = self._sums.pop(name)
            if dist.is_initialized():
                dist.all_reduce(total)
            # Unmoved when nothing was counted (no masked patch in the step), decided on the device: no read.
            k = loss.center.numel()
            batch_center = (total[:k] / total[-1].clamp(min=1.0)).float().view_as(loss.center)
            if len(total) > k + 1:  # the DINO targets' sum too (centring): the global batch's mean target
                h = torch.special.entr(total[k:-1] / total[-1].clamp(min=1.0)).sum()
                counted = torch.isfinite(h) & (total[-1] > 0)
                self._add_since(torch.where(counted, torch.stack([*h.new_zeros(3), h, h.new_ones(())]), 0.0))
            moved = loss.center * loss.center_momentum + batch_center * (1 - loss.center_momentum)
            loss.center = torch.where(total[-1] > 0, moved, loss.center)
        self.teacher_ema.update(engine.module, self.momentum(step - 1))  # the momentum of the step just taken
        self.step = step

    # -- evaluation, cost, state
    def _entropy_sum(self, device: torch.device) -> torch.Tensor:
        """The collapse monitor's sums since the last evaluation (SINCE) over every rank (collective); forgets them."""
        since = (self._entropy if self._entropy is not None else
                 torch.zeros(len(self.SINCE), dtype=torch.float64)).to(device)
        if dist.is_initialized():
            dist.all_reduce(since)
        self._entropy = None
        return since

    @torch.no_grad()
    def evaluate(self, engine: Any, dtype: torch.dtype, run_dir: Path | None, step: int) -> EvalResult:  # noqa: ARG002 - the interface (the teacher's own dtype)
        metrics, image = evaluate_teacher(self.teacher, self.val_loader, self.knn_loader, self.cfg, engine.device,
                                          run_dir, step, self.d)
        sums = dict(zip(self.SINCE, self._entropy_sum(engine.device).tolist()))  # one read
        figures = Figures.of_sums(sums, metrics["eval/effective_rank"], self.teacher.backbone.embed_dim)
        if figures.entropy is not None:
            metrics["eval/teacher_entropy"] = figures.entropy
        if figures.batch_entropy is not None:
            metrics["eval/teacher_batch_entropy"] = figures.batch_entropy
        warning = self.collapse.update(figures)  # said once per episode; the metric says it is on
        metrics["eval/collapse_warning"] = float(self.collapse.active)
        knn = f" | k-NN top-1 {100 * metrics['eval/knn_top1']:.2f}%" if "eval/knn_top1" in metrics else ""
        line = (f"eval step {step} | teacher{knn or ': no labels, no k-NN'} | effective rank "
                f"{metrics['eval/effective_rank']:.2f}")
        artifacts = [(image, "pca")] if image is not None else []
        if warning is not None:
            line += f"\nwarning: {warning}"
            if run_dir is not None:
                artifacts.append((write_warning(run_dir, step, warning), "warnings"))
        return EvalResult(metrics, line, artifacts)

    @contextmanager
    def features(self, engine: Any) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:  # noqa: ARG002 - the interface (the teacher, not the engine)
        """The teacher's backbone (what is exported), gathered once under ZeRO-3 (it has no hooks), float32."""
        backbone = self.teacher.backbone
        with ds_compat.gathered(self.teacher):
            yield lambda images: embedding(backbone.forward_features(images.float()), backbone)

    def flops_per_image(self, model_kwargs: dict[str, Any], local_size: int | None = None) -> float:  # cost.py
        return flops_per_image(self.d, model_kwargs, local_size, self.anchors_source and self.cfg.adapt.anchor > 0)

    def exported_weights(self, engine: Any) -> dict[str, torch.Tensor]:  # noqa: ARG002 - the interface (the teacher, not the engine)
        """The teacher's backbone, in `VisionTransformer`'s (timm's) names: what fine-tuning starts from."""
        return backbone_state(self._teacher_state())

    @classmethod
    def exported_architecture(cls, model_kwargs: dict[str, Any]) -> dict[str, Any]:
        """The backbone's: a `VisionTransformer` without a classifier, with the mask token."""
        return architecture(cls.model_class.backbone_class, {**model_kwargs, "num_classes": 0, "mask_token": True})

    checkpoint_weights = "the teacher's backbone"

    @classmethod
    def weights_from_checkpoint(cls, run_dir: Path, tag: str, cfg: Config) -> dict[str, torch.Tensor]:
        """The teacher's backbone saved in checkpoint `tag`: the tensors `exported_weights` gives at that step.
        The checkpoint holds the teacher whole on every ZeRO stage (`state_dict` gathers it before the save),
        so no partitions are reassembled here; DeepSpeed's module in the tag is the student."""
        objective = read_client_state(run_dir, tag).get("objective") or {}
        if "teacher" not in objective:
            raise CheckpointError(f"{checkpoint_dir(run_dir) / tag}: its client state has no {cls.__name__} teacher "
                                  f"(objective.teacher), though {run_dir / 'config.yaml'} says "
                                  f"model.objective={cfg.model.objective}")
        return backbone_state(objective["teacher"])

    def _teacher_state(self) -> dict[str, torch.Tensor]:
        """The teacher's full fp32 state dict on the CPU (collective under ZeRO-3)."""
        return self.teacher_ema.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """Collective (every rank: the teacher is gathered, the entropy sum all-reduced); rank 0's is saved."""
        entropy = self._entropy_sum(self.device)
        self._entropy = entropy.cpu() if is_rank0() else None  # the sum goes on, held by rank 0
        return {"step": self.step, "teacher": self._teacher_state(), "dino_center": self.dino_loss.center.cpu(),
                "ibot_center": self.ibot_loss.center.cpu(), "collapse": self.collapse.state_dict(),
                "entropy_since_eval": entropy.cpu(), **(self.anchor.state_dict() if self.anchor else {})}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            raise ValueError(f"the checkpoint holds no {type(self).__name__} state (teacher, centres): it was not "
                             f"written by a model.objective={self.cfg.model.objective} run")
        self.step = int(state["step"])
        self.teacher_ema.load_state_dict(state["teacher"])
        self.dino_loss.center = state["dino_center"].clone()
        self.ibot_loss.center = state["ibot_center"].clone()
        self.collapse.load_state_dict(state.get("collapse"))  # absent from a checkpoint written before it
        if self.anchor is not None:
            self.anchor.load_state_dict(state, self._source_reader())
        since = state.get("entropy_since_eval")
        if since is not None and len(since) == 2:  # written before the loss and batch entropy: the loss unknown
            since = torch.cat([since.double(), torch.tensor([math.nan, 0.0, 0.0], dtype=torch.float64)])
        self._entropy = since.clone() if since is not None and is_rank0() else None  # summed once over the ranks
