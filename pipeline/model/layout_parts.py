"""The parts the layout readers (pipeline/model/layouts.py, layouts_dinov3.py) are made of: what a reader returns
(`Recognised`), how it says no (`NotThis`, a clause of the refusal), and the pieces of a ViT's state dict every
layout has in some form (the stem, the blocks, a norm), each read with its shapes checked.
"""

from __future__ import annotations

import re
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
        stems = self.arch.get("stem", "patch"), kwargs.get("stem", "patch")
        if stems[0] != stems[1]:
            return f"the file's encoder has stem '{stems[0]}', the config's model '{stems[1]}': set model.stem={stems[0]}"
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


class NotThis(Exception):
    """Why a state dict is not one layout: a clause of the refusal."""


# One transformer block in timm's names (timm's Block, which MAE's encoder and decoder are, and ours is): two
# norms, attention and an MLP; a qkv bias and LayerScale are options. Meta's DINOv2 names SwiGLU's MLP w12/w3.
BLOCK = {"norm1.weight", "norm1.bias", "attn.qkv.weight", "attn.proj.weight", "attn.proj.bias", "norm2.weight",
         "norm2.bias"}
FC, W12 = ("mlp.fc1", "mlp.fc2"), ("mlp.w12", "mlp.w3")
QKV_BIAS, LAYER_SCALE = "attn.qkv.bias", {"ls1.gamma", "ls2.gamma"}


def need(state: dict[str, torch.Tensor], key: str, shape: tuple, shown: str) -> torch.Tensor:
    """state[key], whose shape is `shape` (None: any size there), or NotThis naming it (`shown`: '(1, 1, D)')."""
    if key not in state:
        raise NotThis(f"no {key}")
    t = state[key]
    if t.ndim != len(shape) or any(want is not None and want != got for want, got in zip(shape, t.shape)):
        raise NotThis(f"{key} is {tuple(t.shape)}, not {shown}")
    return t


