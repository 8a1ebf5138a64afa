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
  ours                                a run directory's weights, or a safetensors file our trainer or
                                      launch/export_weights.py wrote (its metadata has a 'step'):
                                      VisionTransformer's names (a DINOv2 run's backbone adds iBOT's
                                      mask_token (1, D)), from an MAE run MaskedAutoencoderViT's, or DINOv3ViT's

The first four cannot match the same keys (mask_token's presence and shape, the decoder, pos_embed and the
block's names tell them apart);
ours names itself, since its DINOv2 backbones can hold exactly the keys of Meta's. A state dict that matches
none, or more than one, is refused in one line that says what each layout looked for.

What the file says of the architecture (patch, width, depth) is read from it; what it cannot say comes
from the fine-tune's config: the head count above all (Meta's MAE ViT-H/14 has 80-wide heads, our demos
other widths). Meta's DINOv2 backbones and the DINOv3 ViTs are the exception: all of Meta's models have 64-wide
heads (DINOv3's 7B 128-wide), so the file decides the whole architecture (`Recognised.complete`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline.model.weights import WeightsError


class LayoutError(WeightsError):
    """A state dict in no layout, or in several: the message names the source and what each looked for."""


@dataclass
class Recognised:
    layout: str  # the layout's name, for messages
    state: dict[str, torch.Tensor]  # the encoder in our VisionTransformer's names and layout (a head kept)
    arch: dict  # what the file says: patch_size, embed_dim, depth; all constructor arguments when complete
    complete: bool = False  # the file decides the whole architecture, heads included (Meta's DINOv2)
    left_out: str = ""  # what the file holds that is not loaded ("the decoder ... and its mask_token")

    def mismatch(self, kwargs: dict) -> str | None:
        """What of the file's architecture the model's constructor arguments contradict, or None."""
        keys = ("patch_size", "embed_dim", "depth")
        if all(self.arch[k] == kwargs[k] for k in keys):
            return None
        return (f"the file's encoder is patch {self.arch['patch_size']}, width {self.arch['embed_dim']}, depth "
                f"{self.arch['depth']}; the config's model is patch {kwargs['patch_size']}, width {kwargs['embed_dim']}, "
                f"depth {kwargs['depth']}: set model.patch_size, model.embed_dim, model.depth (and model.num_heads, "
                f"which the file does not say) to the file's, or pick the model.variant it was trained as")

    def describe(self) -> str:
        """One phrase for the log: what was read, and what was left out."""
        a = self.arch
        said = f"patch {a['patch_size']}, width {a['embed_dim']}, depth {a['depth']}"
        return f"{self.layout}, {said}" + (f"; left out: {self.left_out}" if self.left_out else "")


class _NotThis(Exception):
    """Why a state dict is not one layout: a clause of the refusal."""


@dataclass(frozen=True)
class Layout:
    name: str
    looks_for: str  # the signature in a few words, for the refusal
    read: Callable[[dict[str, torch.Tensor]], Recognised]  # raises _NotThis when the state dict is not this one


def recognise(state: dict[str, torch.Tensor], source: str = "state dict", ours: bool = False) -> Recognised:
    """The one layout `state` is in, converted to ours. `ours`: the state dict comes from one of our runs
    (a run directory, or a file whose metadata our exports write). Raises LayoutError when no layout, or more
    than one, matches."""
    candidates = [OURS] if ours else list(LAYOUTS)
    found, why = {}, []
    for layout in candidates:
        try:
            found[layout.name] = layout.read(state)
        except _NotThis as e:
            why.append(f"{layout.name} ({layout.looks_for}): {e}")
    if len(found) == 1:
        return next(iter(found.values()))
    held = f"it holds {len(state)} tensors, the first: {', '.join(sorted(state)[:5]) or 'none'}"
    if not found:
        raise LayoutError(f"{source}: weights in no layout known here; looked for " + "; ".join(why) + f"; {held}")
    raise LayoutError(f"{source}: its keys match {' and '.join(found)} alike, which read them differently; {held}")


# ----------------------------------------------------------------------------- the parts of a ViT

# One transformer block in timm's names (timm's Block, which MAE's encoder and decoder are, and ours is): two
# norms, attention and an MLP; a qkv bias and LayerScale are options. Meta's DINOv2 names SwiGLU's MLP w12/w3.
_BLOCK = {"norm1.weight", "norm1.bias", "attn.qkv.weight", "attn.proj.weight", "attn.proj.bias", "norm2.weight",
          "norm2.bias"}
_FC, _W12 = ("mlp.fc1", "mlp.fc2"), ("mlp.w12", "mlp.w3")
_QKV_BIAS, _LAYER_SCALE = "attn.qkv.bias", {"ls1.gamma", "ls2.gamma"}


def _need(state: dict[str, torch.Tensor], key: str, shape: tuple, shown: str) -> torch.Tensor:
    """state[key], whose shape is `shape` (None: any size there), or _NotThis naming it (`shown`: '(1, 1, D)')."""
    if key not in state:
        raise _NotThis(f"no {key}")
    t = state[key]
    if t.ndim != len(shape) or any(want is not None and want != got for want, got in zip(shape, t.shape)):
        raise _NotThis(f"{key} is {tuple(t.shape)}, not {shown}")
    return t


def _blocks(state: dict[str, torch.Tensor], prefix: str, dim: int, mlps: tuple = (_FC,), chunked: bool = False,
            layer_scale: bool = True, optional: tuple[set[str], ...] | None = None) -> tuple[int, dict[str, str]]:
    """The blocks under `prefix` ('blocks.', 'decoder_blocks.'), all with the same keys, numbered 0..depth-1:
    (depth, {file key: blocks.I.suffix}). `chunked`: Meta's BlockChunk layout, prefix.CHUNK.I.suffix (I counts
    across the chunks). `optional`: the groups of keys a block may have, each all or none (default: the qkv
    bias, and LayerScale's gammas where `layer_scale`)."""
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)\.(?:(\d+)\.)?(.+)$")
    by_block: dict[int, set[str]] = {}
    names: dict[str, str] = {}
    kinds = set()
    for key in state:
        if not key.startswith(prefix):
            continue
        m = pattern.match(key)
        if not m or (m.group(2) is not None and not chunked):
            raise _NotThis(f"{key} is not {prefix}N.*")
        kinds.add(m.group(2) is not None)
        index = int(m.group(2) if m.group(2) is not None else m.group(1))
        by_block.setdefault(index, set()).add(m.group(3))
        names[key] = f"blocks.{index}.{m.group(3)}"
    if not by_block:
        raise _NotThis(f"no {prefix}N.*")
    if len(kinds) > 1:
        raise _NotThis(f"{prefix}* mixes chunked and flat keys")
    depth = len(by_block)
    if sorted(by_block) != list(range(depth)):
        raise _NotThis(f"{prefix}N.* not numbered 0..{depth - 1}")
    first = by_block[0]
    odd = next((i for i in range(depth) if by_block[i] != first), None)
    if odd is not None:
        raise _NotThis(f"{prefix}{odd}.* and {prefix}0.* have different keys")
    mlp = next((m for m in mlps if f"{m[0]}.weight" in first), None)
    if mlp is None:
        raise _NotThis(f"no {prefix}0.{mlps[0][0]}.weight" + (f" or {mlps[1][0]}.weight" if len(mlps) > 1 else ""))
    expected = _BLOCK | {f"{n}.{p}" for n in mlp for p in ("weight", "bias")}
    if optional is None:
        optional = ({_QKV_BIAS},) + ((_LAYER_SCALE,) if layer_scale else ())
    missing, extra = sorted(expected - first), sorted(first - expected - set().union(*optional))
    if missing or extra:
        raise _NotThis(f"{prefix}0.* " + ", ".join(
            ([f"lacks {', '.join(missing[:3])}"] if missing else []) + ([f"has {', '.join(extra[:3])}"] if extra else [])))
    for group in optional:
        if 0 < len(first & group) < len(group):
            raise _NotThis(f"{prefix}0.* has {', '.join(sorted(first & group))} without {', '.join(sorted(group - first))}")
    qkv = state[next(k for k, v in names.items() if v == "blocks.0.attn.qkv.weight")]
    if tuple(qkv.shape) != (3 * dim, dim):
        raise _NotThis(f"{prefix}0.attn.qkv.weight is {tuple(qkv.shape)}, not ({3 * dim}, {dim})")
    return depth, names


