"""A timm model as a backbone of ours: any timm model with `forward_features` giving a feature map (a ResNet,
a ConvNeXt, an EfficientNet), its tokens shaped as a ViT's so that everything that reads a ViT's features
(the k-NN, eval.sets, launch/evaluate.py, launch/embed.py) reads it unchanged.

    m = TimmBackbone("resnet10t", {"output_stride": 8}, img_size=32)
    m.forward_features(x)        # (B, 1 + h*w, C): the pooled feature as a "class token", then the map's cells
    m.model                      # the timm model itself (num_classes=0): its state dict is in timm's names

A distillation student (pipeline/objectives/distill/) is the one user today: its export is `m.model`'s state
dict with `metadata(...)` in the safetensors header, which `timm.create_model(name, num_classes=0, **kwargs)`
loads as it is and pipeline/objectives/backbone.py reads back as this class.
"""

from __future__ import annotations

import ast
from typing import Any

import torch
from torch import nn

from pipeline.model.variants import pair
from pipeline.model.vit import TokenFeatures

#: The safetensors metadata keys of an export (values as their repr, as our ViT exports write theirs).
METADATA_KEYS = ("timm_model", "timm_kwargs", "img_size")


class TimmBackboneError(ValueError):
    """A timm model that cannot be built, or whose features are not a feature map (one line)."""


def create(name: str, kwargs: dict[str, Any], **extra: Any) -> nn.Module:
    """`timm.create_model(name, pretrained=False, num_classes=0, **kwargs)`: nothing downloaded, no classifier
    (the export holds the backbone; whoever uses it fits a head). TimmBackboneError of one line otherwise."""
    import timm  # noqa: PLC0415 - timm is needed by this class only

    try:
        return timm.create_model(name, pretrained=False, num_classes=0, **kwargs, **extra)
    except Exception as e:  # noqa: BLE001 - an unknown name (RuntimeError), arguments it refuses (TypeError, ...)
        raise TimmBackboneError(f"timm cannot build {name!r} with {kwargs}: "
                                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def feature_grid(name: str, kwargs: dict[str, Any], img_size: int | tuple[int, int]) -> tuple[int, tuple[int, int]]:
    """(its width, its feature map's (h, w) at `img_size`), from a forward on the meta device (no memory, no
    compute: shapes only). TimmBackboneError where the features are not a (B, C, h, w) map (a timm ViT gives
    tokens)."""
    with torch.device("meta"):
        model = create(name, kwargs)
        try:
            out = model.forward_features(torch.empty(1, 3, *pair(img_size)))
        except Exception as e:  # noqa: BLE001 - a model of a fixed input size (a timm ViT's), or too small an image
            raise TimmBackboneError(f"timm's {name!r} {kwargs} cannot take images of {list(pair(img_size))}: "
                                    f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(out, torch.Tensor) or out.ndim != 4:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise TimmBackboneError(f"timm's {name!r} gives features of shape {shape}, not a (B, C, h, w) feature map: "
                                f"use one of our ViTs for a ViT student")
    return int(model.num_features), (int(out.shape[2]), int(out.shape[3]))


def timm_flops(name: str, kwargs: dict[str, Any], img_size: int | tuple[int, int]) -> float:
    """Forward FLOPs per image (multiply-adds x 2, as `model_flops`) of its forward_features and pooling, by
    torch's FLOP counter on the meta device (convolutions and matrix products: what timm's GMACs count)."""
    from torch.utils.flop_counter import FlopCounterMode  # noqa: PLC0415 - only the cost estimate needs it

    with torch.device("meta"):
        model = create(name, kwargs)
        with FlopCounterMode(display=False) as counter:
            model.forward_head(model.forward_features(torch.empty(1, 3, *pair(img_size))), pre_logits=True)
    return float(counter.get_total_flops())


class TimmBackbone(nn.Module):
    """A timm model (`model`, built with num_classes=0) whose forward_features gives tokens: its pooled feature
    (timm's own global pool and, where it has one, head norm: `forward_head(pre_logits=True)`) as the class
    token, then the map's h*w cells in row-major order as the patch tokens."""

    ARCH_KEYS = METADATA_KEYS
    num_prefix_tokens = 1  # the pooled feature: `pipeline.eval.features.embedding` reads it as a class token
    num_reg_tokens = 0

    def __init__(self, timm_model: str, timm_kwargs: dict[str, Any] | None = None,
                 img_size: int | tuple[int, int] = 224) -> None:
        super().__init__()
        self.timm_model, self.timm_kwargs, self.img_size = timm_model, dict(timm_kwargs or {}), pair(img_size)
        self.model = create(timm_model, self.timm_kwargs)
        self.embed_dim = self.num_features = int(self.model.num_features)
        self.num_classes = 0

    def forward_tokens(self, images: torch.Tensor) -> TokenFeatures:
        fmap = self.model.forward_features(images)  # (B, C, h, w)
        pooled = self.model.forward_head(fmap, pre_logits=True)  # (B, C)
        cells = fmap.flatten(2).transpose(1, 2)  # (B, h*w, C)
        return TokenFeatures(pooled, cells[:, :0], cells, fmap)

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.forward_tokens(images)
        return torch.cat([tokens.cls_token[:, None], tokens.patch_tokens], dim=1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.forward_features(images)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.model.set_grad_checkpointing(enable)  # timm's own (a model without it raises: said by timm)

    def metadata(self) -> dict[str, str]:
        return {k: repr(v) for k, v in architecture(self).items()}


def architecture(model: TimmBackbone) -> dict[str, Any]:
    return {"timm_model": model.timm_model, "timm_kwargs": model.timm_kwargs, "img_size": tuple(model.img_size)}


def from_metadata(metadata: dict[str, str]) -> dict[str, Any] | None:
    """TimmBackbone's arguments from an export's safetensors metadata; None for a file that is not one."""
    if "timm_model" not in metadata:
        return None
    out = {}
    for key in METADATA_KEYS:
        try:
            out[key] = ast.literal_eval(metadata[key])
        except (KeyError, ValueError, SyntaxError):
            out[key] = metadata.get(key)  # a bare name (our exports write repr; others may not)
    return out
