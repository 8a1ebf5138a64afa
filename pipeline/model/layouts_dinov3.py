"""The DINOv3 layouts (pipeline/model/dinov3.py's `DINOv3ViT`): timm's `vit_*_patch16_dinov3*` names, which are
ours, and Meta's release files (`dinov3_vitb16_pretrain_lvd1689m-*.pth`: dinov3/models/vision_transformer.py's
names), converted to ours. Read by pipeline/model/layouts.py's `recognise`, as every layout.
"""

from __future__ import annotations

import torch

from pipeline.model.layout_parts import (
    FC,
    NotThis,
    Recognised,
    need,
    nothing_else,
    read_blocks,
    read_norm,
    read_stem,
)

# timm's Eva block as its vit_*_patch16_dinov3[_qkvb] models have it: LayerScale as gamma_1/gamma_2 on the block, qkv
# without a bias (query and value biases apart, the key's a zero buffer that is not saved), the MLP as fc1/fc2 or
# SwiGLU's separate fc1_g/fc1_x/fc2.
_SWIGLU_SPLIT = ("mlp.fc1_g", "mlp.fc1_x", "mlp.fc2")
_EVA_OPTIONAL = ({"attn.q_bias", "attn.v_bias"}, {"gamma_1", "gamma_2"})
# What each released DINOv3 width is called (pipeline.model.dinov3.VARIANTS), by (width, SwiGLU or not).
_DINOV3_NAMES = {(384, False): "dinov3_vits16", (384, True): "dinov3_vits16plus", (768, False): "dinov3_vitb16",
                 (1024, False): "dinov3_vitl16", (1280, True): "dinov3_vith16plus", (4096, True): "dinov3_vit7b16"}


def _mlp_ratio(hidden: int, dim: int) -> float:
    """The mlp_ratio whose int(dim * ratio) is `hidden` (hidden / dim, unless float rounding takes it below)."""
    ratio = hidden / dim
    return ratio if int(dim * ratio) == hidden else (hidden + 0.5) / dim


