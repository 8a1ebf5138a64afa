"""Features of an evaluation pass, each with its label, for a k-NN (knn.py) or a probe (linear.py).

    memory = extract(knn_loader, embed, device, dtype)      # the loop, for a pass that does nothing else
    val = Features(); val.add(embed(images), targets, valid)  # inside a pass that also does other work

Labels of padding and bad samples are -1 (an eval loader marks them with `valid`): every rank keeps the same
number of rows, and the k-NN leaves those out.

What a run's features are, for eval.sets, launch/evaluate.py and launch/embed.py alike: `embedding` of the
tokens after the final norm, the class token and the mean of the patch tokens side by side (DINOv2's linear
probe reads both; its k-NN the class token alone, `class_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Features:
    """The features of one pass (each batch's embedding, float32 on the device) and each row's label."""

    def __init__(self) -> None:
        self._feats: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []

    def add(self, feats: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> None:
        """One batch: its features (N, D) and the loader's targets and valid flags (labels -1 where not valid)."""
        device = feats.device
        self._feats.append(feats)
        self._labels.append(torch.where(valid.to(device), targets.to(device), -1))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(features (M, D), labels (M,)) of every batch added, in order."""
        return torch.cat(self._feats), torch.cat(self._labels)


def extract(loader: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
            embed: Callable[[torch.Tensor], torch.Tensor], device: torch.device, dtype: torch.dtype) -> Features:
    """`embed` of every batch of an eval loader (images moved to `device` in `dtype`). Collective where
    `embed` is (ZeRO-3): every rank's loader yields the same number of batches."""
    out = Features()
    for images, targets, valid in loader:
        out.add(embed(images.to(device, dtype, non_blocking=True)), targets, valid)
    return out


def embedding(tokens: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """(B, 2D) float32: the class token and the mean of the patch tokens of `tokens`, the output of `model`'s
    final norm (B, prefix + patches, D; timm's forward_features). A model that pools its patches
    (global_pool='avg', MAE's fine-tuning) has no final norm: its mean goes through fc_norm, as its head sees it."""
    pooled = tokens[:, model.num_prefix_tokens:].mean(1)
    if getattr(model, "global_pool", "token") == "avg" and hasattr(model, "fc_norm"):  # DINOv3ViT's avg: no fc_norm
        pooled = model.fc_norm(pooled)
    return torch.cat([tokens[:, 0], pooled], dim=1).float()


def class_tokens(features: torch.Tensor) -> torch.Tensor:
    """The L2-normalised class tokens of `embedding` rows: what the k-NN compares (cosine similarity)."""
    return F.normalize(features[:, :features.shape[1] // 2], dim=-1)


def gather_rows(feats: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's rows of an eval pass, in the split's order (rank r holds the r-th contiguous range, padded
    at its end: the padding and bad samples, label -1, are dropped). Collective where a group is up."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        out_f = [torch.empty_like(feats) for _ in range(dist.get_world_size())]
        out_l = [torch.empty_like(labels) for _ in range(dist.get_world_size())]
        dist.all_gather(out_f, feats.contiguous())
        dist.all_gather(out_l, labels.contiguous())
        feats, labels = torch.cat(out_f), torch.cat(out_l)
    keep = labels >= 0
    return feats[keep], labels[keep]