def read_blocks(state: dict[str, torch.Tensor], prefix: str, dim: int, mlps: tuple = (FC,), chunked: bool = False,
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
            raise NotThis(f"{key} is not {prefix}N.*")
        kinds.add(m.group(2) is not None)
        index = int(m.group(2) if m.group(2) is not None else m.group(1))
        by_block.setdefault(index, set()).add(m.group(3))
        names[key] = f"blocks.{index}.{m.group(3)}"
    if not by_block:
        raise NotThis(f"no {prefix}N.*")
    if len(kinds) > 1:
        raise NotThis(f"{prefix}* mixes chunked and flat keys")
    depth = len(by_block)
    if sorted(by_block) != list(range(depth)):
        raise NotThis(f"{prefix}N.* not numbered 0..{depth - 1}")
    first = by_block[0]
    odd = next((i for i in range(depth) if by_block[i] != first), None)
    if odd is not None:
        raise NotThis(f"{prefix}{odd}.* and {prefix}0.* have different keys")
    mlp = next((m for m in mlps if f"{m[0]}.weight" in first), None)
    if mlp is None:
        raise NotThis(f"no {prefix}0.{mlps[0][0]}.weight" + (f" or {mlps[1][0]}.weight" if len(mlps) > 1 else ""))
    expected = BLOCK | {f"{n}.{p}" for n in mlp for p in ("weight", "bias")}
    if optional is None:
        optional = ({QKV_BIAS},) + ((LAYER_SCALE,) if layer_scale else ())
    missing, extra = sorted(expected - first), sorted(first - expected - set().union(*optional))
    if missing or extra:
        raise NotThis(f"{prefix}0.* " + ", ".join(
            ([f"lacks {', '.join(missing[:3])}"] if missing else []) + ([f"has {', '.join(extra[:3])}"] if extra else [])))
    for group in optional:
        if 0 < len(first & group) < len(group):
            raise NotThis(f"{prefix}0.* has {', '.join(sorted(first & group))} without {', '.join(sorted(group - first))}")
    qkv = state[next(k for k, v in names.items() if v == "blocks.0.attn.qkv.weight")]
    if tuple(qkv.shape) != (3 * dim, dim):
        raise NotThis(f"{prefix}0.attn.qkv.weight is {tuple(qkv.shape)}, not ({3 * dim}, {dim})")
    return depth, names


def read_stem(state: dict[str, torch.Tensor], pos_embed: bool = True) -> tuple[dict, set[str]]:
    """Width, channels and patch from patch_embed.proj (D, C, P, P), with cls_token (1, 1, D) and pos_embed
    (1, T, D) beside it: (the architecture, the keys)."""
    if "patch_embed.proj.weight" not in state and "patch_embed.proj.0.weight" in state:
        arch, keys = read_conv_stem(state)
        dim = arch["embed_dim"]
    else:
        proj = need(state, "patch_embed.proj.weight", (None, None, None, None), "(D, C, P, P)")
        dim, chans, ph, pw = proj.shape
        if ph != pw:
            raise NotThis(f"patch_embed.proj.weight is {tuple(proj.shape)}: a non-square patch")
        need(state, "patch_embed.proj.bias", (dim,), f"({dim},)")
        arch, keys = dict(patch_size=ph, in_chans=chans, embed_dim=dim), {"patch_embed.proj.weight",
                                                                          "patch_embed.proj.bias"}
    need(state, "cls_token", (1, 1, dim), f"(1, 1, {dim})")
    keys.add("cls_token")
    pos_rows = None
    if pos_embed or "pos_embed" in state:
        pos_rows = need(state, "pos_embed", (1, None, dim), f"(1, T, {dim})").shape[1]
        keys.add("pos_embed")
    return dict(arch, pos_rows=pos_rows), keys


def read_conv_stem(state: dict[str, torch.Tensor]) -> tuple[dict, set[str]]:
    """layers.ConvStem as saved: patch_embed.proj.{3i} 3x3 convolutions (no bias), each with its LayerNorm2d at
    {3i+1}, then a 1x1 convolution (D, c, 1, 1) with its bias; the patch is 2 to the number of stride-2 3x3s."""
    convs = []
    while f"patch_embed.proj.{3 * len(convs)}.weight" in state:
        convs.append(state[f"patch_embed.proj.{3 * len(convs)}.weight"])
    threes = convs[:-1]  # the last is the 1x1, read below
    if len(threes) < 2:
        raise NotThis(f"patch_embed.proj.* holds {len(convs)} convolutions, not a conv stem's 3x3s and its 1x1")
    keys, chans = set(), threes[0].shape[1]
    for i, w in enumerate(threes):
        need(state, f"patch_embed.proj.{3 * i}.weight", (None, chans, 3, 3), f"(c, {chans}, 3, 3)")
        keys |= {f"patch_embed.proj.{3 * i}.weight"} | read_norm(state, f"patch_embed.proj.{3 * i + 1}", w.shape[0])
        chans = w.shape[0]
    n = 3 * len(threes)
    dim = need(state, f"patch_embed.proj.{n}.weight", (None, chans, 1, 1), f"(D, {chans}, 1, 1)").shape[0]
    need(state, f"patch_embed.proj.{n}.bias", (dim,), f"({dim},)")
    keys |= {f"patch_embed.proj.{n}.weight", f"patch_embed.proj.{n}.bias"}
    return dict(patch_size=2 ** (len(threes) - 1), in_chans=threes[0].shape[1], embed_dim=dim, stem="conv"), keys


def read_norm(state: dict[str, torch.Tensor], name: str, dim: int) -> set[str]:
    need(state, f"{name}.weight", (dim,), f"({dim},)")
    need(state, f"{name}.bias", (dim,), f"({dim},)")
    return {f"{name}.weight", f"{name}.bias"}


def nothing_else(state: dict[str, torch.Tensor], accounted: set[str]) -> None:
    extra = sorted(set(state) - accounted)
    if extra:
        raise NotThis(f"{len(extra)} keys not in it ({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''})")


def encoder_arch(stem: dict, depth: int) -> dict:
    """What the file says of the architecture and `Recognised.mismatch` checks, in our constructor's names. The
    rest (registers, LayerScale, the MLP, qkv bias) the load checks by name and shape."""
    return dict(patch_size=stem["patch_size"], embed_dim=stem["embed_dim"], depth=depth,
                **({"stem": stem["stem"]} if "stem" in stem else {}))
