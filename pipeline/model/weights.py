"""Reading and writing model weights safely: safetensors, or `torch.load(weights_only=True)`.

Nothing here unpickles arbitrary objects: a checkpoint that carries code is refused. A file's format is
recognised by what defines it, never by its name (`weights_format`); whose weights it holds, and how they
become our model's, is `pipeline.model.layouts`. Parameter names are timm's, so a timm state dict (e.g.
downloaded weights of `vit_base_patch16_224`) loads directly.
"""

from __future__ import annotations

import argparse
import json
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from pipeline.atomic import atomic_path


class WeightsError(ValueError):
    """A weights file that cannot be used; the message names the file and what is wrong."""


class NotWeightsFile(WeightsError):
    """A file in none of the weights formats (text, empty, a pickle named .safetensors): the message says
    what it is instead, without the file's name (the caller names it as the user did)."""


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


# --- File formats, each recognised by what defines it, the most specific first ---

SAFETENSORS_MAX_HEADER = 100_000_000  # safetensors' own limit on its JSON header
PICKLE_PROTOCOLS = range(2, 6)  # torch.save writes protocol 2; pickle.dump 2-5 since Python 3.0


def weights_format(path: str | Path) -> str:
    """'safetensors', 'torch zip' or 'pickle', tested in that order, each by what defines it:

    - safetensors: 8 bytes, a little-endian header length N; then N bytes of JSON, an object whose every
      tensor has a dtype, a shape and data_offsets inside the rest of the file. The length's first byte
      can be anything (2,688 is `80 0a 00 ...`, a pickle's opening byte), so this is tested first;
    - torch zip (torch.save since 1.6): a zip archive's local-file signature `PK\\x03\\x04`;
    - pickle (a legacy torch.save, or pickle.dump): the PROTO opcode `\\x80` and a protocol 2-5. Read as
      the zip is, by the restricted unpickler: one that carries code is refused when it is loaded.

    A file named .safetensors must be one (a pickle there is refused: the name promised no pickle).
    Raises NotWeightsFile saying what the file is otherwise.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(4096)
        header = _safetensors_header(f, head, size)
    if isinstance(header, dict):
        return "safetensors"
    found = "torch zip" if head.startswith(b"PK\x03\x04") else (
        "pickle" if head[:1] == b"\x80" and head[1:2] and head[1] in PICKLE_PROTOCOLS else None)
    if found and path.suffix == ".safetensors":
        raise NotWeightsFile(f"it is a {'torch.save zip' if found == 'torch zip' else 'pickle'} file named "
                             f".safetensors, not a safetensors file")
    if found:
        return found
    if isinstance(header, str):  # began as safetensors does, and is not one: say where it stops being one
        raise NotWeightsFile(header)
    if not head:
        raise NotWeightsFile("it is empty")
    try:
        text = head.decode("utf-8")
        if "\x00" in text:  # valid UTF-8, and binary all the same
            raise UnicodeDecodeError("utf-8", head, text.index("\x00"), text.index("\x00") + 1, "NUL byte")
    except UnicodeDecodeError:
        raise NotWeightsFile(f"it starts with bytes {head[:8].hex(' ')}: not safetensors (a header length, then "
                             f"JSON), a torch.save zip (PK\\x03\\x04) or a pickle (\\x80, protocol 2-5)") from None
    first = text.strip().splitlines()[0][:60] if text.strip() else ""
    raise NotWeightsFile(f"it is a text file ({size} bytes, first line: {first!r})")


def _safetensors_header(f, head: bytes, size: int) -> dict | str | None:
    """The JSON header of a safetensors file; a string saying why not when the file starts as one (a length
    that fits the file, then '{'); None when it does not start as one."""
    length = int.from_bytes(head[:8], "little")
    if len(head) < 10 or head[8:9] != b"{" or length < 2:
        return None
    if length > SAFETENSORS_MAX_HEADER:  # the length and the '{' of a safetensors file, a length no file has
        return (f"it starts as a safetensors file with a header length of {length:,} bytes, over safetensors' "
                f"limit of {SAFETENSORS_MAX_HEADER:,}: damaged, or not safetensors")
    if length > size - 8:
        return (f"it starts as a safetensors file with a {length}-byte header, but only {size - 8} bytes follow "
                f"the length: truncated")
    f.seek(8)
    try:
        header = json.loads(f.read(length).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"it starts as a safetensors file (a {length}-byte header) whose header is not JSON ({e})"
    if not isinstance(header, dict):
        return f"it starts as a safetensors file whose {length}-byte header is not a JSON object"
    data = size - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data and isinstance(entry.get("dtype"), str)
                and isinstance(entry.get("shape"), list)):
            return (f"it starts as a safetensors file whose tensor {name!r} is not a dtype, a shape and data_offsets "
                    f"within its {data} bytes of data ({json.dumps(entry)[:80]}): truncated or not safetensors")
    return header


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict from a safetensors file, or from a torch.save file through the restricted unpickler,
    whatever the file is named (`weights_format` decides).

    Wrappers people save around weights ({'model': ...}, {'state_dict': ...}, {'module': ...}, Meta's DINOv2
    {'teacher': ...}) and a 'module.' prefix (DDP) are unwrapped. Besides tensors and plain data, the
    restricted unpickler accepts one class: argparse.Namespace, the `args` that Meta's MAE main_pretrain.py
    saves beside the model (rebuilt from its attributes' values, which must be plain data themselves).
    """
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"weights file '{path}' does not exist")
    try:
        fmt = weights_format(path)
    except NotWeightsFile as e:
        raise WeightsError(f"'{path}' is not a weights file: {e}") from None
    if fmt == "safetensors":
        try:
            return load_file(str(path))
        except SafetensorError as e:  # a header our check passes and safetensors' parser refuses (a dtype, a type)
            raise WeightsError(f"'{path}' is not a weights file: {_first_line(e)}") from None
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            # mmap (the zip format only): an optimizer's state saved beside the model is never read.
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=fmt == "torch zip")
    except pickle.UnpicklingError as e:
        raise WeightsError(f"'{path}' is not a plain tensor file and was not loaded: loading it would run code "
                           f"from the file ({refused_global(e)})") from None
    except Exception as e:  # noqa: BLE001 - a corrupt or foreign file: say which one
        raise WeightsError(f"'{path}' could not be read as a weights file: {e}") from None
    for key in ("model", "state_dict", "module", "model_state", "teacher"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise WeightsError(f"'{path}' does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in obj.items()}


def weights_metadata(path: str | Path) -> dict[str, str]:
    """A safetensors file's metadata (our exports name their variant and step there); {} for other formats."""
    try:
        if weights_format(path) != "safetensors":
            return {}
        with safe_open(str(path), "pt") as f:
            return dict(f.metadata() or {})
    except NotWeightsFile as e:
        raise WeightsError(f"'{path}' is not a weights file: {e}") from None
    except SafetensorError as e:
        raise WeightsError(f"'{path}' is not a weights file: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    """safetensors' own words (e.g. "Error while deserializing header: invalid JSON in header: unknown variant
    `XX`..."), on one line."""
    return " ".join(str(e).split())[:300] or type(e).__name__
