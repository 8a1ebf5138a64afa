"""Every preset `model.variant` can name and what follows from a model's arguments alone: the variants of the
paper's Table 1 and DINOv2's (built by vit.py's `VisionTransformer`) and DINOv3's (dinov3.py's `DINOv3ViT`:
RoPE, storage tokens), the constructor arguments from a run config, the forward FLOPs. No torch: the command
line checks model.variant against VARIANTS before importing it.

The constructor arguments say which class they are for: DINOv3's carry its RoPE's (`rope_temperature` and
the rest, which every DINOv3 variant sets), the ViT's none (`is_dinov3`; dinov3.backbone_class builds).
"""

from __future__ import annotations

from typing import Any

from pipeline.typed_yaml import ConfigError

# Table 1 of the paper (+ the Ti and S sizes of DeiT that timm also ships). Patch size is part of the name.
VARIANTS: dict[str, dict[str, int | float | bool | str]] = {
    "vit_ti16": dict(patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "vit_s16": dict(patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "vit_b16": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12),
    "vit_b32": dict(patch_size=32, embed_dim=768, depth=12, num_heads=12),
    "vit_l16": dict(patch_size=16, embed_dim=1024, depth=24, num_heads=16),
    "vit_l32": dict(patch_size=32, embed_dim=1024, depth=24, num_heads=16),
    "vit_h14": dict(patch_size=14, embed_dim=1280, depth=32, num_heads=16),
}

# DINOv2's backbones (Meta's hubconf / timm's vit_*_patch14_dinov2): LayerScale at 1e-5 in every block and a
# position table interpolated at forward time, so 224 px global and 96 px local crops share one model.
_DINOV2 = dict(patch_size=14, init_values=1e-5, dynamic_img_size=True)
# ViT-g: a SwiGLU MLP. timm's packed layout: fc1 is D -> 2H (value and gate halves), fc2 is H -> D, with
# mlp_ratio giving 2H / D; H = 4096 for D = 1536, as Meta's SwiGLUFFNFused rounds (2/3 * 4D, to a multiple of 8).
_GIANT = dict(embed_dim=1536, depth=40, num_heads=24, mlp_ratio=2.66667 * 2, mlp_layer="swiglu")
for _size, _shape in {
    "s": dict(embed_dim=384, depth=12, num_heads=6),
    "b": dict(embed_dim=768, depth=12, num_heads=12),
    "l": dict(embed_dim=1024, depth=24, num_heads=16),
    "g": _GIANT,
}.items():
    VARIANTS[f"vit_{_size}14"] = dict(_DINOV2, **_shape)
    # With registers, timm's layout: the position table covers the patches only (Meta's class-token row is
    # folded into the class token on load); the registers carry no position.
    VARIANTS[f"vit_{_size}14_reg4"] = dict(_DINOV2, **_shape, reg_tokens=4, no_embed_class=True)


# DINOv3: Meta's released backbones (hub/backbones.py), all patch 16 with 4 storage tokens, LayerScale 1e-5, RoPE
# base 100 on 'separate' coordinates and LayerNorm eps 1e-5. timm's mlp_ratio: SwiGLU's hidden width before
# alignment, which is Meta's 2/3 x ffn_ratio x D (S+: 2/3 x 6 x 384 = 1536 = 4 x 384).
_DINOV3 = dict(patch_size=16, init_values=1e-5, reg_tokens=4, rope_temperature=100.0)
DINOV3_VARIANTS: dict[str, dict] = {
    "dinov3_vits16": dict(_DINOV3, embed_dim=384, depth=12, num_heads=6),
    "dinov3_vits16plus": dict(_DINOV3, embed_dim=384, depth=12, num_heads=6, mlp_layer="swiglu", swiglu_align_to=8),
    "dinov3_vitb16": dict(_DINOV3, embed_dim=768, depth=12, num_heads=12),
    "dinov3_vitl16": dict(_DINOV3, embed_dim=1024, depth=24, num_heads=16),
    "dinov3_vith16plus": dict(_DINOV3, embed_dim=1280, depth=32, num_heads=20, mlp_layer="swiglu", swiglu_align_to=8),
    "dinov3_vit7b16": dict(_DINOV3, embed_dim=4096, depth=40, num_heads=32, mlp_ratio=2.0, mlp_layer="swiglu",
                           swiglu_align_to=64, qkv_bias=False),
}
VARIANTS.update(DINOV3_VARIANTS)


def is_dinov3(kwargs: dict[str, Any]) -> bool:
    """Whether constructor arguments are DINOv3ViT's (they name its RoPE)."""
    return any(k.startswith("rope_") for k in kwargs)


def pair(x: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    return (x, x) if isinstance(x, int) else (int(x[0]), int(x[1]))


def variant_kwargs(name: str, **overrides) -> dict:
    """The constructor arguments of a named variant, with overrides applied (None values ignored)."""
    if name not in VARIANTS:
        raise KeyError(f"unknown variant '{name}'; choose one of: {', '.join(VARIANTS)}")
    kwargs: dict = dict(VARIANTS[name])
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    return kwargs


def model_kwargs_from_config(model_cfg, num_classes: int | None = None) -> dict:
    """Constructor arguments from a `pipeline.config.ModelConfig` (num_classes from the data if unset), for
    the class its variant is built by."""
    classes = model_cfg.num_classes if model_cfg.num_classes is not None else num_classes
    if classes is None:
        raise ValueError("model.num_classes is not set and no data set gave a class count")
    shared = dict(
        img_size=pair(model_cfg.img_size), num_classes=classes,
        patch_size=model_cfg.patch_size, embed_dim=model_cfg.embed_dim, depth=model_cfg.depth,
        num_heads=model_cfg.num_heads, mlp_ratio=model_cfg.mlp_ratio, qkv_bias=model_cfg.qkv_bias,
        drop_rate=model_cfg.drop_rate, attn_drop_rate=model_cfg.attn_drop_rate,
        drop_path_rate=model_cfg.drop_path_rate, global_pool=model_cfg.global_pool,
        # None keeps the variant's choice (the DINOv2 and DINOv3 variants set these).
        init_values=model_cfg.init_values, reg_tokens=model_cfg.reg_tokens, mlp_layer=model_cfg.mlp_layer,
    )
    if getattr(model_cfg, "in_chans", None) not in (None, 3):  # as patch_embed_impl: RGB runs' kwargs unchanged
        shared["in_chans"] = model_cfg.in_chans
    if getattr(model_cfg, "patch_embed_impl", "conv") != "conv":  # recorded only where it is not the default
        shared["patch_embed_impl"] = model_cfg.patch_embed_impl
    if getattr(model_cfg, "stem", "patch") != "patch":  # so too the stem: a patchify run's kwargs are unchanged
        shared["stem"] = model_cfg.stem
    vit_only = dict(representation_size=model_cfg.representation_size, no_embed_class=model_cfg.no_embed_class,
                    dynamic_img_size=model_cfg.dynamic_img_size)
    if model_cfg.variant not in DINOV3_VARIANTS:
        return variant_kwargs(model_cfg.variant, **shared, **vit_only)
    # A DINOv3 ViT: the ViT keys that mean nothing here (no position table to cover the class token or not, to
    # make dynamic or not; no pre-logits layer) are refused when set, not ignored.
    for key, meaningless in (("representation_size", model_cfg.representation_size is not None),
                             ("no_embed_class", model_cfg.no_embed_class is False),
                             ("dynamic_img_size", model_cfg.dynamic_img_size is False),
                             ("stem", "stem" in shared)):
        if meaningless:
            raise ConfigError(f"model.{key}={getattr(model_cfg, key)} with model.variant={model_cfg.variant}: a "
                              f"DINOv3 ViT has RoPE, no position table, and takes any grid; leave model.{key} unset")
    return variant_kwargs(model_cfg.variant, **shared)


def model_flops(kwargs: dict, img_size: int | tuple[int, int] | None = None) -> float:
    """Forward FLOPs per image (multiply-adds x 2) from the model's shape alone (a DINOv3 ViT's: `dinov3_flops`).

    Counts the matrix products: patch projection, per block QKV (3D^2 N), QK^T and AV (2 N^2 D),
    output projection (D^2 N), MLP (2 r D^2 N), pre-logits and head. Norms, softmax and GELU are
    O(ND) and left out, as in timm's published GMACs (B/16@224: 17.58 G, ours 17.56 G).
    A training step costs 3x this (backward = 2x forward).
    """
    if is_dinov3(kwargs):
        return dinov3_flops(kwargs, img_size)
    h, w = pair(img_size if img_size is not None else kwargs.get("img_size", 224))
    p, d = kwargs.get("patch_size", 16), kwargs.get("embed_dim", 768)
    depth, ratio = kwargs.get("depth", 12), kwargs.get("mlp_ratio", 4.0)
    in_chans, classes = kwargs.get("in_chans", 3), kwargs.get("num_classes", 1000)
    rep = kwargs.get("representation_size") or 0
    n_patches = (h // p) * (w // p)
    n = n_patches + 1 + kwargs.get("reg_tokens", 0)
    # MLP: fc1 D -> rD and fc2 rD -> D; SwiGLU's fc2 takes half of fc1's width (the gated half).
    mlp = 1.5 * ratio if kwargs.get("mlp_layer", "mlp") == "swiglu" else 2 * ratio
    macs = n_patches * in_chans * p * p * d if kwargs.get("stem", "patch") == "patch" else \
        conv_stem_macs(in_chans, d, p, h, w)
    macs += depth * (n * d * d * (4 + mlp) + 2 * n * n * d)
    macs += d * rep + (rep or d) * classes
    return 2.0 * macs


def conv_stem_widths(embed_dim: int, patch_size: int) -> list[int]:
    """The widths of layers.ConvStem's 3x3 convolutions: D / 2^k, ..., D / 2, D for a patch of 2^k pixels."""
    halvings = patch_size.bit_length() - 1
    if patch_size < 2 or 1 << halvings != patch_size:
        raise ValueError(f"stem 'conv' needs a patch_size that is a power of 2, got {patch_size}")
    return [max(embed_dim >> (halvings - i), 8) for i in range(halvings + 1)]


def conv_stem_macs(in_chans: int, embed_dim: int, patch_size: int, h: int, w: int) -> int:
    """layers.ConvStem's multiply-adds for an (h, w) image: each convolution's kernel x in x out x positions
    (the first 3x3 at full resolution, each next one at half the last, the closing 1x1 on the token grid)."""
    macs, chans = 0, in_chans
    for i, width in enumerate(conv_stem_widths(embed_dim, patch_size)):
        h, w = (h, w) if i == 0 else (-(-h // 2), -(-w // 2))
        macs += 9 * chans * width * h * w
        chans = width
    return macs + chans * embed_dim * h * w


def swiglu_hidden(dim: int, mlp_ratio: float, align_to: int = 0) -> int:
    """SwiGLU's hidden width as timm's SwiGLU sizes it: int(D x mlp_ratio), rounded up to `align_to`."""
    hidden = int(dim * mlp_ratio)
    return hidden + (-hidden % align_to) if align_to else hidden


def dinov3_flops(kwargs: dict, img_size: int | tuple[int, int] | None = None) -> float:
    """A DINOv3 ViT's forward FLOPs per image, counted as `model_flops` counts: the matrix products (patch
    projection, QKV, QK^T and AV, output projection, the MLP: 2 D H for GELU's, 3 D H for SwiGLU's three
    projections, the head). RoPE is elementwise, as norms and softmax are, and left out: per block about 6 N D
    (a multiply-add and a multiply on the queries and keys) against 8 N D^2 + 4 N^2 D of QKV, projection and
    attention, under 0.1% at D = 384. A training step costs 3x this.
    """
    h, w = pair(img_size if img_size is not None else kwargs.get("img_size", 224))
    p, d = kwargs.get("patch_size", 16), kwargs.get("embed_dim", 768)
    depth, ratio = kwargs.get("depth", 12), kwargs.get("mlp_ratio", 4.0)
    in_chans, classes = kwargs.get("in_chans", 3), kwargs.get("num_classes", 1000)
    n_patches = (h // p) * (w // p)
    n = n_patches + 1 + kwargs.get("reg_tokens", 4)
    if kwargs.get("mlp_layer", "mlp") == "swiglu":
        mlp = 3 * d * swiglu_hidden(d, ratio, kwargs.get("swiglu_align_to", 0))
    else:
        mlp = 2 * d * int(d * ratio)
    macs = n_patches * in_chans * p * p * d if kwargs.get("stem", "patch") == "patch" else \
        conv_stem_macs(in_chans, d, p, h, w)
    macs += depth * (n * (4 * d * d + mlp) + 2 * n * n * d)
    macs += d * classes
    return 2.0 * macs
