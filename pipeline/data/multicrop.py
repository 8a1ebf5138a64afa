"""DINOv2's multi-crop augmentation and iBOT's block masks, every random draw from the sample's own seed
(issue 33).

`MultiCrop(cfg)(image, seed)` gives what Meta's `DataAugmentationDINO` (dinov2/data/augmentations.py)
gives: 2 global crops (224 px, scale 0.32-1) and N local crops (98 px here: patch 14 tiles 98, Meta's
ViT-L/g configs use it; their default 96 does not tile), each a bicubic random resized crop and a
horizontal flip, colour jitter (brightness 0.4, contrast 0.4, saturation 0.2, hue 0.1, in a random order,
p 0.8), greyscale (p 0.2), Gaussian blur (kernel 9, sigma 0.1-2) and, on the second global crop only,
solarisation (threshold 128, p 0.2); then ImageNet normalisation. The blur probabilities are the ones
Meta's code applies, which are not the ones it names: its `GaussianBlur(p=...)` passes `1 - p` to
torchvision's RandomApply, which applies with that probability, so `p=1.0` on the first global crop
never blurs, `p=0.1` on the second blurs 90% of the time and the local crops 50%. We keep what Meta
trained with (0, 0.9, 0.5; `MultiCropConfig.blur_p`), not what its names say.

The difference from Meta's: torchvision's random transforms draw from torch's global RNG, so which crops
a sample gets depends on what ran before it in that worker. Ours draw every parameter from a
`torch.Generator` seeded with the sample's own seed (the stream's `order.augment_seed(position)`, as
pipeline/data/transforms.py's supervised augmentation is seeded), so a sample's crops are the same on any
number of ranks and workers, and the global RNGs are left alone.

`block_mask(seed, grid, ...)` draws iBOT's mask for one image with Meta's `MaskingGenerator` semantics
(rectangles of 4+ patches, aspect 0.3-3.3, added until the target count), from the seed. Meta's collate
(dinov2/data/collate.py) decides per batch which half of the images are masked and spreads their ratios
over 0.1-0.5 in strata; that depends on the batch's make-up, so here each image decides from its seed
(masked with probability 0.5, ratio uniform in 0.1-0.5): the same distribution per image, identical on
any layout.

The DINOv2 objective (pipeline/objectives/dino/view.py, `MultiCropView`) calls both in the train stream's
workers, with each sample's augmentation seed.

An array set's sample (pipeline/data/pixels.py: H x W x C in its own dtype, issue 62) is cut the same way, as a
float32 [C, H, W] tensor: the same draws, the crops bicubic and antialiased, the flip and the blur (defined on any
channel), normalised by `mean`/`std` in the pixels' own units. Colour jitter, greyscale and solarisation are
defined for 8-bit RGB: their draws are made (so the other draws are those of an RGB image) and not applied; a
run asks for none of them on such a set (pixels.resolve_pixels turns the recipe's defaults off and refuses a
probability set otherwise, one line).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass
class MultiCropConfig:
    """DINOv2's multi-crop recipe (Meta's ssl_default_config.yaml `crops:` and augmentations.py)."""

    global_crops_size: int = 224
    """Side of the 2 global crops (teacher and student), pixels."""
    global_crops_scale: tuple[float, float] = (0.32, 1.0)
    """Area range of a global crop, as a fraction of the image."""
    local_crops_number: int = 8
    """Number of local crops (student only)."""
    local_crops_size: int = 98
    """Side of a local crop, pixels: a multiple of the patch (98 = 7 x 14)."""
    local_crops_scale: tuple[float, float] = (0.05, 0.32)
    """Area range of a local crop."""
    color_jitter_p: float = 0.8
    """Probability of colour jitter (brightness 0.4, contrast 0.4, saturation 0.2, hue 0.1)."""
    greyscale_p: float = 0.2
    """Probability of greyscale."""
    blur_p: tuple[float, float, float] = (0.0, 0.9, 0.5)
    """Probability of Gaussian blur for global crop 1, global crop 2 and each local crop: what Meta's code
    applies (see the module docstring)."""
    solarize_p: float = 0.2
    """Probability of solarisation (threshold 128) on the second global crop."""
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    """Per channel: ImageNet's for 8-bit RGB (in [0, 1]); an array set's in its pixels' units (data.mean/std)."""
    horizontal_flips: bool = True
    """Flip each crop with probability 0.5 (DINOv3's configs: off). Drawn either way, so that turning it off
    changes no other draw."""
    gram_crops_size: int | None = None
    """DINOv3's Gram teacher crops: the same 2 global crops at this side as well (Meta's
    gram_teacher_crops_size); None: none."""
    gram_no_distortions: bool = True
    """The Gram teacher's crops without the photometric distortions (Meta's gram_teacher_no_distortions)."""