def _stem(state: dict[str, torch.Tensor], pos_embed: bool = True) -> tuple[dict, set[str]]:
    """Width, channels and patch from patch_embed.proj (D, C, P, P), with cls_token (1, 1, D) and pos_embed
    (1, T, D) beside it: (the architecture, the keys)."""
    proj = _need(state, "patch_embed.proj.weight", (None, None, None, None), "(D, C, P, P)")
    dim, chans, ph, pw = proj.shape
    if ph != pw:
        raise _NotThis(f"patch_embed.proj.weight is {tuple(proj.shape)}: a non-square patch")
    _need(state, "patch_embed.proj.bias", (dim,), f"({dim},)")
    _need(state, "cls_token", (1, 1, dim), f"(1, 1, {dim})")
    keys = {"patch_embed.proj.weight", "patch_embed.proj.bias", "cls_token"}
    pos_rows = None
    if pos_embed or "pos_embed" in state:
        pos_rows = _need(state, "pos_embed", (1, None, dim), f"(1, T, {dim})").shape[1]
        keys.add("pos_embed")
    return dict(patch_size=ph, in_chans=chans, embed_dim=dim, pos_rows=pos_rows), keys


def _norm(state: dict[str, torch.Tensor], name: str, dim: int) -> set[str]:
    _need(state, f"{name}.weight", (dim,), f"({dim},)")
    _need(state, f"{name}.bias", (dim,), f"({dim},)")
    return {f"{name}.weight", f"{name}.bias"}


