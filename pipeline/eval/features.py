"""Features of an evaluation pass, each with its label, for a k-NN (knn.py) or a probe.

    memory = extract(knn_loader, embed, device, dtype)      # the loop, for a pass that does nothing else
    val = Features(); val.add(embed(images), targets, valid)  # inside a pass that also does other work

Labels of padding and bad samples are -1 (an eval loader marks them with `valid`): every rank keeps the same
number of rows, and the k-NN leaves those out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


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
