"""DINOv3's Gram teacher (Meta's `gram_teacher` in dinov3/train/ssl_meta_arch.py): a frozen copy of the EMA
teacher's backbone, taken at gram.start_step and then every gram.update_every steps, gram.max_updates times
(Meta's gram_load_ema_teacher and update_gram), whose patch features of the global crops at a higher
resolution, resized to the student's grid, are the Gram loss's targets.

State, as the teacher is: float32 whatever the student's dtype, built in the objective's `init` (under ZeRO-3
partitioned as the teacher, so that a copy runs on each rank's own shards with no communication:
`pipeline.train.ema.Ema` at decay 0), saved whole (gathered) with every checkpoint and loaded on any world
size and ZeRO stage; as an adapt.anchor (the source, never updated) it is not saved but read again from the
source at a resume (pipeline/run/init_source.py's `reload_source`). When the copies happen is a function of the step alone (`takes_copy`): a resumed run
takes the ones an uninterrupted run would.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.train import ds_compat
from pipeline.train.ema import Ema


def takes_copy(step: int, start: int, every: int, max_updates: int | None) -> bool:
    """Whether the Gram teacher is taken from the EMA teacher before optimizer step `step` (steps done): at
    `start`, then every `every` steps after it, `max_updates` times at most (None: no limit)."""
    if step < start:
        return False
    if step == start:
        return True
    done, rest = divmod(step - start, every) if every else (0, 1)
    return rest == 0 and (max_updates is None or done <= max_updates)


def resize_patches(patches: torch.Tensor, grid: tuple[int, int], to: tuple[int, int], mode: str = "bicubic",
                   antialias: bool = False) -> torch.Tensor:
    """(B, h w, D) patch features on an h x w grid -> (B, H W, D) on `to`, as Meta resizes the Gram teacher's
    (F.interpolate, align_corners False)."""
    if grid == to:
        return patches
    b, _, d = patches.shape
    maps = patches.transpose(1, 2).reshape(b, d, *grid)
    maps = F.interpolate(maps, size=to, mode=mode, align_corners=False, antialias=antialias)
    return maps.flatten(2).transpose(1, 2)


class GramTeacher:
    """The Gram teacher's backbone and its copies. `backbone` is a module of the EMA teacher's backbone's
    structure (its parameters in the same order and, under ZeRO-3, partitioned alike)."""

    def __init__(self, backbone: nn.Module, start: int, every: int, max_updates: int | None) -> None:
        backbone.requires_grad_(False)
        backbone.eval()
        self.backbone, self.start, self.every, self.max_updates = backbone, start, every, max_updates
        self.copy = Ema(backbone, "scale_add", buffers=False)

    def takes_copy(self, step: int) -> bool:
        return takes_copy(step, self.start, self.every, self.max_updates)

    def copies_taken(self, step: int) -> int:
        """How many copies were taken before optimizer step `step` (for the log)."""
        return sum(self.takes_copy(s) for s in range(self.start, step + 1))

    @torch.no_grad()
    def take(self, teacher_backbone: nn.Module) -> None:
        """The Gram teacher becomes the EMA teacher's backbone (on each rank's own partitions)."""
        self.copy.update(teacher_backbone, 0.0)

    def to(self, device: torch.device) -> None:
        self.copy.to(device)

    @torch.no_grad()
    def patch_features(self, crops: torch.Tensor, student_grid: tuple[int, int], mode: str, antialias: bool,
                       autocast_dtype: torch.dtype | None) -> torch.Tensor:
        """The Gram teacher's patch tokens (after the final norm) of `crops` (n, 3, S, S), resized to the
        student's grid; float32. Collective under ZeRO-3 (every rank gathers the backbone)."""
        dtype = next(self.backbone.parameters()).dtype
        patch = self.backbone.patch_embed.patch_size
        grid = (crops.shape[-2] // patch[0], crops.shape[-1] // patch[1])
        with ds_compat.gathered(self.backbone), torch.autocast(crops.device.type, dtype=autocast_dtype or dtype,
                                                               enabled=autocast_dtype is not None):
            tokens = self.backbone.forward_tokens(crops.to(dtype)).patch_tokens
        return resize_patches(tokens.float(), grid, student_grid, mode, antialias)

    def state_dict(self) -> dict[str, Any]:
        """The backbone's full fp32 tensors on the CPU (collective under ZeRO-3)."""
        return self.copy.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.copy.load_state_dict(state)