def _uniform(g: torch.Generator, low: float, high: float) -> float:
    return low + (high - low) * float(torch.rand((), generator=g))


def _randint(g: torch.Generator, low: int, high: int) -> int:
    """An integer in [low, high)."""
    return int(torch.randint(low, high, (), generator=g))


def _crop_box(g: torch.Generator, width: int, height: int, scale: tuple[float, float]) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params (ratio 3/4-4/3, 10 tries, then a central crop), drawn from g."""
    area = width * height
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target = area * _uniform(g, *scale)
        ratio = math.exp(_uniform(g, *log_ratio))
        w = int(round(math.sqrt(target * ratio)))
        h = int(round(math.sqrt(target / ratio)))
        if 0 < w <= width and 0 < h <= height:
            return _randint(g, 0, height - h + 1), _randint(g, 0, width - w + 1), h, w
    ratio = width / height
    if ratio < 3 / 4:
        w, h = width, int(round(width / (3 / 4)))
    elif ratio > 4 / 3:
        h, w = height, int(round(height * (4 / 3)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


Crop = Image.Image | torch.Tensor
"""A PIL image (8-bit RGB) or a float32 [C, H, W] tensor (an array set's sample) on its way through the crops."""


def _size(image: Crop) -> tuple[int, int]:
    """(width, height), as PIL's Image.size."""
    return image.size if isinstance(image, Image.Image) else (image.shape[-1], image.shape[-2])


class MultiCrop:
    """`MultiCrop(cfg)(image, seed)` -> {"global_crops": [2 x (C, G, G)], "local_crops": [N x (C, L, L)]}, and
    with `cfg.gram_crops_size` "gram_crops": [2 x (C, S, S)] (C: 3 for a PIL image), the global crops' boxes at side S (Meta's
    DataAugmentationDINO: each global box cut once at max(G, S) and resized to G and to S, bicubic)."""

    def __init__(self, cfg: MultiCropConfig | None = None) -> None:
        self.cfg = cfg or MultiCropConfig()

    def _geometric(self, g: torch.Generator, image: Crop, size: int, scale: tuple[float, float]) -> Crop:
        import torchvision.transforms.functional as TF  # noqa: N812 - here: the rank never imports torchvision

        top, left, h, w = _crop_box(g, *_size(image), scale)
        # antialias: what PIL's bicubic does for an image; a tensor's resize asks for it (ignored for PIL)
        out = TF.resized_crop(image, top, left, h, w, [size, size], TF.InterpolationMode.BICUBIC, antialias=True)
        flip = torch.rand((), generator=g) < 0.5
        return TF.hflip(out) if flip and self.cfg.horizontal_flips else out

    def _normalised(self, image: Crop) -> torch.Tensor:
        import torchvision.transforms.functional as TF  # noqa: N812 - in the loader workers only (see _geometric)

        x = TF.to_tensor(image) if isinstance(image, Image.Image) else image  # a tensor is in its pixels' units
        return TF.normalize(x, list(self.cfg.mean), list(self.cfg.std))

    def _photometric(self, g: torch.Generator, image: Crop, blur_p: float, solarize_p: float) -> torch.Tensor:
        import torchvision.transforms.functional as TF  # noqa: N812 - in the loader workers only (see _geometric)

        cfg = self.cfg
        # Every draw is made whether or not its transform applies, so one crop's draws never shift on
        # another's outcome (simpler to reason about; the distribution is the same).
        jitter = torch.rand((), generator=g) < cfg.color_jitter_p
        order = torch.randperm(4, generator=g).tolist()  # torchvision's ColorJitter applies in random order
        factors = [_uniform(g, 0.6, 1.4), _uniform(g, 0.6, 1.4), _uniform(g, 0.8, 1.2), _uniform(g, -0.1, 0.1)]
        grey = torch.rand((), generator=g) < cfg.greyscale_p
        blur = torch.rand((), generator=g) < blur_p
        sigma = _uniform(g, 0.1, 2.0)
        solarize = torch.rand((), generator=g) < solarize_p
        if not isinstance(image, Image.Image):  # C channels: the colour ops are RGB's (module docstring)
            jitter = grey = solarize = False
        if jitter:
            ops = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue)
            for i in order:
                image = ops[i](image, factors[i])
        if grey:
            image = TF.rgb_to_grayscale(image, num_output_channels=3)
        if blur:
            image = TF.gaussian_blur(image, kernel_size=[9, 9], sigma=[sigma, sigma])
        if solarize:
            image = TF.solarize(image, 128)
        return self._normalised(image)

    def _global_and_gram(self, g: torch.Generator, image: Crop, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global crop i at G and, for the Gram teacher, at S: one box cut at max(G, S) (the same draws as
        without Gram crops), resized to each side, distorted before (Meta's) or only for G."""
        import torchvision.transforms.functional as TF  # noqa: N812 - in the loader workers only (see _geometric)

        cfg, bicubic = self.cfg, TF.InterpolationMode.BICUBIC
        size, gram = cfg.global_crops_size, cfg.gram_crops_size
        base = self._geometric(g, image, max(size, gram), cfg.global_crops_scale)
        distort = dict(blur_p=cfg.blur_p[i], solarize_p=cfg.solarize_p if i == 1 else 0.0)
        if cfg.gram_no_distortions:
            at = lambda side: TF.resize(base, [side, side], bicubic, antialias=True)  # noqa: E731 - PIL ignores antialias
            crop = self._photometric(g, base if size >= gram else at(size), **distort)
            plain = base if gram >= size else at(gram)
            return crop, self._normalised(plain)
        distorted = self._photometric(g, base, **distort)  # at max(G, S), then resized as tensors (Meta's)
        return tuple(distorted if s == max(size, gram) else TF.resize(distorted, [s, s], bicubic, antialias=True)
                     for s in (size, gram))

    def __call__(self, image: Image.Image | np.ndarray, seed: int) -> dict[str, list[torch.Tensor]]:
        cfg = self.cfg
        if isinstance(image, np.ndarray):  # an array set's H x W x C (pixels.py): float32 [C, H, W], as ArrayCrop's
            image = torch.from_numpy(image.astype(np.float32, copy=False)).permute(2, 0, 1).contiguous()
        else:
            image = image.convert("RGB")
        g = torch.Generator().manual_seed(seed)
        if cfg.gram_crops_size is not None:
            pairs = [self._global_and_gram(g, image, i) for i in range(2)]
            global_crops, gram_crops = [c for c, _ in pairs], [t for _, t in pairs]
        else:
            global_crops = [
                self._photometric(g, self._geometric(g, image, cfg.global_crops_size, cfg.global_crops_scale),
                                  blur_p=cfg.blur_p[i], solarize_p=cfg.solarize_p if i == 1 else 0.0)
                for i in range(2)
            ]
        local_crops = [
            self._photometric(g, self._geometric(g, image, cfg.local_crops_size, cfg.local_crops_scale),
                              blur_p=cfg.blur_p[2], solarize_p=0.0)
            for _ in range(cfg.local_crops_number)
        ]
        out = {"global_crops": global_crops, "local_crops": local_crops}
        if cfg.gram_crops_size is not None:
            out["gram_crops"] = gram_crops
        return out


def _add_block(g: torch.Generator, mask: torch.Tensor, max_patches: int, min_patches: int,
               log_aspect: tuple[float, float]) -> int:
    """Meta's MaskingGenerator._mask: up to 10 tries at one rectangle that adds 1..max_patches new patches."""
    height, width = mask.shape
    for _ in range(10):
        target = _uniform(g, min_patches, max_patches)
        aspect = math.exp(_uniform(g, *log_aspect))
        h = int(round(math.sqrt(target * aspect)))
        w = int(round(math.sqrt(target / aspect)))
        if w < width and h < height:
            top, left = _randint(g, 0, height - h + 1), _randint(g, 0, width - w + 1)
            block = mask[top:top + h, left:left + w]
            new = h * w - int(block.sum())
            if 0 < new <= max_patches:
                block.fill_(True)
                return new
    return 0


def block_mask(seed: int, grid: tuple[int, int], mask_probability: float = 0.5,
               mask_ratio: tuple[float, float] = (0.1, 0.5), min_num_patches: int = 4,
               min_aspect: float = 0.3) -> torch.Tensor:
    """iBOT's block mask for one image, (H, W) boolean, from its seed: all False with probability
    1 - mask_probability, else rectangles added until ratio x H x W patches (ratio uniform in
    mask_ratio) or until no rectangle fits, as Meta's MaskingGenerator (max_num_patches = the target)."""
    g = torch.Generator().manual_seed(seed)
    height, width = grid
    mask = torch.zeros(height, width, dtype=torch.bool)
    if not torch.rand((), generator=g) < mask_probability:
        return mask
    target = int(height * width * _uniform(g, *mask_ratio))
    log_aspect = (math.log(min_aspect), math.log(1 / min_aspect))
    count = 0
    while count < target:
        added = _add_block(g, mask, target - count, min_num_patches, log_aspect)
        if added == 0:
            break
        count += added
    return mask
