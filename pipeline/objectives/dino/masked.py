"""iBOT's masked patches at a size fixed per micro batch, as Meta's collate pads its gather (`mask_indices_list`
to `upperbound`): the patch heads, the Sinkhorn-Knopp targets and the loss run on `mask_bound` rows whatever
the masks hold, the rows past the masked ones weighted 0. Nothing of it is read on the host, so no step
waits for the device to say how many patches are masked (`patch_tokens[masks]` did, in forward and
backward); the loss is the same (tests/unit/test_dino_pieces.py)."""

from __future__ import annotations

import torch

from pipeline.model.dino import masked_rows

__all__ = ["gathered_per_image", "mask_bound", "masked_rows", "masked_weights"]


def mask_bound(masks: torch.Tensor, mask_probability: float, mask_ratio: tuple[float, float]) -> int:
    """The most patches the (C, N) masks of a micro batch can hold, from their shape and the config alone:
    `block_mask` (pipeline/data/multicrop.py) masks an image with probability `mask_probability`, and then at
    most int(N x mask_ratio[1]) of its patches (a target drawn below the ratio, blocks never past it). Meta
    bounds a batch tighter (it draws how many images are masked per batch); ours are drawn per image, so
    that a sample's mask is the same on any layout, and the bound is every crop masked at the highest ratio."""
    crops, patches = masks.shape
    per_crop = int(patches * mask_ratio[1]) if mask_probability > 0 else 0
    return max(1, crops * per_crop)


def gathered_per_image(model_kwargs: dict, mask_probability: float, mask_ratio: tuple[float, float]) -> int:
    """The rows the patch heads run on per image (its 2 global crops' share of `mask_bound`): what a step
    computes, padding included. `DINOv2.flops_per_image` (MFU's numerator) counts the masked patches
    expected instead, the useful work; the padding is overhead, as a padded token is."""
    img, patch = model_kwargs["img_size"], model_kwargs["patch_size"]
    h, w = (img, img) if isinstance(img, int) else img
    return 2 * int((h // patch) * (w // patch) * mask_ratio[1]) if mask_probability > 0 else 0


def masked_weights(masks: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each gathered row's weight in iBOT's loss: 1 / (its image's masked patches), as Meta's collate
    computes `masks_weight`; 0 for the padding rows."""
    per_image = 1 / masks.sum(-1).clamp(min=1.0)
    return per_image[indices // masks.shape[1]] * valid
