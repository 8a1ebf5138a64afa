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
from pipeline.model.dino import gather_rows
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
    """The teacher (`module`): a backbone, or a DINOv2/DINOv3 model whole (heads.py: `heads` True, its backbone
    `backbone`, its DINO and iBOT heads frozen with it); what it was read from and its digest (heads included)."""

    def __init__(self, found: Backbone, source: str, img_size: tuple[int, int],
                 init: Callable[[], AbstractContextManager[Any]]) -> None:
        state = found.model.state_dict()
        cls, kwargs = type(found.model), dict(found.kwargs)
        self.heads = hasattr(found.model, "dino_head")
        backbone = found.model.backbone if self.heads else found.model
        # A teacher trained at another size sees the student's images: its position table resized at forward time.
        if "dynamic_img_size" in inspect.signature(cls.__init__).parameters:
            kwargs["dynamic_img_size"] = True
        self.patch = backbone.patch_embed.patch_size[0]
        if img_size[0] % self.patch or img_size[1] % self.patch:
            raise WeightsError(f"distill.teacher={source}: its patch {self.patch} does not divide model.img_size="
                               f"{list(img_size)} (the teacher sees the student's images): use a multiple of "
                               f"{self.patch}")
        self.source, self.digest, self.dim = str(found.source), digest(state), backbone.embed_dim
        self.flops_kwargs = {**kwargs, "img_size": tuple(img_size)}
        self.kwargs = kwargs  # the constructor's (heads.py sizes the student's heads from them)
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
        self.backbone = self.module.backbone if self.heads else self.module

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
            out = self.backbone.forward_tokens(images.to(dtype))
        return out.cls_token.float(), out.patch_tokens.float(), grid

    @torch.no_grad()
    def head_outputs(self, global_crops: torch.Tensor, mask_indices: torch.Tensor | None,
                     autocast_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A teacher with heads: its DINO head on each global crop's class token (2B, K), in the crops' order
        (not swapped: the loss pairs the crops), and its iBOT head (its DINO head when not separate) on the
        patch tokens `mask_indices` gathers (M, K), of the unmasked crops as Meta's distillation; float32.
        Collective under ZeRO-3."""
        dtype = next(self.module.parameters()).dtype
        with ds_compat.gathered(self.module), torch.autocast(global_crops.device.type, dtype=autocast_dtype or dtype,
                                                             enabled=autocast_dtype is not None):
            t = self.backbone.forward_tokens(global_crops.to(dtype))
            cls_out = self.module.dino_head(t.cls_token)
            if mask_indices is None:
                return cls_out.float(), None
            masked = self.module.patch_head(gather_rows(t.patch_tokens, None, mask_indices))
        return cls_out.float(), masked.float()

    def tokens(self, images: torch.Tensor, student_grid: tuple[int, int], resize: str,
               autocast_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`native`, its patch tokens resized to the student's grid (B, N, Dt)."""
        cls, patches, grid = self.native(images, autocast_dtype)
        return cls, resize_patches(patches, grid, student_grid, resize)