def dinov3_arch(state: dict[str, torch.Tensor], dim: int, depth: int, patch: int, heads: int | None = None) -> dict:
    """A DINOv3 ViT's model config (pipeline.config.ModelConfig's architecture keys, variant included) from its
    tensors in timm's names. The heads are not stored: 64-wide as in every released DINOv3 ViT but the 7B's
    (128-wide: 32 heads at 4096), unless `heads` is known (Meta's files store the RoPE periods, d/4 of them)."""
    swiglu = "blocks.0.mlp.fc1_g.weight" in state
    hidden = state["blocks.0.mlp.fc1_g.weight" if swiglu else "blocks.0.mlp.fc1.weight"].shape[0]
    # A released width keeps its variant's SwiGLU rounding; another one is dinov3_vits16's shape with overrides.
    variant = _DINOV3_NAMES.get((dim, swiglu), "dinov3_vits16")
    return dict(variant=variant, patch_size=patch, embed_dim=dim, depth=depth,
                num_heads=heads or (32 if dim == 4096 else max(dim // 64, 1)), mlp_ratio=_mlp_ratio(hidden, dim),
                qkv_bias="blocks.0.attn.q_bias" in state,
                init_values=1e-5 if "blocks.0.gamma_1" in state else None,  # a loaded file overwrites every gamma
                reg_tokens=state["reg_token"].shape[1] if "reg_token" in state else 0, no_embed_class=None,
                mlp_layer="swiglu" if swiglu else "mlp")


def timm_dinov3(state: dict[str, torch.Tensor], mask_token: bool = False, name: str = "timm's DINOv3 ViT",
                 complete: bool = True) -> Recognised:
    """timm's Eva as `vit_*_patch16_dinov3[_qkvb]` saves it (our DINOv3ViT's names): no position table (RoPE, whose
    periods timm does not save), reg_token, the Eva block, the final norm, a head of any shape or none.
    `mask_token`: iBOT's (1, D) too, as a DINOv3 run's backbone may have it. `complete`: the file decides the
    architecture (not for ours, whose run's config does, heads included)."""
    if "pos_embed" in state:
        raise NotThis("it has pos_embed: a learned position table, not RoPE")
    stem, keys = read_stem(state, pos_embed=False)
    dim = stem["embed_dim"]
    if "reg_token" in state:
        need(state, "reg_token", (1, None, dim), f"(1, R, {dim})")
        keys.add("reg_token")
    depth, names = read_blocks(state, "blocks.", dim, mlps=(FC, _SWIGLU_SPLIT), optional=_EVA_OPTIONAL)
    keys |= set(names) | read_norm(state, "norm", dim)
    left_out = ""
    if mask_token and "mask_token" in state:
        need(state, "mask_token", (1, dim), f"(1, {dim}), iBOT's")
        left_out = "mask_token (iBOT's, used in pretraining only)"
    head = {k for k in state if k.startswith("head.")}  # replaced by the fine-tune's
    nothing_else(state, keys | head | ({"mask_token"} if mask_token else set()))
    return Recognised(name, {k: state[k] for k in keys | head},
                      dinov3_arch(state, dim, depth, stem["patch_size"]), complete=complete, left_out=left_out)


# Meta's release files (dinov3/models/vision_transformer.py as hub/backbones.py builds it): storage_tokens,
# mask_token (1, D), the RoPE periods (a persistent buffer), blocks with ls1/ls2.gamma, one qkv.bias (3D) with its
# bias_mask (mask_k_bias: 1 on the query and value thirds, 0 on the key's), the MLP as fc1/fc2 or SwiGLU's w1 (gate),
# w2 (value), w3, the final norm; with untie_global_and_local_cls_norm (the 7B, some ViT-L) a local_cls_norm.
_META_SWIGLU = ("mlp.w1", "mlp.w2", "mlp.w3")
_META_OPTIONAL = ({"attn.qkv.bias"}, {"attn.qkv.bias_mask"}, {"ls1.gamma", "ls2.gamma"})
_META_NAMES = ((".ls1.gamma", ".gamma_1"), (".ls2.gamma", ".gamma_2"), (".mlp.w1.", ".mlp.fc1_g."),
               (".mlp.w2.", ".mlp.fc1_x."), (".mlp.w3.", ".mlp.fc2."))
ROPE_BASE = 100.0  # every released DINOv3 ViT's (and every variant's here: model.* has no key for another)


def meta_dinov3(state: dict[str, torch.Tensor]) -> Recognised:
    """Meta's DINOv3 backbone (`dinov3_vit*16_pretrain_*.pth`, the hub's `DinoVisionTransformer`), converted to
    DINOv3ViT's (timm's) names: storage_tokens -> reg_token, ls1/ls2.gamma -> gamma_1/gamma_2, w1/w2/w3 ->
    fc1_g/fc1_x/fc2, qkv.bias -> q_bias and v_bias (the key's third must be masked or zero: DINOv3ViT fixes it
    at 0). The heads come from the RoPE periods (head width / 4 of them), which must be base 100's. Left out:
    mask_token (iBOT's), local_cls_norm (the local crops' norm, training only), the periods and the mask."""
    if "pos_embed" in state:
        raise NotThis("it has pos_embed: a learned position table, not RoPE")
    stem, keys = read_stem(state, pos_embed=False)
    dim = stem["embed_dim"]
    periods = need(state, "rope_embed.periods", (None,), "(head width / 4,)").float()
    head_dim = 4 * len(periods)
    if not periods.numel() or dim % head_dim:
        raise NotThis(f"rope_embed.periods has {len(periods)} entries: heads of {head_dim} do not divide width {dim}")
    expected = ROPE_BASE ** (2 * torch.arange(len(periods), dtype=torch.float32) / (head_dim // 2))
    if not torch.allclose(periods, expected, rtol=1e-2):  # bf16 in the training configs' checkpoints
        raise NotThis(f"rope_embed.periods are not RoPE base {ROPE_BASE:g}'s (the released models' and the only one "
                      f"model.* builds)")
    depth, names = read_blocks(state, "blocks.", dim, mlps=(FC, _META_SWIGLU), optional=_META_OPTIONAL)
    keys |= set(names) | read_norm(state, "norm", dim) | {"rope_embed.periods"}
    if "cls_norm.weight" in state:
        raise NotThis("it has cls_norm (untie_cls_and_patch_norms): the class token's own final norm, which "
                      "DINOv3ViT does not have")
    if "storage_tokens" in state:
        need(state, "storage_tokens", (1, None, dim), f"(1, R, {dim})")
        keys.add("storage_tokens")
    left = [k for k in ("mask_token", "local_cls_norm.weight", "local_cls_norm.bias") if k in state]
    if "mask_token" in state:
        need(state, "mask_token", (1, dim), f"(1, {dim}), iBOT's")
    nothing_else(state, keys | set(left))
    out = {}
    for key in sorted(keys - {"rope_embed.periods"}):
        if key.endswith(".attn.qkv.bias_mask"):
            continue
        if key.endswith(".attn.qkv.bias"):
            out.update(_split_qkv_bias(state, key, dim))
            continue
        new = "reg_token" if key == "storage_tokens" else key
        for old, ours in _META_NAMES:
            new = new.replace(old, ours)
        out[new] = state[key]
    left_out = "mask_token (iBOT's), local_cls_norm (training only)" if left else ""
    return Recognised("Meta's DINOv3 backbone", out, dinov3_arch(out, dim, depth, stem["patch_size"],
                                                                 heads=dim // head_dim), complete=True, left_out=left_out)


def _split_qkv_bias(state: dict[str, torch.Tensor], key: str, dim: int) -> dict[str, torch.Tensor]:
    """qkv.bias (3D) -> attn.q_bias, attn.v_bias; the key's third must not act (masked by bias_mask, or zero)."""
    bias = state[key]
    mask = state.get(key + "_mask")
    if mask is not None:
        keeps = mask.float()
        if not (torch.all(keeps[dim:2 * dim] == 0) and torch.all(keeps[:dim] == 1) and torch.all(keeps[2 * dim:] == 1)):
            raise NotThis(f"{key}_mask is not mask_k_bias's (1 on the query and value thirds, 0 on the key's)")
    elif torch.any(bias[dim:2 * dim] != 0):
        raise NotThis(f"{key} has a key bias (mask_k_bias off), which DINOv3ViT fixes at 0")
    prefix = key[: -len("qkv.bias")]
    return {prefix + "q_bias": bias[:dim], prefix + "v_bias": bias[2 * dim:]}
