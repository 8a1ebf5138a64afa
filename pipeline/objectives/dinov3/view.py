"""DINOv3's view of a training sample, drawn in the loader workers: DINOv2's multi-crop and iBOT masks
(pipeline/objectives/dino/view.py), and what DINOv3 adds, each draw from the sample's own seed or, for what
every sample of a step shares, from the step:

    crop sizes   with dinov3.resolutions (the high-resolution stage), the step's global, local and Gram crop
                 sizes: one entry, drawn by weight from (train.seed, step), as Meta's CombinedDataLoader
                 draws one of its per-resolution loaders for each iteration (a micro batch stacks one size)
    Gram crops   the global crops' boxes at the Gram teacher's side (pipeline/data/multicrop.py)
    RoPE boxes   each crop's RoPE augmentation, one box per block (`RopeAugment`, pipeline/model/rope.py),
                 from (ROPE_AUG, the sample's seed, the crop's index): Meta draws one per forward call and
                 block from the rank's RNG, shared by the rank's crops of one kind; per crop here, so that a
                 sample's positions are the same on any layout
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from pipeline.data.multicrop import MultiCropConfig
from pipeline.data.order import CROP_SIZES, ROPE_AUG, seed_for
from pipeline.model.rope import RopeAugment
from pipeline.objectives.dino.view import MultiCropView


def pick(weights: list[float], seed: int) -> int:
    """An index drawn with probability proportional to `weights`, from `seed` alone."""
    p = np.asarray(weights, dtype=np.float64)
    return int(np.random.default_rng(seed).choice(len(p), p=p / p.sum()))


class DINOv3View:
    """`TrainView.sample` of the DINOv3 objective: (global crops (2, 3, G, G), local crops (n, 3, L, L), iBOT
    masks (2, N)), then, where configured, the RoPE boxes of the global and local crops ((2, depth, 5),
    (n, depth, 5), float32 carried as int32 bits) and the Gram teacher's crops (2, 3, S, S). `crops`: one MultiCropConfig per resolution (one
    without the high-resolution stage) with `weights`; `patch` the patch size (iBOT's grid follows the step's
    global size); `seed` the run's (train.seed). Picklable (it travels to the workers)."""

    def __init__(self, crops: list[MultiCropConfig], weights: list[float], patch: int, mask_probability: float,
                 mask_ratio: tuple[float, float], rope: RopeAugment | None, seed: int) -> None:
        self.views = [MultiCropView(c, (c.global_crops_size // patch,) * 2, mask_probability, mask_ratio)
                      for c in crops]
        self.weights, self.rope, self.seed = list(weights), rope, seed

    def resolution(self, step: int) -> int:
        """The index of step `step`'s crop sizes (0 with one resolution)."""
        return 0 if len(self.views) == 1 else pick(self.weights, seed_for(CROP_SIZES, self.seed, step))

    def __call__(self, image: Any, seed: int, step: int = 0) -> tuple[torch.Tensor, ...]:
        view = self.views[self.resolution(step)]
        crops = view.multicrop(image, seed)
        global_crops, local, masks = view.parts(crops, seed)
        parts: list[torch.Tensor] = [global_crops, local, masks]
        if self.rope is not None:
            boxes = [self.rope(seed_for(ROPE_AUG, seed, i)) for i in range(2 + len(local))]
            depth = self.rope.blocks
            local_boxes = torch.stack(boxes[2:]) if len(local) else torch.zeros(0, depth, 5)
            # As int32 bits: the loader casts floating parts to the run's dtype (bf16 would round the boxes).
            parts += [torch.stack(boxes[:2]).view(torch.int32), local_boxes.view(torch.int32)]
        if "gram_crops" in crops:
            parts.append(torch.stack(crops["gram_crops"]))
        return tuple(parts)


def resolution_configs(base: MultiCropConfig, resolutions: list[Any], gram_size: Any) -> tuple[list[MultiCropConfig],
                                                                                               list[float]]:
    """The crop configs of each resolution of dinov3.resolutions (the base config alone when empty) and their
    weights. `gram_size(global_size, given)`: the Gram crops' side for a resolution (None: no Gram crops)."""
    if not resolutions:
        return [replace(base, gram_crops_size=gram_size(base.global_crops_size, None))], [1.0]
    configs = [replace(base, global_crops_size=r.global_crops_size, local_crops_size=r.local_crops_size,
                       gram_crops_size=gram_size(r.global_crops_size, r.gram_crops_size)) for r in resolutions]
    return configs, [r.weight for r in resolutions]
