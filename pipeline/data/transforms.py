"""Train/eval transforms (timm's `create_transform`) and Mixup/CutMix (timm's `Mixup`), made reproducible.

timm's transforms draw from Python's `random`, NumPy's global RNG and torch's global RNG. The
train stream seeds all three before each sample with `seeded(order.augment_seed(position))` (from (seed, epoch,
index in epoch)), so the augmentation of a sample depends only on its position in the global order: the
same on any layout, and a resumed run augments it exactly as the uninterrupted run would have.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from pipeline.config import DataConfig


@contextmanager
def seeded(seed: int, restore: bool) -> Iterator[None]:
    """Seed Python's, NumPy's and torch's global RNGs; put the old states back when `restore`
    (in the main process, where the trainer's own RNG streams must not be disturbed)."""
    saved: Any = None
    if restore:
        saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    # CPU generator only: torch.manual_seed also queues a lazy CUDA seeding call, which records a
    # stack trace every time (a third of the per-sample cost in a CPU-only profile).
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        if saved is not None:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
            torch.set_rng_state(saved[2])


def train_transform(cfg: DataConfig, img_size: tuple[int, int], to_float: bool = False
                    ) -> Callable[[Any], torch.Tensor]:
    """RandomResizedCrop(scale, ratio) -> flip -> [RandAugment | colour jitter] -> uint8 tensor [3, H, W].

    The float conversion and normalisation are done by `BatchNormalizer`, fused, straight into
    the batch's shared memory. `to_float=True` gives timm's usual per-image
    ToTensor + Normalize instead (the same values; the benchmarks' reference).
    """
    from timm.data import create_transform

    return ByKind(_with_zero_bit_posterize(create_transform(
        input_size=(3, *img_size), is_training=True, scale=tuple(cfg.scale), ratio=tuple(cfg.ratio),
        hflip=cfg.hflip, vflip=0.0, color_jitter=cfg.color_jitter, auto_augment=cfg.auto_augment,
        interpolation=cfg.interpolation, mean=tuple(cfg.mean[:3]), std=tuple(cfg.std[:3]), re_prob=0.0,
        use_prefetcher=not to_float,
    )), ArrayCrop(cfg, img_size, train=True))


def _posterize(img: Any, bits_to_keep: int, **_: Any) -> Any:
    """timm's posterize as it behaved before Pillow 13: 0 bits kept is a black image. Pillow 13's
    ImageOps.posterize refuses 0, which timm's increasing posterize ('inc1', MAE's and DeiT's
    rand-m9-mstd0.5-inc1) reaches at magnitude 10 (9 + 0.5 x N(0, 1), clipped at 10, is 10 in 2.3% of the
    draws), and the run died in a DataLoader worker."""
    from PIL import Image, ImageOps

    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return ImageOps.posterize(img, bits_to_keep)


def _with_zero_bit_posterize(transform: Any) -> Any:
    """Give the posterize ops of this transform's RandAugment / AutoAugment `_posterize` (this transform
    only; timm's tables are left alone)."""
    from timm.data.auto_augment import AutoAugment, RandAugment

    for t in getattr(transform, "transforms", []):
        if isinstance(t, RandAugment):
            ops = t.ops
        elif isinstance(t, AutoAugment):
            ops = [op for sub_policy in t.policy for op in sub_policy]
        else:
            continue
        for op in ops:
            if op.name.startswith("Posterize"):
                op.aug_fn = _posterize
    return transform


def eval_transform(cfg: DataConfig, img_size: tuple[int, int], to_float: bool = False
                   ) -> Callable[[Any], torch.Tensor]:
    """Resize to img_size / crop_pct, centre crop img_size, uint8 tensor (see `train_transform`)."""
    from timm.data import create_transform

    return ByKind(create_transform(
        input_size=(3, *img_size), is_training=False, interpolation=cfg.interpolation,
        crop_pct=cfg.crop_pct, mean=tuple(cfg.mean[:3]), std=tuple(cfg.std[:3]), use_prefetcher=not to_float,
    ), ArrayCrop(cfg, img_size, train=False))


class ByKind:
    """timm's transform for a PIL image (8-bit RGB), `ArrayCrop` for an H x W x C array (pixels.py): the sample
    says which."""

    def __init__(self, rgb: Any, array: ArrayCrop):
        self.rgb, self.array = rgb, array
        self.transforms = getattr(rgb, "transforms", [rgb])  # timm's steps: gpu_decode.CropDraw reads them

    def __call__(self, img: Any) -> torch.Tensor:
        return self.array(img) if isinstance(img, np.ndarray) else self.rgb(img)


class ArrayCrop:
    """The geometric transforms on C channels: train, RandomResizedCrop(scale, ratio) and a horizontal flip
    (torch's RNG, seeded per sample as timm's draws are); eval, resize to img_size / crop_pct and centre crop.
    Gives float32 [C, H, W] in the pixels' own units; `BatchNormalizer` normalises it."""

    def __init__(self, cfg: DataConfig, img_size: tuple[int, int], train: bool):
        self.cfg, self.size, self.train = cfg, tuple(img_size), train

    def __call__(self, array: np.ndarray) -> torch.Tensor:
        import torchvision.transforms.functional as TF
        from torchvision.transforms import InterpolationMode, RandomResizedCrop

        x = torch.from_numpy(array.astype(np.float32, copy=False)).permute(2, 0, 1)
        mode = InterpolationMode(self.cfg.interpolation)
        if self.train:
            i, j, h, w = RandomResizedCrop.get_params(x, list(self.cfg.scale), list(self.cfg.ratio))
            x = TF.resized_crop(x, i, j, h, w, list(self.size), mode, antialias=True)
            if torch.rand(1).item() < self.cfg.hflip:
                x = x.flip(-1)
            return x.contiguous()
        scaled = [int(s / self.cfg.crop_pct) for s in self.size]
        x = TF.resize(x, scaled if self.size[0] != self.size[1] else scaled[0], mode, antialias=True)
        return TF.center_crop(x, list(self.size)).contiguous()


class BatchNormalizer:
    """uint8 image [3, H, W] -> (x / 255 - mean) / std, written straight into its slot of the batch:
    one pass, where timm's ToTensor + Normalize and a collate make about seven. A float32 [C, H, W] (an array
    set's `ArrayCrop`) -> (x - mean) / std: its mean and std are in the pixels' own units."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]):
        mean_t = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        std_t = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
        self.scale = 1.0 / (255.0 * std_t)
        self.shift = -mean_t / std_t
        self.raw_scale = 1.0 / std_t

    def __call__(self, image: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        scale = self.scale if image.dtype == torch.uint8 else self.raw_scale
        return torch.addcmul(self.shift, image, scale, out=out)


def empty_batch(shape: tuple[int, ...], shared: bool) -> torch.Tensor:
    """float32 tensor; in shared memory when built in a DataLoader worker, so that handing it to
    the main process copies nothing (what default_collate does)."""
    if not shared:
        return torch.empty(shape)
    numel = 1
    for n in shape:
        numel *= n
    try:
        storage = torch.empty(0)._typed_storage()._new_shared(numel)
        return torch.empty(0).new(storage).view(shape)
    except (AttributeError, RuntimeError):  # private API moved: fall back to a copy into shm
        return torch.empty(shape).share_memory_()


def as_is(item: Any) -> Any:
    """DataLoader `collate_fn` for streams that yield whole batches: hand them over unchanged.

    The default (`default_convert`) turns NumPy arrays into tensors inside the worker, and every tensor a
    worker hands back costs a shared-memory segment and a file-descriptor handshake. So only the image
    batch (`empty_batch`) travels as a tensor; small per-sample arrays (ids, targets, masks) travel as
    NumPy arrays, pickled inline, and become tensors with `torch.from_numpy` on arrival (no copy).
    """
    return item


def build_mixup(cfg: DataConfig, num_classes: int, batch_size: int) -> Any:
    """timm Mixup/CutMix producing soft targets [B, K] (label smoothing folded in); None when off."""
    if cfg.mixup <= 0 and cfg.cutmix <= 0:
        return None
    if batch_size % 2:
        raise ValueError(f"data.mixup/data.cutmix need an even batch size, got {batch_size}")
    from timm.data import Mixup

    return Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, prob=cfg.mixup_prob,
                 switch_prob=cfg.mixup_switch_prob, mode="batch", label_smoothing=cfg.label_smoothing,
                 num_classes=num_classes)
