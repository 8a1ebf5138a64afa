"""Whose weights a state dict holds, recognised by its whole key signature, and the tensors of it that our
VisionTransformer loads (fine-tuning's `--from`, launch/export_weights.py).

Each layout is every key it has, with the shapes that tell them apart; a key more or one fewer and it is
not that layout:

  Meta's MAE pretraining checkpoint   facebookresearch/mae's MaskedAutoencoderViT (main_pretrain.py saves it
                                      as {'model': ...}): the encoder in timm's names (no LayerScale, no
                                      registers), and the decoder: mask_token (1, 1, Dd), decoder_embed,
                                      decoder_pos_embed, decoder_blocks.N.*, decoder_norm, decoder_pred
  Meta's DINOv2 backbone              facebookresearch/dinov2's DinoVisionTransformer (the released files;
                                      training checkpoints' chunked blocks.C.N.*, a teacher's backbone.*):
                                      mask_token (1, D), pos_embed with the class row, optional
                                      register_tokens, the MLP as fc1/fc2 or SwiGLU's w12/w3, no head
  timm's VisionTransformer            timm's names, with or without registers, LayerScale, head: no
                                      mask_token, no decoder (Meta's released mae_pretrain_vit_*.pth, which
                                      hold the encoder only, are in this layout)
  timm's DINOv3 ViT                   timm's Eva as vit_*_patch16_dinov3[_qkvb] saves it (our DINOv3ViT's
                                      names): no pos_embed (RoPE; timm does not save its periods),
                                      reg_token, blocks with gamma_1/gamma_2, attn.qkv.weight and optional
                                      attn.q_bias/v_bias, mlp.fc1/fc2 or SwiGLU's mlp.fc1_g/fc1_x/fc2
  Meta's DINOv3 backbone              facebookresearch/dinov3's released .pth (DinoVisionTransformer):
                                      storage_tokens, mask_token (1, D), rope_embed.periods, ls1/ls2.gamma,
                                      qkv.bias with its bias_mask, mlp.fc1/fc2 or SwiGLU's w1/w2/w3
                                      (layouts_dinov3.py converts it)
  ours                                a run directory's weights, or a safetensors file our trainer or
                                      launch/export_weights.py wrote (its metadata has a 'step'):
                                      VisionTransformer's names (a DINOv2 run's backbone adds iBOT's
                                      mask_token (1, D)), from an MAE run MaskedAutoencoderViT's, or DINOv3ViT's

The first five cannot match the same keys (mask_token's presence and shape, the decoder, pos_embed, the RoPE
periods and the block's names tell them apart);
ours names itself, since its DINOv2 backbones can hold exactly the keys of Meta's. A state dict that matches
none, or more than one, is refused in one line that says what each layout looked for.

What the file says of the architecture (patch, width, depth) is read from it; what it cannot say comes
from the fine-tune's config: the head count above all (Meta's MAE ViT-H/14 has 80-wide heads, our demos
other widths). Meta's DINOv2 backbones and the DINOv3 ViTs are the exception: all of Meta's models have 64-wide
heads (DINOv3's 7B 128-wide; Meta's DINOv3 files say it: their RoPE periods), so the file decides the whole
architecture (`Recognised.complete`). The parts every reader is made of are layout_parts.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline.model.layout_parts import (  # noqa: F401 (LayoutError, Recognised: re-exported)
    FC,
    W12,
    LayoutError,
    NotThis,
    Recognised,
    encoder_arch,
    need,
    nothing_else,
    read_blocks,
    read_norm,
    read_stem,
)
from pipeline.model.layouts_dinov3 import meta_dinov3, timm_dinov3
from pipeline.model.weights import WeightsError


@dataclass(frozen=True)
class Layout:
    name: str
    looks_for: str  # the signature in a few words, for the refusal
    read: Callable[[dict[str, torch.Tensor]], Recognised]  # raises NotThis when the state dict is not this one


def recognise(state: dict[str, torch.Tensor], source: str = "state dict", ours: bool = False) -> Recognised:
    """The one layout `state` is in, converted to ours. `ours`: the state dict comes from one of our runs
    (a run directory, or a file whose metadata our exports write). Raises LayoutError when no layout, or more
    than one, matches."""
    candidates = [OURS] if ours else list(LAYOUTS)
    found, why = {}, []
    for layout in candidates:
        try:
            found[layout.name] = layout.read(state)
        except NotThis as e:
            why.append(f"{layout.name} ({layout.looks_for}): {e}")
    if len(found) == 1:
        return next(iter(found.values()))
    held = f"it holds {len(state)} tensors, the first: {', '.join(sorted(state)[:5]) or 'none'}"
    if not found:
        raise LayoutError(f"{source}: weights in no layout known here; looked for " + "; ".join(why) + f"; {held}")
    raise LayoutError(f"{source}: its keys match {' and '.join(found)} alike, which read them differently; {held}")

# ----------------------------------------------------------------------------- the layouts


def _meta_mae(state: dict[str, torch.Tensor], tables: bool = True, name: str = "Meta's MAE pretraining checkpoint"
              ) -> Recognised:
    """MaskedAutoencoderViT (models_mae.py): the encoder, then the decoder. `tables`: the fixed sin-cos tables
    pos_embed and decoder_pos_embed are there (an MAE run's checkpoint, consolidated, holds parameters only)."""
    stem, keys = read_stem(state, pos_embed=tables)
    dim = stem["embed_dim"]
    depth, names = read_blocks(state, "blocks.", dim, layer_scale=False)
    keys |= read_norm(state, "norm", dim) | set(names)
    encoder = {k: state[k] for k in keys}
    dec = need(state, "mask_token", (1, 1, None), "(1, 1, Dd), MAE's decoder's").shape[-1]
    need(state, "decoder_embed.weight", (dec, dim), f"({dec}, {dim})")
    need(state, "decoder_embed.bias", (dec,), f"({dec},)")
    if tables or "decoder_pos_embed" in state:  # a row per token, as pos_embed
        rows = stem["pos_rows"]
        need(state, "decoder_pos_embed", (1, rows, dec), f"(1, {rows or 'T'}, {dec})")
    dec_depth, dec_names = read_blocks(state, "decoder_blocks.", dec, layer_scale=False)
    patch_pixels = stem["patch_size"] ** 2 * stem["in_chans"]
    need(state, "decoder_pred.weight", (patch_pixels, dec), f"({patch_pixels}, {dec}): P*P*C pixels per patch")
    need(state, "decoder_pred.bias", (patch_pixels,), f"({patch_pixels},)")
    dropped = {"mask_token", "decoder_embed.weight", "decoder_embed.bias", "decoder_pos_embed", "decoder_pred.weight",
               "decoder_pred.bias", *dec_names} | read_norm(state, "decoder_norm", dec)
    nothing_else(state, keys | dropped)
    return Recognised(name, encoder, encoder_arch(stem, depth),
                      left_out=f"the decoder (depth {dec_depth}, width {dec}) and its mask_token")


def _meta_dinov2(state: dict[str, torch.Tensor]) -> Recognised:
    """DinoVisionTransformer (dinov2/models/vision_transformer.py), or a training checkpoint's teacher
    ({'teacher': ...}, unwrapped by load_weights: backbone.* beside dino_head.* and ibot_head.*)."""
    left_out = ["mask_token"]
    if "backbone.cls_token" in state:
        heads = sorted({k.split(".")[0] for k in state if not k.startswith("backbone.")})
        if set(heads) - {"dino_head", "ibot_head"}:
            raise NotThis(f"backbone.* beside {', '.join(heads)}, not only a teacher's dino_head and ibot_head")
        if heads:
            left_out.append("the teacher's " + " and ".join(heads))
        state = {k[len("backbone."):]: v for k, v in state.items() if k.startswith("backbone.")}
    stem, keys = read_stem(state)
    dim = stem["embed_dim"]
    need(state, "mask_token", (1, dim), f"(1, {dim}), DINOv2's")
    if "register_tokens" in state:
        need(state, "register_tokens", (1, None, dim), f"(1, R, {dim})")
    _, names = read_blocks(state, "blocks.", dim, mlps=(FC, W12), chunked=True)
    nothing_else(state, keys | {"mask_token", "register_tokens"} | read_norm(state, "norm", dim) | set(names))
    converted, kwargs = convert_dinov2_state_dict(state)
    return Recognised("Meta's DINOv2 backbone", converted, kwargs, complete=True, left_out=" and ".join(left_out))


def _timm(state: dict[str, torch.Tensor], mask_token: bool = False, name: str = "timm's VisionTransformer"
          ) -> Recognised:
    """timm's VisionTransformer with a class token (our VisionTransformer's names): registers, LayerScale,
    SwiGLU (packed fc1), the final norm or fc_norm (global_pool='avg'), a head of any shape. `mask_token`:
    iBOT's (1, D) too, as our DINOv2 runs' backbones have it."""
    stem, keys = read_stem(state)
    dim = stem["embed_dim"]
    if "reg_token" in state:
        need(state, "reg_token", (1, None, dim), f"(1, R, {dim})")
        keys.add("reg_token")
    depth, names = read_blocks(state, "blocks.", dim)
    keys |= set(names)
    norms = [n for n in ("norm", "fc_norm") if f"{n}.weight" in state]
    if not norms:
        raise NotThis("no norm.weight or fc_norm.weight")
    for n in norms:
        keys |= read_norm(state, n, dim)
    left_out = ""
    if mask_token and "mask_token" in state:
        need(state, "mask_token", (1, dim), f"(1, {dim}), iBOT's")
        left_out = "mask_token (iBOT's, used in pretraining only)"
    head = {k for k in state if k.startswith(("head.", "pre_logits."))}  # replaced by the fine-tune's
    nothing_else(state, keys | head | ({"mask_token"} if mask_token else set()))
    return Recognised(name, {k: state[k] for k in keys | head}, encoder_arch(stem, depth), left_out=left_out)


# The names of our own layouts, by the model whose names they are (a recipe's read-back says which it exports).
OURS_VIT, OURS_MAE, OURS_DINOV3 = ("ours (VisionTransformer's names)", "ours (an MAE run's MaskedAutoencoderViT)",
                                   "ours (DINOv3ViT's names)")


def _ours(state: dict[str, torch.Tensor]) -> Recognised:
    try:
        return _timm(state, mask_token=True, name=OURS_VIT)
    except NotThis as vit:
        try:
            return _meta_mae(state, tables=False, name=OURS_MAE)
        except NotThis as mae:
            try:
                return timm_dinov3(state, mask_token=True, name=OURS_DINOV3, complete=False)
            except NotThis as v3:
                raise NotThis(f"VisionTransformer's names: {vit}; MaskedAutoencoderViT's: {mae}; "
                              f"DINOv3ViT's: {v3}") from None


LAYOUTS = (
    Layout("Meta's MAE pretraining checkpoint", "an encoder in timm's names with mask_token (1, 1, Dd), "
           "decoder_embed, decoder_pos_embed, decoder_blocks.N.*, decoder_norm, decoder_pred", _meta_mae),
    Layout("Meta's DINOv2 backbone", "patch_embed, cls_token, pos_embed, mask_token (1, D), optional register_tokens, "
           "blocks.N.* or blocks.C.N.* with mlp.fc1/fc2 or mlp.w12/w3, norm; no head", _meta_dinov2),
    Layout("timm's VisionTransformer", "patch_embed, cls_token, pos_embed, optional reg_token, blocks.N.*, norm or "
           "fc_norm, optional head; no mask_token, no decoder", _timm),
    Layout("timm's DINOv3 ViT", "patch_embed, cls_token, optional reg_token, no pos_embed, blocks.N.* with "
           "attn.qkv.weight, optional attn.q_bias/v_bias and gamma_1/gamma_2, mlp.fc1/fc2 or mlp.fc1_g/fc1_x/fc2, "
           "norm, optional head", timm_dinov3),
    Layout("Meta's DINOv3 backbone", "patch_embed, cls_token, storage_tokens, mask_token (1, D), rope_embed.periods, "
           "blocks.N.* with ls1/ls2.gamma, attn.qkv.bias and bias_mask, mlp.fc1/fc2 or mlp.w1/w2/w3, norm, optional "
           "local_cls_norm; no head", meta_dinov3),
)
OURS = Layout("ours", "VisionTransformer's keys, with mask_token (1, D) for a DINOv2 backbone, "
              "MaskedAutoencoderViT's, or DINOv3ViT's", _ours)
OURS_METADATA = "step"  # what our trainer and launch/export_weights.py write into every model.safetensors


def is_ours(metadata: dict[str, str]) -> bool:
    """Whether a safetensors file's metadata says one of our runs wrote it."""
    return OURS_METADATA in metadata


# ----------------------------------------------------------------------------- Meta's DINOv2 conversion

_META_CHUNKED = re.compile(r"^blocks\.\d+\.(\d+)\.")  # training checkpoints' BlockChunk layout: blocks.CHUNK.I.
_META_BLOCK = re.compile(r"^blocks\.(\d+)\.")


def convert_dinov2_state_dict(state: dict[str, torch.Tensor], keep_mask_token: bool = False,
                              source: str = "state dict") -> tuple[dict[str, torch.Tensor], dict]:
    """Meta's DINOv2 backbone -> (our/timm state dict, our VisionTransformer's constructor arguments).

    The architecture is read from the tensors: width from cls_token, patch size from the projection's
    kernel, depth from the block indices, LayerScale from ls1.gamma, registers from register_tokens, the
    MLP from w12 (SwiGLU) or fc1, the grid (hence img_size; 37x37 x 14 = 518 for the released files) from
    pos_embed. The head count is not stored; Meta's models all have 64-wide heads (S 6, B 12, L 16, g 24).
    Layout, as timm's _convert_dinov2: with registers, Meta adds pos_embed[0] to the class token and
    inserts the registers after the positions, so the class token's row is folded into cls_token and the
    table covers the patches only (no_embed_class); without, pos_embed keeps its class row. w12/w3 become
    fc1/fc2 (SwiGLUPacked). mask_token (training only) is dropped unless `keep_mask_token`.
    """
    state = {_META_CHUNKED.sub(r"blocks.\1.", k): v for k, v in state.items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        key = key.replace(".mlp.w12.", ".mlp.fc1.").replace(".mlp.w3.", ".mlp.fc2.")
        out[key] = value
    mask_token = out.pop("mask_token", None)
    if keep_mask_token and mask_token is not None:
        out["mask_token"] = mask_token.reshape(1, -1)
    cls = out["cls_token"]
    if cls.ndim != 3 or cls.shape[:2] != (1, 1):
        raise WeightsError(f"{source}: cls_token has shape {tuple(cls.shape)}, expected (1, 1, D) as in Meta's DINOv2")
    dim = cls.shape[-1]
    proj = out.get("patch_embed.proj.weight")
    if proj is None or proj.ndim != 4:
        raise WeightsError(f"{source}: no patch_embed.proj.weight (D, C, P, P), as Meta's DINOv2 backbones have")
    patch = proj.shape[-1]
    blocks = sorted({int(m.group(1)) for k in out if (m := _META_BLOCK.match(k))})
    if not blocks or blocks != list(range(len(blocks))):
        raise WeightsError(f"{source}: blocks.N.* keys are missing or not numbered 0..depth-1")
    pos = out["pos_embed"]
    reg_tokens = 0
    if "register_tokens" in out:
        reg = out.pop("register_tokens")
        reg_tokens = reg.shape[1]
        out["reg_token"] = reg
        out["cls_token"] = cls + pos[:, :1]
        out["pos_embed"] = pos = pos[:, 1:]
        grid_tokens = pos.shape[1]
    else:
        grid_tokens = pos.shape[1] - 1
    side = int(round(grid_tokens ** 0.5))
    if side * side != grid_tokens:
        raise WeightsError(f"{source}: pos_embed has {grid_tokens} patch rows, not a square grid")
    swiglu = "blocks.0.mlp.fc1.weight" in out and any(k.endswith(".mlp.w12.weight") for k in state)
    hidden = out["blocks.0.mlp.fc1.weight"].shape[0]
    kwargs = dict(
        img_size=side * patch, patch_size=patch, in_chans=proj.shape[1], embed_dim=dim, depth=len(blocks),
        num_heads=max(dim // 64, 1), mlp_ratio=hidden / dim, qkv_bias="blocks.0.attn.qkv.bias" in out,
        # The value only seeds a fresh model: a loaded file overwrites every gamma.
        init_values=1e-5 if "blocks.0.ls1.gamma" in out else None,
        reg_tokens=reg_tokens, no_embed_class=reg_tokens > 0, mlp_layer="swiglu" if swiglu else "mlp",
    )
    return out, kwargs
