"""DINOv3's rotary position embedding (Siméoni et al., arXiv 2508.10104; RoPE: Su et al., arXiv 2104.09864):
axial, no learned weights, on patch coordinates normalised to [-1, 1], with DINOv3's training-time
augmentations of those coordinates.

    coordinates   patch (i, j) of an H x W grid sits at ((i + 0.5) / H, (j + 0.5) / W), mapped to [-1, 1]
                  ('separate'; 'min' / 'max' divide both axes by min(H, W) / max(H, W) instead)
    periods       base^(2k / (d/2)), k < d/4 (d the head width; DINOv3: base 100), or log-spaced from
                  min_period to max_period
    angles        2 pi * coordinate / period: d/4 per axis, the height's first, then the same again (the
                  "rotate half" layout): head channel c pairs with channel c + d/2
    augmentation  in training only, one draw per sample (and per block, as Meta's code draws per block):
                  coordinates + U(-shift, shift) per axis, then x exp(U(-log J, log J)) per axis (jitter),
                  then x exp(U(-log R, log R)) for both axes (rescale); each only where configured

Equal to facebookresearch/dinov3's RopePositionEmbedding and rope_apply, and to timm's RotaryEmbeddingDinoV3
(`timm/layers/pos_embed_sincos.py`, rope_type='dinov3', rotate_half=True, grid_indexing='ij'); tested
against timm in tests/unit/test_dinov3.py. The periods are a non-persistent buffer, as timm keeps them: they
follow from the constructor, so state dicts move between timm's class and ours unchanged (Meta's files carry
them as `rope_embed.periods`, which a load may drop).

Why the draws come from outside. Meta's code draws one box per forward pass and block from the rank's global
RNG, shared by that rank's micro-batch: on another number of GPUs the same sample gets another box. Here
each sample's draws are a function of its own seed (`RopeAugment(seed)`, run in the loader workers as the
crops are), handed to the model as `rope_aug` (B, 5) or (B, blocks, 5): the same on any layout, so training
stays deterministic per sample and step. Per sample and not per micro-batch is a change of correlation
within a batch only; each sample's box has Meta's distribution.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

NormalizeCoords = Literal["separate", "min", "max"]

AUG_FIELDS = ("shift_h", "shift_w", "jitter_h", "jitter_w", "rescale")
"""The columns of a rope augmentation draw; (0, 0, 1, 1, 1) is no augmentation."""
IDENTITY = (0.0, 0.0, 1.0, 1.0, 1.0)


def _check_factor(name: str, value: float | None, low: float) -> float | None:
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value) or value < low:
        raise ValueError(f"{name} must be a finite number >= {low} or None, got {value}")
    return value


class RopeAugment:
    """DINOv3's coordinate augmentation, drawn from a seed: `RopeAugment(shift, jitter, rescale, blocks)(seed)`
    is a (blocks, 5) tensor of (shift_h, shift_w, jitter_h, jitter_w, rescale), `blocks` draws in a row (1:
    one box shared by every block, as timm draws; the depth: a box per block, as Meta's code draws).

    Each draw consumes the generator as Meta's and timm's code consume theirs: two uniforms for the shift,
    two for the jitter, one for the rescale, each only when configured; so `draw(g)` with a generator in
    the state of torch's global one gives timm's box. Picklable: it travels to the DataLoader workers."""

    def __init__(self, shift: float | None = None, jitter: float | None = None, rescale: float | None = None,
                 blocks: int = 1):
        self.shift = _check_factor("rope_shift_coords", shift, 0.0)
        self.jitter = _check_factor("rope_jitter_coords", jitter, 1.0)
        self.rescale = _check_factor("rope_rescale_coords", rescale, 1.0)
        if blocks < 1:
            raise ValueError(f"blocks must be >= 1, got {blocks}")
        self.blocks = blocks

    @property
    def active(self) -> bool:
        return self.shift is not None or self.jitter is not None or self.rescale is not None

    def draw(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """One box (5,), from `generator` (None: torch's global one)."""
        out = torch.tensor(IDENTITY, dtype=torch.float32)
        if self.shift is not None:
            out[0:2] = torch.empty(2).uniform_(-self.shift, self.shift, generator=generator)
        if self.jitter is not None:
            top = math.log(self.jitter)
            out[2:4] = torch.empty(2).uniform_(-top, top, generator=generator).exp()
        if self.rescale is not None:
            top = math.log(self.rescale)
            out[4:5] = torch.empty(1).uniform_(-top, top, generator=generator).exp()
        return out

    def __call__(self, seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(int(seed))
        return torch.stack([self.draw(generator) for _ in range(self.blocks)])

    def __repr__(self) -> str:
        return f"RopeAugment(shift={self.shift}, jitter={self.jitter}, rescale={self.rescale}, blocks={self.blocks})"


def rope_periods(head_dim: int, temperature: float | None = 100.0, min_period: float | None = None,
                 max_period: float | None = None) -> torch.Tensor:
    """The d/4 periods of one axis, float32 (Meta's `_init_weights`, timm's `_compute_periods`)."""
    n = head_dim // 4
    if min_period is not None and max_period is not None:
        exponents = torch.linspace(0, 1, n, dtype=torch.float32)
        return min_period * (max_period / min_period) ** exponents
    if temperature is None:
        raise ValueError("RoPE needs rope_temperature, or rope_min_period and rope_max_period")
    return temperature ** (2.0 * torch.arange(n, dtype=torch.float32) / (head_dim // 2))


def patch_coords(grid: tuple[int, int], normalize: NormalizeCoords = "separate") -> torch.Tensor:
    """(H*W, 2) patch centres in [-1, 1], row-major, (height, width) per row."""
    h, w = grid
    # Divided by the sizes as they come, not by float() of them: under an ONNX export's tracer they are the
    # input's traced sizes, and 'separate' (every released model's) then gives a graph that takes any grid.
    if normalize == "separate":
        den = (h, w)
    elif normalize == "min":
        den = (min(h, w),) * 2
    elif normalize == "max":
        den = (max(h, w),) * 2
    else:
        raise ValueError(f"rope_normalize_coords must be 'separate', 'min' or 'max', got {normalize!r}")
    ch = torch.arange(0.5, h, dtype=torch.float32) / den[0]
    cw = torch.arange(0.5, w, dtype=torch.float32) / den[1]
    coords = torch.stack(torch.meshgrid(ch, cw, indexing="ij"), dim=-1).flatten(0, 1)
    return 2.0 * coords - 1.0


def augment_coords(coords: torch.Tensor, aug: torch.Tensor) -> torch.Tensor:
    """Coordinates (N, 2) under boxes (..., 5) -> (..., N, 2): Meta's order, shift then jitter then rescale."""
    shift, jitter, rescale = aug[..., None, 0:2], aug[..., None, 2:4], aug[..., None, 4:5]
    return (coords + shift) * jitter * rescale


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x0 x1 | x2 x3] -> [-x2 -x3 | x0 x1]: channel c turns with channel c + d/2."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """Rotate the last `sin.shape[-2]` tokens of x (B, heads, N, d); the prefix tokens (class, storage) before
    them keep no position. In sin's dtype (float32), the result in x's (as Meta's apply_rope and timm's)."""
    prefix = x.shape[-2] - sin.shape[-2]
    if prefix < 0:
        raise ValueError(f"{x.shape[-2]} tokens but rotary positions for {sin.shape[-2]} patches")
    patches = x[..., prefix:, :]
    rotated = (patches * cos + rotate_half(patches) * sin).to(x.dtype)
    return torch.cat([x[..., :prefix, :], rotated], dim=-2)


class RopePositionEmbedding(nn.Module):
    """Axial RoPE over a patch grid: `forward(grid, aug)` gives (sin, cos), each (H*W, d), or (B, 1, H*W, d)
    under per-sample boxes `aug` (B, 5), ready for `apply_rope` on (B, heads, N, d).

    `head_dim` the attention head width (a multiple of 4: two axes, sin and cos pairs); `temperature` the
    period base (DINOv3: 100), or `min_period` and `max_period`; `normalize_coords` what the coordinates are
    divided by; `shift_coords`, `jitter_coords`, `rescale_coords` the training-time augmentation, drawn by
    `augment()` (RopeAugment) from each sample's seed and applied only in training (no augmentation in eval).
    """

    def __init__(self, head_dim: int, temperature: float | None = 100.0, min_period: float | None = None,
                 max_period: float | None = None, normalize_coords: NormalizeCoords = "separate",
                 shift_coords: float | None = None, jitter_coords: float | None = None,
                 rescale_coords: float | None = None):
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"RoPE needs a head width divisible by 4 (two axes, sin and cos), got {head_dim}")
        if (min_period is None) != (max_period is None) or (temperature is None and min_period is None):
            raise ValueError("RoPE takes rope_temperature, or both rope_min_period and rope_max_period")
        self.head_dim = head_dim
        self.temperature = None if min_period is not None else temperature
        self.min_period, self.max_period = min_period, max_period
        patch_coords((1, 1), normalize_coords)  # refuse an unknown normalisation here, not at the first forward
        self.normalize_coords = normalize_coords
        self.augment = RopeAugment(shift_coords, jitter_coords, rescale_coords)
        # Not persistent (timm's choice): it follows from the constructor, and timm's state dicts have none.
        self.register_buffer("periods", rope_periods(head_dim, self.temperature, min_period, max_period),
                             persistent=False)

    def forward(self, grid: tuple[int, int], aug: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        periods = self.periods
        if periods.dtype != torch.float32:  # .bfloat16() (DeepSpeed's bf16) rounds buffers; angles need float32
            periods = rope_periods(self.head_dim, self.temperature, self.min_period, self.max_period).to(periods.device)
        coords = patch_coords(grid, self.normalize_coords).to(periods.device)
        if aug is not None:
            coords = augment_coords(coords, aug.to(coords.device, torch.float32)).unsqueeze(-3)  # (B, 1, HW, 2)
        angles = 2 * math.pi * coords[..., None] / periods  # (..., HW, 2, d/4)
        angles = angles.flatten(-2).tile(2)  # (..., HW, d): [height | width] twice
        return angles.sin(), angles.cos()