def _nothing_else(state: dict[str, torch.Tensor], accounted: set[str]) -> None:
    extra = sorted(set(state) - accounted)
    if extra:
        raise _NotThis(f"{len(extra)} keys not in it ({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''})")


def _arch(stem: dict, depth: int) -> dict:
    """What the file says of the architecture and `Recognised.mismatch` checks, in our constructor's names. The
    rest (registers, LayerScale, the MLP, qkv bias) the load checks by name and shape."""
    return dict(patch_size=stem["patch_size"], embed_dim=stem["embed_dim"], depth=depth)


# ----------------------------------------------------------------------------- the layouts


def _meta_mae(state: dict[str, torch.Tensor], tables: bool = True, name: str = "Meta's MAE pretraining checkpoint"
              ) -> Recognised:
    """MaskedAutoencoderViT (models_mae.py): the encoder, then the decoder. `tables`: the fixed sin-cos tables
    pos_embed and decoder_pos_embed are there (an MAE run's checkpoint, consolidated, holds parameters only)."""
    stem, keys = _stem(state, pos_embed=tables)
    dim = stem["embed_dim"]
    depth, names = _blocks(state, "blocks.", dim, layer_scale=False)
    keys |= _norm(state, "norm", dim) | set(names)
    encoder = {k: state[k] for k in keys}
    dec = _need(state, "mask_token", (1, 1, None), "(1, 1, Dd), MAE's decoder's").shape[-1]
    _need(state, "decoder_embed.weight", (dec, dim), f"({dec}, {dim})")
    _need(state, "decoder_embed.bias", (dec,), f"({dec},)")
    if tables or "decoder_pos_embed" in state:  # a row per token, as pos_embed
        rows = stem["pos_rows"]
        _need(state, "decoder_pos_embed", (1, rows, dec), f"(1, {rows or 'T'}, {dec})")
    dec_depth, dec_names = _blocks(state, "decoder_blocks.", dec, layer_scale=False)
    patch_pixels = stem["patch_size"] ** 2 * stem["in_chans"]
    _need(state, "decoder_pred.weight", (patch_pixels, dec), f"({patch_pixels}, {dec}): P*P*C pixels per patch")
    _need(state, "decoder_pred.bias", (patch_pixels,), f"({patch_pixels},)")
    dropped = {"mask_token", "decoder_embed.weight", "decoder_embed.bias", "decoder_pos_embed", "decoder_pred.weight",
               "decoder_pred.bias", *dec_names} | _norm(state, "decoder_norm", dec)
    _nothing_else(state, keys | dropped)
    return Recognised(name, encoder, _arch(stem, depth),
                      left_out=f"the decoder (depth {dec_depth}, width {dec}) and its mask_token")


def _meta_dinov2(state: dict[str, torch.Tensor]) -> Recognised:
    """DinoVisionTransformer (dinov2/models/vision_transformer.py), or a training checkpoint's teacher
    ({'teacher': ...}, unwrapped by load_weights: backbone.* beside dino_head.* and ibot_head.*)."""
    left_out = ["mask_token"]
    if "backbone.cls_token" in state:
        heads = sorted({k.split(".")[0] for k in state if not k.startswith("backbone.")})
        if set(heads) - {"dino_head", "ibot_head"}:
            raise _NotThis(f"backbone.* beside {', '.join(heads)}, not only a teacher's dino_head and ibot_head")
        if heads:
            left_out.append("the teacher's " + " and ".join(heads))
        state = {k[len("backbone."):]: v for k, v in state.items() if k.startswith("backbone.")}
    stem, keys = _stem(state)
    dim = stem["embed_dim"]
    _need(state, "mask_token", (1, dim), f"(1, {dim}), DINOv2's")
    if "register_tokens" in state:
        _need(state, "register_tokens", (1, None, dim), f"(1, R, {dim})")
    _, names = _blocks(state, "blocks.", dim, mlps=(_FC, _W12), chunked=True)
    _nothing_else(state, keys | {"mask_token", "register_tokens"} | _norm(state, "norm", dim) | set(names))
    converted, kwargs = convert_dinov2_state_dict(state)
    return Recognised("Meta's DINOv2 backbone", converted, kwargs, complete=True, left_out=" and ".join(left_out))


