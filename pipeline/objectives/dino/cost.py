"""What a DINOv2 or DINOv3 step costs, from the model's shape and the recipe's section: FLOPs per image (MFU's
numerator, the config headers' costs) and iBOT's expected masked patches."""

from __future__ import annotations

from typing import Any

from pipeline.model.dino_head import dino_head_flops
from pipeline.model.vit import model_flops


def expected_masked_patches(d: Any, model_kwargs: dict[str, Any]) -> float:
    """iBOT's masked patches per image on average: 2 global crops, each masked with probability
    mask_probability, a fraction uniform in mask_ratio of its patches (block masking can stop a little short
    of its target when no block fits; `launch/bench.py dino` counts the real ones). `d`: the recipe's section."""
    if d.ibot_loss_weight <= 0:
        return 0.0
    img, patch = model_kwargs["img_size"], model_kwargs["patch_size"]
    side = (img if isinstance(img, int) else img[0]) // patch
    return 2 * d.mask_probability * side * side * sum(d.mask_ratio) / 2


def flops_per_image(d: Any, model_kwargs: dict[str, Any], local_size: int | None, anchored: bool) -> float:
    """The student's forward (global and local crops, the DINO head on their class tokens, the iBOT head on
    the expected masked patches) plus a third of the teacher's (it runs forward only, on the global crops and
    the same masked patches; the trainer counts 3 x this for forward + backward). `local_size`: the local
    crops' side (default the section's local_crops_size); `anchored`: the source's forward too (adapt.anchor)."""
    dim = model_kwargs["embed_dim"]
    head = dino_head_flops(model_kwargs, dim, d.head_n_prototypes)
    patch_head = (dino_head_flops({**model_kwargs, "head_bottleneck_dim": d.ibot_head_bottleneck_dim}, dim,
                                  d.ibot_head_n_prototypes) if d.ibot_separate_head else head)
    ibot = expected_masked_patches(d, model_kwargs) * patch_head
    global_fwd = 2 * (model_flops(model_kwargs) + head) + ibot
    local_fwd = d.local_crops_number * (model_flops(model_kwargs, local_size or d.local_crops_size) + head)
    anchor = 2 * model_flops(model_kwargs) / 3 if anchored else 0.0
    return global_fwd + local_fwd + global_fwd / 3 + anchor
