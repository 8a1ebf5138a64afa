"""Reading and writing model weights safely: safetensors, or `torch.load(weights_only=True)`.

Nothing here unpickles arbitrary objects: a checkpoint that carries code is refused. Parameter names
are timm's, so a timm state dict (e.g. downloaded weights of `vit_base_patch16_224`) loads directly.
"""

from __future__ import annotations

import pickle
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