def _timm(state: dict[str, torch.Tensor], mask_token: bool = False, name: str = "timm's VisionTransformer"
          ) -> Recognised:
    """timm's VisionTransformer with a class token (our VisionTransformer's names): registers, LayerScale,
    SwiGLU (packed fc1), the final norm or fc_norm (global_pool='avg'), a head of any shape. `mask_token`:
    iBOT's (1, D) too, as our DINOv2 runs' backbones have it."""
    stem, keys = _stem(state)
    dim = stem["embed_dim"]
    if "reg_token" in state:
        _need(state, "reg_token", (1, None, dim), f"(1, R, {dim})")
        keys.add("reg_token")
    depth, names = _blocks(state, "blocks.", dim)
    keys |= set(names)
    norms = [n for n in ("norm", "fc_norm") if f"{n}.weight" in state]
    if not norms:
        raise _NotThis("no norm.weight or fc_norm.weight")
    for n in norms:
        keys |= _norm(state, n, dim)
    left_out = ""
    if mask_token and "mask_token" in state:
        _need(state, "mask_token", (1, dim), f"(1, {dim}), iBOT's")
        left_out = "mask_token (iBOT's, used in pretraining only)"
    head = {k for k in state if k.startswith(("head.", "pre_logits."))}  # replaced by the fine-tune's
    _nothing_else(state, keys | head | ({"mask_token"} if mask_token else set()))
    return Recognised(name, {k: state[k] for k in keys | head}, _arch(stem, depth), left_out=left_out)


# ----------------------------------------------------------------------------- DINOv3 (pipeline/model/dinov3.py)

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


def _timm_dinov3(state: dict[str, torch.Tensor], mask_token: bool = False, name: str = "timm's DINOv3 ViT",
                 complete: bool = True) -> Recognised:
    """timm's Eva as `vit_*_patch16_dinov3[_qkvb]` saves it (our DINOv3ViT's names): no position table (RoPE, whose
    periods timm does not save), reg_token, the Eva block, the final norm, a head of any shape or none.
    `mask_token`: iBOT's (1, D) too, as a DINOv3 run's backbone may have it. `complete`: the file decides the
    architecture (not for ours, whose run's config does, heads included)."""
    if "pos_embed" in state:
        raise _NotThis("it has pos_embed: a learned position table, not RoPE")
    stem, keys = _stem(state, pos_embed=False)
    dim = stem["embed_dim"]
    if "reg_token" in state:
        _need(state, "reg_token", (1, None, dim), f"(1, R, {dim})")
        keys.add("reg_token")
    depth, names = _blocks(state, "blocks.", dim, mlps=(_FC, _SWIGLU_SPLIT), optional=_EVA_OPTIONAL)
    keys |= set(names) | _norm(state, "norm", dim)
    left_out = ""
    if mask_token and "mask_token" in state:
        _need(state, "mask_token", (1, dim), f"(1, {dim}), iBOT's")
        left_out = "mask_token (iBOT's, used in pretraining only)"
    head = {k for k in state if k.startswith("head.")}  # replaced by the fine-tune's
    _nothing_else(state, keys | head | ({"mask_token"} if mask_token else set()))
    return Recognised(name, {k: state[k] for k in keys | head},
                      dinov3_arch(state, dim, depth, stem["patch_size"]), complete=complete, left_out=left_out)


def _ours(state: dict[str, torch.Tensor]) -> Recognised:
    try:
        return _timm(state, mask_token=True, name="ours (VisionTransformer's names)")
    except _NotThis as vit:
        try:
            return _meta_mae(state, tables=False, name="ours (an MAE run's MaskedAutoencoderViT)")
        except _NotThis as mae:
            try:
                return _timm_dinov3(state, mask_token=True, name="ours (DINOv3ViT's names)", complete=False)
            except _NotThis as v3:
                raise _NotThis(f"VisionTransformer's names: {vit}; MaskedAutoencoderViT's: {mae}; "
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
           "norm, optional head", _timm_dinov3),
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
