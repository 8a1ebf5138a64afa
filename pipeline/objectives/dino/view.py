"""DINOv2's view of a training sample, drawn in the loader workers: the multi-crop (data/multicrop.py) and
each global crop's iBOT mask, every draw from the sample's augmentation seed; and a micro batch of them as the
student and the teacher take them (`Views`, `crop_major`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.data.multicrop import MultiCrop, MultiCropConfig, block_mask
from pipeline.data.order import IBOT_MASK, seed_for


class MultiCropView:
    """The DINOv2 objective's view of a training sample (`TrainView.sample`), in the loader workers:
    (global crops (2, C, G, G), local crops (n, C, L, L), iBOT masks (2, N) bool), every draw from the
    sample's augmentation seed (the crops by `MultiCrop`, each global crop's mask by `block_mask` seeded
    with (IBOT_MASK, seed, crop)), so the same on any layout. Picklable (it travels to the workers)."""

    def __init__(self, crops: MultiCropConfig, grid: tuple[int, int], mask_probability: float,
                 mask_ratio: tuple[float, float]) -> None:
        self.multicrop = MultiCrop(crops)
        self.grid, self.mask_probability, self.mask_ratio = grid, mask_probability, tuple(mask_ratio)

    def __call__(self, image: Any, seed: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: ARG002 - TrainView.sample's signature
        return self.parts(self.multicrop(image, seed), seed)

    def parts(self, crops: dict[str, list[torch.Tensor]], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stacked crops of `MultiCrop`'s output and each global crop's iBOT mask."""
        size, channels = self.multicrop.cfg.local_crops_size, crops["global_crops"][0].shape[0]
        local = torch.stack(crops["local_crops"]) if crops["local_crops"] else torch.zeros(0, channels, size, size)
        masks = torch.stack([block_mask(seed_for(IBOT_MASK, seed, i), self.grid, self.mask_probability,
                                        self.mask_ratio).flatten() for i in range(2)])
        return torch.stack(crops["global_crops"]), local, masks


@dataclass
class Views:
    """One micro batch's crops as the student and teacher take them: crop-major, as Meta's collate (all
    images' first global crop, then all second ones), and the student's further forward arguments."""

    global_crops: torch.Tensor
    """(2B, 3, G, G)"""
    local_crops: torch.Tensor | None
    """(nB, 3, L, L); None without local crops"""
    masks: torch.Tensor | None
    """(2B, N) iBOT's masks of the global crops' patches; None without iBOT"""
    batch: int
    n_local: int
    student: dict[str, Any] = field(default_factory=dict)
    """More keyword arguments of the student's forward (DINOv3's RoPE draws)."""
    mask_indices: torch.Tensor | None = None
    """(M,) the masked patches' rows, padded to the fixed `mask_bound` (masked.py); set by `loss`"""
    mask_valid: torch.Tensor | None = None
    """(M,) which of those rows are masked patches"""


def crop_major(x: torch.Tensor) -> torch.Tensor:
    """(B, n, ...) per sample, as the loader stacks a view -> (n B, ...) crop-major."""
    return x.transpose(0, 1).flatten(0, 1)
