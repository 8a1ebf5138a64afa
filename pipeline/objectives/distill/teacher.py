"""The frozen teacher of a distillation: read from its source (`distill.teacher`: whatever `launch/finetune.py
--from` reads, through pipeline/objectives/backbone.py) at every start, never optimised, never checkpointed.

Float32 whatever the run's dtype, built in the objective's `init` (under ZeRO-3 partitioned as the student, and
gathered for each forward as DINOv2's teacher is: `ds_compat.gathered`), run under bf16 autocast where the
run's inputs are bf16 on a GPU. Its digest (of its float32 tensors) is the objective's state: a resume against
another teacher is refused, because the student and its projections were fitted to this one.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from pipeline import zero3
from pipeline.model.layers import init_param
from pipeline.model.weights import WeightsError
from pipeline.objectives.backbone import Backbone
from pipeline.objectives.dinov3.gram_teacher import resize_patches
from pipeline.train import ds_compat


def digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the names, shapes and float32 bytes of a state dict (its order of names sorted)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().float().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)};".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


class Teacher:
    """The teacher backbone (`module`), what it was read from and its digest."""

    def __init__(self, found: Backbone, source: str, img_size: tuple[int, int],
                 init: Callable[[], AbstractContextManager[Any]]) -> None:
        state = found.model.state_dict()
        cls, kwargs = type(found.model), dict(found.kwargs)
        # A teacher trained at another size sees the student's images: its position table resized at forward time.
        if "dynamic_img_size" in inspect.signature(cls.__init__).parameters:
            kwargs["dynamic_img_size"] = True
        self.patch = found.model.patch_embed.patch_size[0]
        if img_size[0] % self.patch or img_size[1] % self.patch:
            raise WeightsError(f"distill.teacher={source}: its patch {self.patch} does not divide model.img_size="
                               f"{list(img_size)} (the teacher sees the student's images): use a multiple of "
                               f"{self.patch}")
        self.source, self.digest, self.dim = str(found.source), digest(state), found.model.embed_dim
        self.flops_kwargs = {**kwargs, "img_size": tuple(img_size)}
        with init():
            self.module = cls(**kwargs)
        with torch.no_grad():
            for name, param in self.module.named_parameters():
                init_param(param, lambda target, v=state[name]: target.copy_(v.to(target.dtype)))
            for name, buf in self.module.named_buffers():
                if name in state:
                    buf.copy_(state[name])
        self.module.requires_grad_(False)
        self.module.eval()

    def to(self, device: torch.device) -> None:
        """The teacher onto `device`; a ZeRO-3 partitioned one is there already (its slices live on the device:
        moving the module would move only the empty placeholders), as `pipeline.train.ema.Ema.to`."""
        if not any(zero3.is_partitioned(p) for p in self.module.parameters()):
            self.module.to(device)

    @torch.no_grad()
    def native(self, images: torch.Tensor, autocast_dtype: torch.dtype | None
               ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """The teacher's forward: its class token (B, Dt) and patch tokens (B, N, Dt) after its final norm,
        float32, and its grid. Collective under ZeRO-3 (every rank gathers the teacher)."""
        dtype = next(self.module.parameters()).dtype
        grid = (images.shape[-2] // self.patch, images.shape[-1] // self.patch)
        with ds_compat.gathered(self.module), torch.autocast(images.device.type, dtype=autocast_dtype or dtype,
                                                             enabled=autocast_dtype is not None):
            out = self.module.forward_tokens(images.to(dtype))
        return out.cls_token.float(), out.patch_tokens.float(), grid

    def tokens(self, images: torch.Tensor, student_grid: tuple[int, int], resize: str,
               autocast_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`native`, its patch tokens resized to the student's grid (B, N, Dt)."""
        cls, patches, grid = self.native(images, autocast_dtype)
        return cls, resize_patches(patches, grid, student_grid, resize)
