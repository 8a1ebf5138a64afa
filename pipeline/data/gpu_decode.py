"""`data.decode_device: cuda`: JPEG decode, crop, resize, flip and normalise on the GPU.

For when the CPU cannot keep up with the GPU. The train stream's workers then do not decode:
per sample they read the image header for its size (`PIL.Image.open(...).size` is lazy) and
draw the RandomResizedCrop box and the flip with the same per-sample seeding, and in the same
RNG order, as timm's transform on the CPU path, so the crops, the determinism and the exact
resume are those of `decode_device: cpu`. A batch then holds the raw bytes (`pack_batch`), and
`GpuBatchDecoder` turns it into the normalised float batch on the device: nvjpeg through
`torchvision.io.decode_jpeg(device='cuda')` (any device works: the tests use 'cpu'), then per
image crop -> antialiased resize (`data.interpolation`: bilinear or bicubic) -> flip, and one
fused normalisation. Mixup/CutMix runs after it, on the device, seeded as on the CPU path.

Pixels are close to the CPU path's, not equal (another JPEG decoder, another resize kernel).
RandAugment and colour jitter are not available here (`validate` refuses the combination), and
the eval pass still decodes on the CPU.

Bad images: a header PIL cannot read is counted `corrupt_image` in the worker and skipped, as
on the CPU path, and so is an image over `data.max_image_pixels` (`oversized_image`, from its header). A body that fails to decode is found only on the device: when the batched
decode raises, the batch is decoded image by image (on the device, then with PIL on the CPU
for what the device refuses, e.g. a PNG in the shards), and an image nothing can decode is
counted `corrupt_image` and replaced in the batch, image and label, by the batch's nearest
good sample (the batch keeps its size: every rank runs the same step).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from . import tario

INTERPOLATIONS = ("bilinear", "bicubic")


def open_lazy(data: bytes, max_pixels: int = tario.MAX_IMAGE_PIXELS) -> Image.Image:
    """The image with only its header parsed (size, mode); SampleError(corrupt_image) if unreadable,
    SampleError(oversized_image) past `max_pixels`."""
    return tario.open_image(data, max_pixels)


class CropDraw:
    """The random part of timm's train transform, without the pixels: (top, left, h, w) and flip.

    Call inside the same `seeded(...)` context as the CPU path's transform: it makes the same
    RNG calls in the same order (RandomResizedCropAndInterpolation.get_params, then
    RandomHorizontalFlip's torch.rand(1)), so it draws the same box and flip.
    """

    def __init__(self, transform: Any):
        from timm.data.transforms import RandomResizedCropAndInterpolation
        from torchvision.transforms import RandomHorizontalFlip

        steps = list(getattr(transform, "transforms", [transform]))
        crops = [t for t in steps if isinstance(t, RandomResizedCropAndInterpolation)]
        flips = [t for t in steps if isinstance(t, RandomHorizontalFlip)]
        if len(crops) != 1 or isinstance(crops[0].interpolation, (tuple, list)):
            raise ValueError(f"decode_device=cuda needs one RandomResizedCrop with a fixed interpolation: {transform}")
        self.crop = crops[0]
        self.flip_p = flips[0].p if flips else None

    def __call__(self, img: Image.Image) -> tuple[tuple[int, int, int, int], bool]:
        box = self.crop.get_params(img, self.crop.scale, self.crop.ratio)
        flip = bool(torch.rand(1) < self.flip_p) if self.flip_p is not None else False
        return box, flip


def pack_batch(items: list[tuple[bytes, tuple[int, int, int, int], bool, int]], mixup_seed: int) -> dict[str, Any]:
    """(bytes, box, flip, shard index) per sample -> a few tensors (one buffer for all the bytes:
    one shared-memory handle per batch instead of one per image)."""
    sizes = [len(b) for b, _, _, _ in items]
    data = torch.frombuffer(bytearray(b"".join(b for b, _, _, _ in items)) or bytearray(1), dtype=torch.uint8)
    return {"jpeg": data, "offsets": torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int64),
            "boxes": torch.tensor([box for _, box, _, _ in items], dtype=torch.int64).reshape(-1, 4),
            "flips": torch.tensor([f for _, _, f, _ in items], dtype=torch.bool),
            "shards": torch.tensor([s for _, _, _, s in items], dtype=torch.int64),
            "mixup_seed": torch.tensor(mixup_seed, dtype=torch.int64)}


def blobs(batch: dict[str, Any]) -> list[torch.Tensor]:
    """The per-image byte tensors of a packed batch (views of its one buffer)."""
    offsets = batch["offsets"].tolist()
    return [batch["jpeg"][a:b] for a, b in zip(offsets[:-1], offsets[1:])]


class GpuBatchDecoder:
    """Packed batch -> (images float32 [B, 3, H, W] normalised on `device`, indices that failed to decode)."""

    def __init__(self, img_size: tuple[int, int], mean: tuple[float, ...], std: tuple[float, ...],
                 interpolation: str = "bicubic"):
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"decode_device=cuda resizes with {' or '.join(INTERPOLATIONS)}, got {interpolation!r}")
        self.img_size = tuple(img_size)
        self.mode = interpolation
        mean_t = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        std_t = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self.scale = 1.0 / (255.0 * std_t)
        self.shift = -mean_t / std_t

    def decode(self, data: list[torch.Tensor], device: torch.device | str) -> list[torch.Tensor | None]:
        """uint8 [3, h, w] per image on `device`; None where nothing could decode it."""
        from torchvision.io import ImageReadMode, decode_jpeg

        if not data:
            return []
        try:
            return list(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
        except (RuntimeError, ValueError):
            return [self._decode_one(d, device) for d in data]

    @staticmethod
    def _decode_one(data: torch.Tensor, device: torch.device | str) -> torch.Tensor | None:
        from torchvision.io import ImageReadMode, decode_jpeg

        try:
            return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
        except (RuntimeError, ValueError):
            pass
        try:  # not a JPEG after all (PNG shards), or one only libjpeg via PIL accepts
            img = tario.decode_image(data.numpy().tobytes())
            return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).contiguous().to(device)
        except tario.SampleError:
            return None

    def __call__(self, batch: dict[str, Any], device: torch.device | str) -> tuple[torch.Tensor, list[int]]:
        decoded = self.decode(blobs(batch), device)
        H, W = self.img_size
        out = torch.zeros((len(decoded), 3, H, W), dtype=torch.float32, device=device)
        bad = []
        for k, (img, (i, j, h, w)) in enumerate(zip(decoded, batch["boxes"].tolist())):
            if img is None or img.shape[1] < i + h or img.shape[2] < j + w:
                bad.append(k)
                continue
            crop = img[None, :, i:i + h, j:j + w].float()
            out[k] = F.interpolate(crop, size=(H, W), mode=self.mode, antialias=True, align_corners=False)[0]
        flips = batch["flips"].to(device, non_blocking=True)
        out = torch.where(flips.view(-1, 1, 1, 1), out.flip(-1), out)
        out.clamp_(0, 255)  # bicubic overshoots; PIL's uint8 output clamps too
        out.mul_(self.scale.to(device)).add_(self.shift.to(device))
        return out, bad


def replace_bad(images: torch.Tensor, targets: torch.Tensor, bad: list[int]) -> None:
    """In place: each bad sample becomes a copy of the nearest good one (image and label)."""
    bad_set = set(bad)
    good = [k for k in range(images.shape[0]) if k not in bad_set]
    if not good:
        return  # all bad: zeros, labels kept; the bad-fraction check stops such a run soon
    for k in bad:
        g = min(good, key=lambda x: abs(x - k))
        images[k] = images[g]
        targets[k] = targets[g]
