"""The ViT's presets and what follows from a model's arguments alone: the variants of the paper's Table 1
and DINOv2's, the constructor arguments from a run config, the forward FLOPs. No torch: the command line
checks model.variant against VARIANTS before importing it.
"""

from __future__ import annotations

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


def pair(x: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    return (x, x) if isinstance(x, int) else (int(x[0]), int(x[1]))


def variant_kwargs(name: str, **overrides) -> dict:
    """The constructor arguments of a named variant, with overrides applied (None values ignored)."""
    if name not in VARIANTS:
        raise KeyError(f"unknown ViT variant '{name}'; choose one of: {', '.join(VARIANTS)}")
    kwargs: dict = dict(VARIANTS[name])
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    return kwargs


def model_kwargs_from_config(model_cfg, num_classes: int | None = None) -> dict:
    """Constructor arguments from a `pipeline.config.ModelConfig` (num_classes from the data if unset)."""
    classes = model_cfg.num_classes if model_cfg.num_classes is not None else num_classes
    if classes is None:
        raise ValueError("model.num_classes is not set and no data set gave a class count")
    return variant_kwargs(
        model_cfg.variant,
        img_size=pair(model_cfg.img_size), num_classes=classes,
        patch_size=model_cfg.patch_size, embed_dim=model_cfg.embed_dim, depth=model_cfg.depth,
        num_heads=model_cfg.num_heads, mlp_ratio=model_cfg.mlp_ratio, qkv_bias=model_cfg.qkv_bias,
        drop_rate=model_cfg.drop_rate, attn_drop_rate=model_cfg.attn_drop_rate,
        drop_path_rate=model_cfg.drop_path_rate, representation_size=model_cfg.representation_size,
        global_pool=model_cfg.global_pool,
        # None keeps the variant's choice (the DINOv2 variants set these).
        init_values=model_cfg.init_values, reg_tokens=model_cfg.reg_tokens, no_embed_class=model_cfg.no_embed_class,
        mlp_layer=model_cfg.mlp_layer, dynamic_img_size=model_cfg.dynamic_img_size,
    )


def model_flops(kwargs: dict, img_size: int | tuple[int, int] | None = None) -> float:
    """Forward FLOPs per image (multiply-adds x 2) from the model's shape alone.

    Counts the matrix products: patch projection, per block QKV (3D^2 N), QK^T and AV (2 N^2 D),
    output projection (D^2 N), MLP (2 r D^2 N), pre-logits and head. Norms, softmax and GELU are
    O(ND) and left out, as in timm's published GMACs (B/16@224: 17.58 G, ours 17.56 G).
    A training step costs 3x this (backward = 2x forward).
    """
    h, w = pair(img_size if img_size is not None else kwargs.get("img_size", 224))
    p, d = kwargs.get("patch_size", 16), kwargs.get("embed_dim", 768)
    depth, ratio = kwargs.get("depth", 12), kwargs.get("mlp_ratio", 4.0)
    in_chans, classes = kwargs.get("in_chans", 3), kwargs.get("num_classes", 1000)
    rep = kwargs.get("representation_size") or 0
    n_patches = (h // p) * (w // p)
    n = n_patches + 1 + kwargs.get("reg_tokens", 0)
    # MLP: fc1 D -> rD and fc2 rD -> D; SwiGLU's fc2 takes half of fc1's width (the gated half).
    mlp = 1.5 * ratio if kwargs.get("mlp_layer", "mlp") == "swiglu" else 2 * ratio
    macs = n_patches * in_chans * p * p * d
    macs += depth * (n * d * d * (4 + mlp) + 2 * n * n * d)
    macs += d * rep + (rep or d) * classes
    return 2.0 * macs
