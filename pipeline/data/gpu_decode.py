"""`data.decode_device: cuda`: JPEG decode, crop, resize, flip and normalise on the GPU.

For when the CPU cannot keep up with the GPU. The train stream's workers then do not decode:
per sample they read the image header for its size (`PIL.Image.open(...).size` is lazy) and
draw the RandomResizedCrop box and the flip with the same per-sample seeding, and in the same
RNG order, as timm's transform on the CPU path, so the crops, the determinism and the exact
resume are those of `decode_device: cpu`. A batch then holds the raw bytes (`pack_batch`), and
`GpuBatchDecoder` turns it into the normalised float batch on the device: nvjpeg through
`torchvision.io.decode_jpeg(device='cuda')` (any device works: the tests use 'cpu'), then
crop -> antialiased resize (`data.interpolation`: bilinear or bicubic) -> flip and one fused
normalisation. Mixup/CutMix runs after it, on the device, seeded as on the CPU path.

The crop and resize of a whole batch are two batched matrix products (`resize_matrix`): the
antialiased resize is separable, each output row a weighted sum of input rows, with the weights
F.interpolate(antialias=True) computes, zero outside the crop box. A batch is a few dozen kernels
instead of several per image: one by one, the small crops left the GPU waiting on the host's
launches (docs/performance.md, "GPU").

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

import warnings
from typing import Any

import numpy as np
import torch
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


def _aa_filter(x: torch.Tensor, mode: str) -> torch.Tensor:
    """The antialiasing kernels of PyTorch's (and PIL's) resize: triangle, or cubic with a = -0.5."""
    x = x.abs()
    if mode == "bilinear":
        return (1 - x).clamp(min=0)
    a = -0.5
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def resize_matrix(starts: torch.Tensor, lengths: torch.Tensor, out: int, full: int, mode: str) -> torch.Tensor:
    """float32 [N, out, full]: row i of image n weighs the `full` pixels of one axis into output pixel i
    of F.interpolate(crop, antialias=True, align_corners=False), where the crop is pixels
    starts[n] .. starts[n] + lengths[n] of that axis (weights outside it are 0).

    PyTorch's antialiased resize, written for a batch (aten's `_compute_indices_weights_aa`): scale =
    length / out, the kernel widened by the scale when shrinking, each output pixel's window
    [center - support, center + support) cut to the crop, its weights normalised to sum to 1."""
    size = 1.0 if mode == "bilinear" else 2.0  # half the kernel's width
    starts = starts.to(torch.float64).view(-1, 1, 1)
    lengths = lengths.to(torch.float64).view(-1, 1, 1)
    scale = lengths / out
    support = torch.where(scale >= 1, size * scale, torch.full_like(scale, size))
    invscale = torch.where(scale >= 1, 1 / scale, torch.ones_like(scale))
    i = torch.arange(out, dtype=torch.float64, device=starts.device).view(1, -1, 1)
    center = scale * (i + 0.5)
    lo = torch.trunc(center - support + 0.5).clamp(min=0)
    hi = torch.minimum(torch.trunc(center + support + 0.5), lengths)
    local = torch.arange(full, dtype=torch.float64, device=starts.device).view(1, 1, -1) - starts
    w = _aa_filter((local - center + 0.5) * invscale, mode) * ((local >= lo) & (local < hi))
    total = w.sum(-1, keepdim=True)
    return (w / torch.where(total == 0, torch.ones_like(total), total)).to(torch.float32)


class GpuBatchDecoder:
    """Packed batch -> (images float32 [B, 3, H, W] normalised on `device`, indices that failed to decode)."""

    def __init__(self, img_size: tuple[int, int], mean: tuple[float, ...], std: tuple[float, ...],
                 interpolation: str = "bicubic", chunk_bytes: int = 256 * 2**20):
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"decode_device=cuda resizes with {' or '.join(INTERPOLATIONS)}, got {interpolation!r}")
        self.img_size = tuple(img_size)
        self.mode = interpolation
        self.chunk_bytes = chunk_bytes  # the padded float images resized at once: memory, not speed
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
        boxes = batch["boxes"]
        out = torch.zeros((len(decoded), 3, H, W), dtype=torch.float32, device=device)
        bad = [k for k, (img, (i, j, h, w)) in enumerate(zip(decoded, boxes.tolist()))
               if img is None or img.shape[1] < i + h or img.shape[2] < j + w]
        good = [k for k in range(len(decoded)) if k not in set(bad)]
        for chunk in self._chunks(good, decoded):
            # One padded tensor for the chunk (zeros past each image: their weights are 0 anyway), then
            # rows and columns resized as two batched matrix products.
            with warnings.catch_warnings():  # "prototype stage": its strided layout is the one with 2 ragged dims
                warnings.filterwarnings("ignore", message=".*nested tensors is in prototype")
                padded = torch.nested.nested_tensor([decoded[k] for k in chunk]).to_padded_tensor(0).float()
            b = boxes[chunk].to(device)
            rows = resize_matrix(b[:, 0], b[:, 2], H, padded.shape[2], self.mode)
            cols = resize_matrix(b[:, 1], b[:, 3], W, padded.shape[3], self.mode)
            out[chunk] = rows.unsqueeze(1) @ padded @ cols.unsqueeze(1).transpose(-1, -2)
        flips = batch["flips"].to(device, non_blocking=True)
        out = torch.where(flips.view(-1, 1, 1, 1), out.flip(-1), out)
        out.clamp_(0, 255)  # bicubic overshoots; PIL's uint8 output clamps too
        out.mul_(self.scale.to(device)).add_(self.shift.to(device))
        return out, bad

    def _chunks(self, good: list[int], decoded: list[torch.Tensor | None]) -> list[list[int]]:
        """`good` in runs whose padded float32 batch stays under `chunk_bytes` (at least one image each)."""
        chunks: list[list[int]] = []
        cur: list[int] = []
        hmax = wmax = 0
        for k in good:
            _, h, w = decoded[k].shape
            nh, nw = max(hmax, h), max(wmax, w)
            if cur and (len(cur) + 1) * 3 * nh * nw * 4 > self.chunk_bytes:
                chunks.append(cur)
                cur, nh, nw = [], h, w
            cur.append(k)
            hmax, wmax = nh, nw
        return chunks + ([cur] if cur else [])


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
