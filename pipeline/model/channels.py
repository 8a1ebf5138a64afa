"""A patch embedding trained on one channel count, loaded into a model of another (issue 62).

RGB weights (ImageNet's, a timm file, a run on 8-bit RGB) into a model of C input channels, the way timm loads a
pretrained model with `in_chans=C` (`timm.models.adapt_input_conv`): for C = 1 the projection's three RGB slices
are summed (a grey image through the summed filter gives what the RGB filter gives for that grey as RGB); for
C > 3 the RGB slices are repeated over the channels (R, G, B, R, ...) and scaled by 3 / C (a constant image
through all C channels projects as it did through 3). Any other pair of channel counts (C -> 3, C -> C') has no
such rule: refused in one line, unless the run asks for the patch projection fresh (`finetune.fresh_patch_embed`),
drawn by the model's own init while every other tensor loads.
"""

from __future__ import annotations

import torch

from pipeline.model.weights import WeightsError

PATCH_WEIGHT = "patch_embed.proj.weight"
"""The patch projection's weight (D, C, P, P) in timm's names, ours."""


def fit_in_chans(state: dict[str, torch.Tensor], in_chans: int, where: str, fresh: bool = False,
                 key: str | None = "finetune.fresh_patch_embed", name: str = PATCH_WEIGHT
                 ) -> tuple[dict[str, torch.Tensor], str]:
    """`state` with its patch projection (`name`) fitted to a model of `in_chans` input channels, and a phrase for
    the log ('' when nothing changed). `fresh`: the projection left out (the model's draw stays) whatever the
    channels; `key`: the config key that asks for it, named in the refusal (None: the command has none)."""
    weight = state.get(name)
    if weight is None or weight.ndim != 4:
        return state, ""
    have = weight.shape[1]
    if fresh:
        return ({k: v for k, v in state.items() if k != name},
                f"patch projection fresh ({have} channels in the file, {in_chans} in the model; {key})")
    if have == in_chans:
        return state, ""
    if have != 3:
        remedy = f"; set {key}=true to load the rest and draw the patch projection fresh" if key else ""
        raise WeightsError(f"{where}: its patch embedding takes {have} channels and the model {in_chans}: only "
                           f"RGB (3) weights adapt to other channels (timm's adapt_input_conv){remedy}")
    # timm's own rule (imported here: timm is heavy), so that a timm model built alike agrees exactly
    from timm.models import adapt_input_conv

    adapted = adapt_input_conv(in_chans, weight)
    return ({**state, name: adapted},
            f"patch projection RGB -> {in_chans} channels (timm's adapt_input_conv)")
