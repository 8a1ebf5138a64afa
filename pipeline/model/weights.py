"""Reading and writing model weights safely: safetensors, or `torch.load(weights_only=True)`.

Nothing here unpickles arbitrary objects: a checkpoint that carries code is refused. Parameter names
are timm's, so a timm state dict (e.g. downloaded weights of `vit_base_patch16_224`) loads directly.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pipeline.atomic import atomic_path


class WeightsError(ValueError):
    """A weights file that cannot be used; the message names the file and what is wrong."""


def refused_global(e: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler refused ("Unsupported global: GLOBAL posix.system ..."), from its
    many-line message whose first line is only advice."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    found = next((line for line in lines if "Unsupported global" in line or "GLOBAL" in line), None)
    return (found or (lines[0] if lines else "UnpicklingError"))[:200]


def save_weights(state_dict: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file atomically (a crash leaves the old file, never half a new one)."""
    with atomic_path(path) as tmp:  # a unique temporary name, fsynced, renamed (pipeline/atomic.py)
        # safetensors refuses shared storage and non-contiguous views; clone makes each tensor its own.
        save_file({k: v.detach().contiguous().clone() for k, v in state_dict.items()}, str(tmp), metadata=metadata)


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict from .safetensors, or from .pth/.pt/.bin through the restricted unpickler.

    Wrappers people save around weights ({'model': ...}, {'state_dict': ...}, {'module': ...}) and a
    'module.' prefix (DDP) are unwrapped.
    """
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"weights file '{path}' does not exist")
    if path.suffix == ".safetensors":
        return load_file(str(path))
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise WeightsError(f"'{path}' is not a plain tensor file and was not loaded: loading it would run code "
                           f"from the file ({refused_global(e)})") from None
    except Exception as e:  # noqa: BLE001 - a corrupt or foreign file: say which one
        raise WeightsError(f"'{path}' could not be read as a weights file: {e}") from None
    for key in ("model", "state_dict", "module", "model_state"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise WeightsError(f"'{path}' does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in obj.items()}


# --- Meta's DINOv2 backbones (facebookresearch/dinov2, `dinov2_vitb14_pretrain.pth`, `..._reg4_pretrain.pth`) ---

_META_CHUNKED = re.compile(r"^blocks\.\d+\.(\d+)\.")  # training checkpoints' BlockChunk layout: blocks.CHUNK.I.
_META_BLOCK = re.compile(r"^blocks\.(\d+)\.")


def is_dinov2_state_dict(state: dict[str, torch.Tensor]) -> bool:
    """Whether a state dict is laid out as Meta's DinoVisionTransformer (its own key names, not timm's):
    a mask_token (1, D) or register_tokens, or SwiGLUFFNFused's w12/w3 names, beside cls_token and pos_embed."""
    if "cls_token" not in state or "pos_embed" not in state:
        return False
    return ("mask_token" in state or "register_tokens" in state
            or any(k.endswith(".mlp.w12.weight") for k in state))


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
