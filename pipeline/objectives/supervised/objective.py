"""Supervised classification: the ViT paper's pretraining and every fine-tuning run.

Cross-entropy on the labels (soft targets under Mixup/CutMix), top-1/top-5 and loss over the whole
validation split. The model is `VisionTransformer`, or `DINOv3ViT` for a DINOv3 variant (`dinov3.backbone_class`
tells them by their arguments); its FLOPs are that class's (`variants.model_flops` counts either).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline.data import DataError, build_eval_loader, raise_if_any_failed
from pipeline.dist import DistEnv
from pipeline.model.dinov3 import backbone_class, build_backbone
from pipeline.model.variants import model_flops, model_kwargs_from_config
from pipeline.model.vit import VisionTransformer, architecture
from pipeline.objectives.base import EvalResult, Objective
from pipeline.train.metrics import topk_correct


def loss_fn(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    if targets.ndim == 2:  # Mixup/CutMix soft targets (already smoothed)
        return torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()
    return F.cross_entropy(logits, targets, label_smoothing=label_smoothing)


class Supervised(Objective):
    model_class = VisionTransformer

    def model_kwargs(self) -> dict[str, Any]:
        cfg, info = self.cfg, self.info
        if info.num_classes == 0:
            fix = ("a fine-tune trains on labels: pass data.path=LABELLED_SHARDS" if cfg.run.kind == "finetune" else
                   "supervised training needs them: pretrain on them with model.objective=mae, or write labelled "
                   "shards")
            raise DataError(f"{info.path}: the shards have no labels (dataset.json: num_classes 0); {fix}")
        kwargs = model_kwargs_from_config(cfg.model, info.num_classes)
        if kwargs["num_classes"] != info.num_classes:
            raise DataError(f"model.num_classes={kwargs['num_classes']} but {info.path} has "
                            f"{info.num_classes} classes")
        # The class these arguments build, whose ARCH_KEYS a resume compares (a DINOv3 ViT's name its RoPE).
        self.model_class = backbone_class(kwargs)
        return kwargs

    def build_model(self, model_kwargs: dict[str, Any]) -> torch.nn.Module:
        return build_backbone(model_kwargs)  # VisionTransformer, or DINOv3ViT for a DINOv3 variant

    @classmethod
    def exported_architecture(cls, model_kwargs: dict[str, Any]) -> dict[str, Any]:
        return architecture(backbone_class(model_kwargs), model_kwargs)

    def build_eval(self, env: DistEnv, img_size: tuple[int, int], batch: int) -> list[Any]:
        self.val_loader = build_eval_loader(self.cfg.data, img_size, batch, rank=env.rank,
                                            world_size=env.world_size, info=self.info)
        return [self.val_loader]

    def loss(self, engine: Any, images: torch.Tensor, targets: torch.Tensor,
             extras: torch.Tensor | None) -> torch.Tensor:  # noqa: ARG002 - the interface
        return loss_fn(engine(images).float(), targets, self.cfg.data.label_smoothing)

    @torch.no_grad()
    def evaluate(self, engine: Any, dtype: torch.dtype, run_dir: Path | None, step: int) -> EvalResult:  # noqa: ARG002 - the interface (no figures)
        """Loss, top-1, top-5 over the whole validation split; padded samples are masked out."""
        engine.eval()
        device = engine.device
        totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, top-1 hits, top-5 hits, count
        for images, targets, valid in self.val_loader:
            logits = engine(images.to(device, dtype, non_blocking=True)).float()
            targets, valid = targets.to(device, non_blocking=True), valid.to(device, torch.float64)
            loss = F.cross_entropy(logits, targets, reduction="none").double()
            top1, top5 = topk_correct(logits, targets)
            totals += torch.stack([(loss * valid).sum(), (top1.double() * valid).sum(),
                                   (top5.double() * valid).sum(), valid.sum()])
        raise_if_any_failed(self.val_loader)  # collective: a pass that failed on one rank stops all of them here
        if dist.is_initialized():
            dist.all_reduce(totals)
        engine.train()
        n = max(totals[3].item(), 1.0)
        m = {"eval/loss": totals[0].item() / n, "eval/top1": totals[1].item() / n, "eval/top5": totals[2].item() / n,
             "eval/samples": totals[3].item()}
        return EvalResult(m, f"eval step {step} | loss {m['eval/loss']:.4f} | top-1 {100 * m['eval/top1']:.2f}% | "
                             f"top-5 {100 * m['eval/top5']:.2f}%")

    def flops_per_image(self, model_kwargs: dict[str, Any]) -> float:
        return model_flops(model_kwargs)
