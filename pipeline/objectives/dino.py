"""DINOv2 (Oquab et al. 2023; issue 33): the objective `model.objective: dinov2` and its loss pieces.

The loss pieces: `DINOHead`, `DINOLoss`, `iBOTPatchLoss` and `KoLeoLoss` with the official classes'
names, constructor arguments, buffers (`center`), state-dict keys and methods, so code and checkpoints
written against Meta's `dinov2/layers/dino_head.py` and `dinov2/loss/*.py` move across unchanged. They are
checked against the official code in tests/unit/test_dino_official.py (skipped without DINOV2_OFFICIAL_REPO).

The objective (`DINOv2`, below them; Meta's `SSLMetaArch` is the reference): `DINOv2Model` (backbone +
heads) as the student DeepSpeed trains and, a second instance kept on the objective, the teacher (its EMA);
each sample's multi-crop view and iBOT masks drawn in the loader workers from the sample's seed
(`MultiCropView`); the k-NN and PCA evaluation of the teacher. docs/dino.md has the recipe and what
differs from Meta's loop.

Where we differ from Meta's code, on purpose:

- Distributed: where the official code all-reduces (the centre update, the Sinkhorn-Knopp sums and, for
  iBOT, the number of masked patches) ours all-reduces too, synchronously, whenever a default process
  group is initialised; so 2 ranks with half the batch each give the centre and teacher assignments of
  1 rank with all of it (tests/unit/test_dino_pieces.py). Meta's centre update is asynchronous: the
  all-reduce is started in `update_center` and the new centre is applied lazily at the next
  `softmax_center_teacher`. Ours applies it in `update_center`. In Meta's loop (softmax of this step's
  teacher output, then `update_center` with it) the centre each softmax sees is the same; the difference
  is that our `center` buffer is up to date the moment a step ends, so a checkpoint taken then holds the
  update (Meta's would lose a pending one). `apply_center_update` is kept for code that calls it and does
  nothing, since no update is ever pending.
- `DINOHead.last_layer` is weight-normalised by a small module of ours holding `weight_g` and `weight_v`,
  the parameters (names and shapes) that Meta's `torch.nn.utils.weight_norm` creates, instead of that
  deprecated hook; the state dicts are interchangeable.
- KoLeo turns autocast off with `torch.autocast(device_type=..., enabled=False)` for the input's device
  (Meta's uses the CUDA-only, deprecated `torch.cuda.amp.autocast`). As in Meta's code it is computed
  per rank: nearest neighbours among the rank's own class tokens, no all-reduce.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline.config import Config, ConfigError, DataConfig
from pipeline.data import build_eval_loader, raise_if_any_failed
from pipeline.data.multicrop import MultiCrop, MultiCropConfig, block_mask
from pipeline.data.order import IBOT_MASK, seed_for
from pipeline.dist import DistEnv
from pipeline.model.vit import (
    VisionTransformer,
    _init_param,
    _trunc_normal,
    model_flops,
    model_kwargs_from_config,
)
from pipeline.objectives.base import EvalResult, Objective
from pipeline.objectives.mae import knn_top1, label_free
from pipeline.train import ds_compat
from pipeline.train.checkpoint import CheckpointError, checkpoint_dir, read_client_state
from pipeline.train.ema import Ema

__all__ = ["DINOHead", "DINOLoss", "iBOTPatchLoss", "KoLeoLoss", "DINOv2", "DINOv2Model", "MultiCropView"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _world_size() -> int:
    return dist.get_world_size() if _distributed() else 1


def _all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place, when a process group exists; a no-op on one process without one."""
    if _distributed():
        dist.all_reduce(tensor)
    return tensor


def _sinkhorn_knopp(teacher_output: torch.Tensor, teacher_temp: float, n_samples_total: torch.Tensor | int,
                    n_iterations: int) -> torch.Tensor:
    """SwAV's Sinkhorn-Knopp over the batch of every rank: rows (prototypes) and columns (samples) are
    normalised in turn, the row sums all-reduced so each prototype gets 1/K of the global batch."""
    q = torch.exp(teacher_output.float() / teacher_temp).t()  # K x B, the notation of the SwAV paper
    n_prototypes = q.shape[0]
    total = q.sum()
    q /= _all_reduce_sum(total)
    for _ in range(n_iterations):
        rows = q.sum(dim=1, keepdim=True)
        q /= _all_reduce_sum(rows)
        q /= n_prototypes
        q /= q.sum(dim=0, keepdim=True)
        q /= n_samples_total
    q *= n_samples_total  # each column (sample) now sums to 1: an assignment
    return q.t()


class _WeightNormLinear(nn.Module):
    """A bias-free Linear with weight = g * v / ||v|| (norm over the input dimension, per output row):
    what `torch.nn.utils.weight_norm(nn.Linear(...), dim=0)` computes, with the same parameter names
    (`weight_g` of shape (out, 1), `weight_v` of shape (out, in)), so Meta's head state dict loads."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        # g before v: the order weight_norm registers them in, so the state dicts list the same keys in turn.
        self.weight_g = nn.Parameter(torch.ones(out_features, 1))  # Meta fills g with 1
        # nn.Linear's init for v, as Meta's (the same draws as nn.Linear(bias=False).reset_parameters), made
        # here and not copied from an inner nn.Linear: under deepspeed.zero.Init that Linear would already be
        # partitioned (an empty tensor) when copied.
        self.weight_v = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.kaiming_uniform_(self.weight_v, a=math.sqrt(5))

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_g * self.weight_v / self.weight_v.norm(dim=1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _build_mlp(nlayers: int, in_dim: int, bottleneck_dim: int, hidden_dim: int, use_bn: bool,
               bias: bool) -> nn.Module:
    """Meta's layout (module indices included, so `mlp.N.weight` keys match): Linear [BN] GELU ... Linear."""
    if nlayers == 1:
        return nn.Linear(in_dim, bottleneck_dim, bias=bias)
    layers: list[nn.Module] = []
    dims = [in_dim] + [hidden_dim] * (nlayers - 1)
    for d_in, d_out in zip(dims[:-1], dims[1:]):
        layers.append(nn.Linear(d_in, d_out, bias=bias))
        if use_bn:
            layers.append(nn.BatchNorm1d(d_out))
        layers.append(nn.GELU())
    layers.append(nn.Linear(hidden_dim, bottleneck_dim, bias=bias))
    return nn.Sequential(*layers)


class DINOHead(nn.Module):
    """DINO's projection head: an MLP to a bottleneck, L2-normalised, then weight-normalised prototypes.

    Same arguments, defaults and state-dict keys as Meta's `dinov2.layers.DINOHead`
    (`mlp.{0,2,4}.weight/bias`, `last_layer.weight_g`, `last_layer.weight_v`). The MLP's Linears start
    truncated-normal (std 0.02) with zero biases; the prototypes keep nn.Linear's init with g = 1.
    """

    def __init__(self, in_dim: int, out_dim: int, use_bn: bool = False, nlayers: int = 3,
                 hidden_dim: int = 2048, bottleneck_dim: int = 256, mlp_bias: bool = True) -> None:
        super().__init__()
        nlayers = max(nlayers, 1)
        self.mlp = _build_mlp(nlayers, in_dim, bottleneck_dim, hidden_dim, use_bn, mlp_bias)
        self.apply(self._init_weights)
        self.last_layer = _WeightNormLinear(bottleneck_dim, out_dim)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mlp(x)
        # fp16 cannot represent 1e-12; Meta's choice of eps per dtype.
        eps = 1e-6 if x.dtype == torch.float16 else 1e-12
        x = F.normalize(x, dim=-1, p=2, eps=eps)
        return self.last_layer(x)


class DINOLoss(nn.Module):
    """DINO's class-token loss: cross-entropy of the student's softmax (temperature `student_temp`)
    against the teacher's centred-and-sharpened softmax or its Sinkhorn-Knopp assignment, summed over
    every (student crop, teacher crop) pair given. The `center` buffer (1, out_dim) is an EMA
    (`center_momentum`) of the teacher's mean output over the global batch."""

    def __init__(self, out_dim: int, student_temp: float = 0.1, center_momentum: float = 0.9) -> None:
        super().__init__()
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.register_buffer("center", torch.zeros(1, out_dim))

    @torch.no_grad()
    def softmax_center_teacher(self, teacher_output: torch.Tensor, teacher_temp: float) -> torch.Tensor:
        return F.softmax((teacher_output - self.center) / teacher_temp, dim=-1)

    @torch.no_grad()
    def sinkhorn_knopp_teacher(self, teacher_output: torch.Tensor, teacher_temp: float,
                               n_iterations: int = 3) -> torch.Tensor:
        # Every rank holds the same number of samples (Meta's assumption too): B = local * world.
        return _sinkhorn_knopp(teacher_output, teacher_temp, teacher_output.shape[0] * _world_size(),
                               n_iterations)

    def forward(self, student_output_list: list[torch.Tensor],
                teacher_out_softmaxed_centered_list: list[torch.Tensor]) -> torch.Tensor:
        total_loss = 0
        for s in student_output_list:
            lsm = F.log_softmax(s / self.student_temp, dim=-1)
            for t in teacher_out_softmaxed_centered_list:
                total_loss -= torch.sum(t * lsm, dim=-1).mean()
        return total_loss

    @torch.no_grad()
    def update_center(self, teacher_output: torch.Tensor) -> None:
        batch_center = _all_reduce_sum(teacher_output.sum(dim=0, keepdim=True))
        batch_center /= teacher_output.shape[0] * _world_size()
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)

    def apply_center_update(self) -> None:
        """Kept for code written against Meta's class: `update_center` has already applied the update."""


class iBOTPatchLoss(nn.Module):  # noqa: N801 - Meta's name, kept so their code moves across
    """iBOT's patch-token loss: the DINO cross-entropy on the masked patches of the global crops, each
    image's patches weighted 1 / (its number of masked patches), averaged over images. The `center`
    buffer (1, 1, patch_out_dim) is an EMA of the teacher's mean patch output."""

    def __init__(self, patch_out_dim: int, student_temp: float = 0.1, center_momentum: float = 0.9) -> None:
        super().__init__()
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.register_buffer("center", torch.zeros(1, 1, patch_out_dim))

    @torch.no_grad()
    def softmax_center_teacher(self, teacher_patch_tokens: torch.Tensor, teacher_temp: float) -> torch.Tensor:
        """(B, N, K) or gathered (1, M, K), as Meta's meta-arch passes them: the centre is (1, 1, K)."""
        return F.softmax((teacher_patch_tokens - self.center) / teacher_temp, dim=-1)

    @torch.no_grad()
    def sinkhorn_knopp_teacher(self, teacher_output: torch.Tensor, teacher_temp: float,
                               n_masked_patches_tensor: torch.Tensor, n_iterations: int = 3) -> torch.Tensor:
        """`teacher_output` is (local masked patches, K); `n_masked_patches_tensor` this rank's count,
        summed over ranks here (on a copy: Meta's all-reduces the caller's tensor in place)."""
        n_total = _all_reduce_sum(torch.as_tensor(n_masked_patches_tensor, device=teacher_output.device).clone())
        return _sinkhorn_knopp(teacher_output, teacher_temp, n_total, n_iterations)

    def forward(self, student_patch_tokens: torch.Tensor, teacher_patch_tokens: torch.Tensor,
                student_masks_flat: torch.Tensor) -> torch.Tensor:
        """Dense form: tokens (B, N, D), masks (B, N) boolean."""
        loss = torch.sum(teacher_patch_tokens * F.log_softmax(student_patch_tokens / self.student_temp, dim=-1),
                         dim=-1)
        loss = torch.sum(loss * student_masks_flat.float(), dim=-1) / student_masks_flat.sum(dim=-1).clamp(min=1.0)
        return -loss.mean()

    def forward_masked(self, student_patch_tokens_masked: torch.Tensor, teacher_patch_tokens_masked: torch.Tensor,
                       student_masks_flat: torch.Tensor, n_masked_patches: int | None = None,
                       masks_weight: torch.Tensor | None = None) -> torch.Tensor:
        """Gathered form: tokens (M, D) for the M masked patches in `student_masks_flat` (B, N) order;
        `n_masked_patches` keeps the first M' rows (Meta pads the gathered tokens to a fixed length)."""
        # float32 as Meta's (both its xFormers cross_entropy and its fallback end in float32 here).
        s = student_patch_tokens_masked.float()
        t = teacher_patch_tokens_masked.float()
        loss = torch.sum(t * F.log_softmax(s / self.student_temp, dim=-1), dim=-1)
        if masks_weight is None:
            per_image = 1 / student_masks_flat.sum(-1).clamp(min=1.0)
            masks_weight = per_image.unsqueeze(-1).expand_as(student_masks_flat)[student_masks_flat]
        if n_masked_patches is not None:
            loss = loss[:n_masked_patches]
        return -(loss * masks_weight).sum() / student_masks_flat.shape[0]

    @torch.no_grad()
    def update_center(self, teacher_patch_tokens: torch.Tensor) -> None:
        """`teacher_patch_tokens` (B, N, D): the centre moves toward the mean over images of each image's
        mean patch output, over the global batch."""
        batch_center = _all_reduce_sum(teacher_patch_tokens.mean(1).sum(dim=0, keepdim=True))
        batch_center /= teacher_patch_tokens.shape[0] * _world_size()
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)

    def apply_center_update(self) -> None:
        """Kept for code written against Meta's class: `update_center` has already applied the update."""


class KoLeoLoss(nn.Module):
    """The Kozachenko-Leonenko entropy estimator as a regulariser (Sablayrolles et al. 2018): minus the
    mean log distance of each L2-normalised vector to its nearest neighbour in the batch, which pushes the
    class tokens to spread out. Autocast is off (the input's own dtype is kept) and only this rank's vectors
    count, as in Meta's."""

    def __init__(self) -> None:
        super().__init__()
        self.pdist = nn.PairwiseDistance(2, eps=1e-8)

    def pairwise_NNs_inner(self, x: torch.Tensor) -> torch.Tensor:  # noqa: N802 - Meta's name
        """Index of each row's nearest neighbour among the others (largest inner product, unit vectors)."""
        dots = x @ x.t()
        dots.fill_diagonal_(-1)  # a vector is not its own neighbour; -1 is below any other cosine
        return dots.argmax(dim=1)

    def forward(self, student_output: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
        with torch.autocast(device_type=student_output.device.type, enabled=False):
            x = F.normalize(student_output, eps=eps, p=2, dim=-1)
            nearest = self.pairwise_NNs_inner(x)
            distances = self.pdist(x, x[nearest])
            return -torch.log(distances + eps).mean()


# ============================================================================= the DINOv2 objective


def _head_flops(head: dict[str, Any], embed_dim: int, prototypes: int) -> float:
    """Forward FLOPs of one token through a DINOHead (its Linears; the norm and GELU left out)."""
    n, hidden, bottleneck = head["head_nlayers"], head["head_hidden_dim"], head["head_bottleneck_dim"]
    dims = [embed_dim] + [hidden] * (n - 1) + [bottleneck] if n > 1 else [embed_dim, bottleneck]
    return 2.0 * (sum(a * b for a, b in zip(dims[:-1], dims[1:])) + bottleneck * prototypes)


HEAD_KEYS = ("head_n_prototypes", "head_hidden_dim", "head_bottleneck_dim", "head_nlayers", "ibot_separate_head",
             "ibot_head_n_prototypes", "ibot_head_bottleneck_dim")


class DINOv2Model(nn.Module):
    """The student (and, another instance, the teacher) of DINOv2: a `VisionTransformer` backbone (with
    `mask_token`, no classifier) and the DINO head, plus an iBOT head when it is separate (Meta's
    `student`/`teacher` ModuleDicts: `backbone`, `dino_head`, `ibot_head`). The constructor takes the
    backbone's arguments and the heads' (`HEAD_KEYS`) in one flat dict, the run's recorded model kwargs;
    `patch_embed_lr_mult` (dino.patch_embed_lr_mult) is optimizer metadata the objective passes, not
    recorded with the model: it may change on resume, the parameter groups do not (see `param_roles`)."""

    def __init__(self, head_n_prototypes: int = 65536, head_hidden_dim: int = 2048, head_bottleneck_dim: int = 256,
                 head_nlayers: int = 3, ibot_separate_head: bool = False, ibot_head_n_prototypes: int = 65536,
                 ibot_head_bottleneck_dim: int = 256, patch_embed_lr_mult: float = 1.0, **vit_kwargs: Any) -> None:
        super().__init__()
        self.patch_embed_lr_mult = patch_embed_lr_mult
        self.backbone = VisionTransformer(**{**vit_kwargs, "num_classes": 0, "mask_token": True})
        dim = self.backbone.embed_dim

        def head(out_dim: int, bottleneck_dim: int) -> DINOHead:
            h = DINOHead(dim, out_dim, hidden_dim=head_hidden_dim, bottleneck_dim=bottleneck_dim, nlayers=head_nlayers)
            # DINOHead's own trunc-normal init ran on partitions under deepspeed.zero.Init (its Linears were
            # partitioned when built): redo it on the gathered tensors (a no-op difference otherwise).
            for m in h.mlp.modules() if isinstance(h.mlp, nn.Sequential) else [h.mlp]:
                if isinstance(m, nn.Linear):
                    _init_param(m.weight, _trunc_normal(0.02))
                    if m.bias is not None:
                        _init_param(m.bias, nn.init.zeros_)
            return h

        self.dino_head = head(head_n_prototypes, head_bottleneck_dim)
        self.ibot_head = head(ibot_head_n_prototypes, ibot_head_bottleneck_dim) if ibot_separate_head else None

    # -- what the trainer and the optimizer ask of a model
    def no_weight_decay(self) -> set[str]:
        """None beyond the optimizer's rule (biases and 1-D parameters: norms, LayerScale gammas): Meta's
        `get_params_groups_with_decay` exempts only names ending in `.bias` or holding `norm` or `gamma`, so
        the position table, class, register and mask tokens are decayed, unlike the ViT's timm/DeiT set."""
        return set()

    def group_matcher(self, coarse: bool = False) -> dict[str, str]:
        """The backbone's layers (Meta's layer-wise decay numbers only backbone parameters; the heads are the
        last layer, scale 1)."""
        return {k: r"^backbone\." + v.lstrip("^") for k, v in self.backbone.group_matcher(coarse).items()}

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.backbone.set_grad_checkpointing(enable)

    def param_roles(self) -> dict[str, str]:
        """The parameters DINOv2's optimizer treats apart (Meta's `get_params_groups_with_decay`):
        `patch_embed` ("patch_embed" in the name: its lr x `patch_embed_lr_mult`) and `last_layer` (the
        heads' weight-normalised prototypes, `is_last_layer`: lr 0 for dino.freeze_last_layer_steps, which
        the objective applies). Each is a parameter group of its own (`pipeline.train.optim.param_groups`)."""
        return {"patch_embed": r"^backbone\.patch_embed\.", "last_layer": r"^(dino_head|ibot_head)\.last_layer\."}

    def lr_multipliers(self) -> dict[str, float]:
        """Role -> factor on the lr (on top of layer-wise decay, as Meta multiplies them)."""
        return {"patch_embed": self.patch_embed_lr_mult}

    @property
    def patch_head(self) -> DINOHead:
        return self.ibot_head if self.ibot_head is not None else self.dino_head

    # -- the student's forward (through the DeepSpeed engine) and the teacher's
    def forward(self, global_crops: torch.Tensor, local_crops: torch.Tensor | None,
                masks: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Student: global crops (2B, 3, G, G) crop-major, with iBOT's `masks` (2B, N) on their patches;
        local crops (nB, 3, L, L) or None. Returns the heads' outputs of the global and local class tokens,
        of the masked patches (in `masks`' row-major order) and the global class tokens before the head
        (KoLeo's input)."""
        g = self.backbone.forward_tokens(global_crops, masks)
        out = {"global_cls": g.cls_token, "global": self.dino_head(g.cls_token)}
        if local_crops is not None:
            out["local"] = self.dino_head(self.backbone.forward_tokens(local_crops).cls_token)
        if masks is not None:
            out["masked"] = self.patch_head(g.patch_tokens[masks])
        return out

    @torch.no_grad()
    def teacher_forward(self, global_crops: torch.Tensor, masks: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher: the DINO head's output for each global crop's class token, the two crops of an image
        swapped (crop A's target is crop B's output, as Meta's), and the patch head's output on the masked
        patches of the unmasked crops."""
        t = self.backbone.forward_tokens(global_crops)
        first, second = t.cls_token.chunk(2)
        cls_out = self.dino_head(torch.cat([second, first]))
        return cls_out, (self.patch_head(t.patch_tokens[masks]) if masks is not None else None)


class MultiCropView:
    """The DINOv2 objective's view of a training sample (`Objective.sample_view`), in the loader workers:
    (global crops (2, 3, G, G), local crops (n, 3, L, L), iBOT masks (2, N) bool), every draw from the
    sample's augmentation seed (the crops by `MultiCrop`, each global crop's mask by `block_mask` seeded
    with (IBOT_MASK, seed, crop)), so the same on any layout. Picklable (it travels to the workers)."""

    def __init__(self, crops: MultiCropConfig, grid: tuple[int, int], mask_probability: float,
                 mask_ratio: tuple[float, float]) -> None:
        self.multicrop = MultiCrop(crops)
        self.grid, self.mask_probability, self.mask_ratio = grid, mask_probability, tuple(mask_ratio)

    def __call__(self, image: Any, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        crops = self.multicrop(image, seed)
        size = self.multicrop.cfg.local_crops_size
        local = torch.stack(crops["local_crops"]) if crops["local_crops"] else torch.zeros(0, 3, size, size)
        masks = torch.stack([block_mask(seed_for(IBOT_MASK, seed, i), self.grid, self.mask_probability,
                                        self.mask_ratio).flatten() for i in range(2)])
        return torch.stack(crops["global_crops"]), local, masks


def _cosine(step: int, total: int, start: float, end: float) -> float:
    """Meta's CosineScheduler without warm-up: `start` at step 0 toward `end` at step `total`."""
    return end + 0.5 * (start - end) * (1 + math.cos(math.pi * min(step, total) / max(total, 1)))


def dinov2_model_kwargs(cfg: Config) -> dict[str, Any]:
    """`DINOv2Model` arguments: the backbone from model.* (as a supervised ViT, no classifier, any input
    size for the local crops) and the heads from dino.*."""
    vit = model_kwargs_from_config(cfg.model, 0)
    patch, img = vit["patch_size"], vit["img_size"]
    size = img if isinstance(img, int) else img[0]
    if not isinstance(img, int) and img[0] != img[1]:
        raise ConfigError(f"model.img_size={list(img)}: DINOv2's global crops are square; give one side")
    if size % patch or cfg.dino.local_crops_size % patch:
        raise ConfigError(f"model.img_size ({size}) and dino.local_crops_size ({cfg.dino.local_crops_size}) must be "
                          f"multiples of the patch size ({patch}): the crops are cut into whole patches")
    vit.update(num_classes=0, dynamic_img_size=True)
    return {**vit, **{k: getattr(cfg.dino, k) for k in HEAD_KEYS}}


class DINOv2(Objective):
    """DINOv2 self-distillation (Oquab et al. 2023, Meta's `SSLMetaArch`): the student is the model DeepSpeed
    trains; the teacher, an EMA of it (momentum cosine from dino.momentum_teacher to 1 over train.steps),
    built beside it and kept here, gives the targets: DINO on the class tokens of 2 global and n local
    crops, iBOT on the masked patches of the global crops, KoLeo on the student's global class tokens.
    The teacher is what is evaluated (k-NN of its class token, PCA of its patch features) and exported.

    Layout-free, as every guarantee asks: crops and masks come from each sample's seed; the centres move once
    per optimizer step from the teacher outputs of the whole global batch (sums all-reduced in `after_step`;
    Meta, without gradient accumulation, does the same per iteration); KoLeo's neighbours are those of the
    micro batch (the same samples on any layout with the same micro batch size). Sinkhorn-Knopp normalises
    over the micro batches of one accumulation round of all ranks, which depends on the layout.
    """

    model_class = DINOv2Model

    def __init__(self, cfg: Config, info: Any):
        super().__init__(cfg, info)
        d = cfg.dino
        self.teacher: DINOv2Model | None = None
        self.teacher_ema: Ema | None = None  # the teacher's update (built with it, in build_companions)
        self.dino_loss = DINOLoss(d.head_n_prototypes, student_temp=d.student_temp)
        self.ibot_loss = iBOTPatchLoss(d.ibot_head_n_prototypes if d.ibot_separate_head else d.head_n_prototypes,
                                       student_temp=d.student_temp)
        self.koleo_loss = KoLeoLoss()
        self.step = 0  # optimizer steps done (the schedules' position)
        self._begun = -1  # the step whose schedules were last applied to the optimizer
        self._sums: dict[str, torch.Tensor] = {}  # this step's teacher outputs for the centres: sum, count
        self._window: torch.Tensor | None = None  # train_metrics: per-term sums on the device since the last log
        self._window_names: list[str] = []  # what each entry of _window is (its last: the micro batch count)
        self.knn_loader: Any = None

    # -- the models
    def model_kwargs(self) -> dict[str, Any]:
        return dinov2_model_kwargs(self.cfg)

    def build_model(self, model_kwargs: dict[str, Any]) -> nn.Module:
        return DINOv2Model(**model_kwargs, patch_embed_lr_mult=self.cfg.dino.patch_embed_lr_mult)

    def build_companions(self, model: nn.Module, model_kwargs: dict[str, Any],
                         init: Callable[[], AbstractContextManager[Any]]) -> None:
        # The teacher: no stochastic depth (Meta's), never trained; float32 whatever the student's dtype (an
        # EMA at momentum 0.992-1 in bf16 would round most updates away; Meta's FSDP teacher keeps fp32
        # shards too), under ZeRO-3 partitioned as the student, so that its EMA runs on each rank's shard.
        with init():
            self.teacher = DINOv2Model(**{**model_kwargs, "drop_path_rate": 0.0})
        self.teacher.requires_grad_(False)
        self.teacher.eval()
        # Meta's update (teacher x m + student x (1 - m)) of the parameters, on each rank's own partitions at
        # ZeRO-3: the machinery of train.ema_decay's model EMA (pipeline/train/ema.py).
        self.teacher_ema = Ema(self.teacher, "scale_add", buffers=False)
        self.teacher_ema.update(model, 0.0)  # the teacher starts as the student

    # -- the data
    def train_data(self) -> DataConfig:
        return label_free(self.cfg.data)  # no labels read: DINOv2 trains on unlabelled shards

    def sample_view(self, model_kwargs: dict[str, Any]) -> MultiCropView:
        d, data = self.cfg.dino, self.cfg.data
        img, patch = model_kwargs["img_size"], model_kwargs["patch_size"]
        size = img if isinstance(img, int) else img[0]
        crops = MultiCropConfig(global_crops_size=size, global_crops_scale=tuple(d.global_crops_scale),
                                local_crops_number=d.local_crops_number, local_crops_size=d.local_crops_size,
                                local_crops_scale=tuple(d.local_crops_scale), color_jitter_p=d.color_jitter_p,
                                greyscale_p=d.greyscale_p, blur_p=tuple(d.blur_p), solarize_p=d.solarize_p,
                                mean=tuple(data.mean), std=tuple(data.std))
        return MultiCropView(crops, (size // patch, size // patch), d.mask_probability, tuple(d.mask_ratio))

    def build_eval(self, env: DistEnv, img_size: tuple[int, int], batch: int) -> list[Any]:
        cfg, info = self.cfg, self.info
        labelled = info.num_classes > 0
        self.eval_loader = build_eval_loader(cfg.data if labelled else label_free(cfg.data), img_size, batch,
                                             rank=env.rank, world_size=env.world_size, info=info)
        self.knn_loader = None
        if labelled and cfg.dino.knn_k > 0:  # the memory: the first dino.knn_train_samples of the train split
            self.knn_loader = build_eval_loader(dataclasses.replace(cfg.data, val_split=cfg.data.train_split),
                                                img_size, batch, rank=env.rank, world_size=env.world_size,
                                                info=info, limit=cfg.dino.knn_train_samples)
        return [x for x in (self.eval_loader, self.knn_loader) if x is not None]

    # -- the schedules
    def teacher_temp(self, step: int) -> float:
        d = self.cfg.dino
        if step >= d.teacher_temp_warmup_steps:
            return d.teacher_temp
        return d.warmup_teacher_temp + (d.teacher_temp - d.warmup_teacher_temp) * step / d.teacher_temp_warmup_steps

    def momentum(self, step: int) -> float:
        d = self.cfg.dino
        return _cosine(step, self.cfg.train.steps, d.momentum_teacher, d.final_momentum_teacher)

    def weight_decay(self, step: int) -> float:
        return _cosine(step, self.cfg.train.steps, self.cfg.train.weight_decay, self.cfg.dino.weight_decay_end)

    def _begin_step(self, engine: Any) -> None:
        """Once per optimizer step, at its first micro batch (also the first after a resume, whose restored
        optimizer carries train.weight_decay): the step's weight decay into every decayed parameter group
        (Meta's `apply_optim_scheduler`: wd x wd_multiplier, 0 or 1), lr 0 for the prototypes' groups
        (role `last_layer`) during the first dino.freeze_last_layer_steps (Meta's last_layer_lr schedule:
        gradients are computed, count in the clipping norm and fill AdamW's moments; with lr 0 neither the
        step nor the decoupled decay moves the weights), the teacher and the loss centres on the engine's
        device. The lr needs no restoring after the freeze: the trainer's schedule sets every group's lr
        after each optimizer step, before the next step's first micro batch."""
        if self._begun == self.step:
            return
        self._begun = self.step
        wd = self.weight_decay(self.step)
        frozen = self.step < self.cfg.dino.freeze_last_layer_steps
        for group in engine.optimizer.param_groups:
            if group.get("decay", group.get("weight_decay", 0.0) > 0):
                group["weight_decay"] = wd
            if frozen and group.get("role") == "last_layer":
                group["lr"] = 0.0
        device = engine.device
        self.teacher_ema.to(device)
        for loss in (self.dino_loss, self.ibot_loss):
            loss.to(device)

    def _accumulate(self, name: str, outputs: torch.Tensor) -> None:
        """This micro batch's teacher outputs toward the step's centre update (sum and count, float64)."""
        total = torch.cat([outputs.double().sum(0), outputs.new_tensor([outputs.shape[0]], dtype=torch.float64)])
        self._sums[name] = self._sums[name] + total if name in self._sums else total

    # -- a step
    def loss(self, engine: Any, images: Any, targets: torch.Tensor, extras: torch.Tensor | None) -> torch.Tensor:
        self._begin_step(engine)
        d = self.cfg.dino
        global_crops, local_crops, masks = images
        b, n_local = global_crops.shape[0], local_crops.shape[1]
        # Crop-major, as Meta's collate: all images' first global crop, then all second ones.
        global_crops = global_crops.transpose(0, 1).flatten(0, 1)
        local_crops = local_crops.transpose(0, 1).flatten(0, 1) if n_local else None
        masks = masks.transpose(0, 1).flatten(0, 1) if d.ibot_loss_weight > 0 else None
        temp = self.teacher_temp(self.step)

        teacher_dtype = next(self.teacher.parameters()).dtype
        with ds_compat.gathered(self.teacher), torch.autocast(engine.device.type, dtype=global_crops.dtype,
                                                              enabled=engine.device.type == "cuda"
                                                              and global_crops.dtype != teacher_dtype):
            t_cls, t_masked = self.teacher.teacher_forward(global_crops.to(teacher_dtype), masks)
        t_cls = t_cls.float()
        if d.centering == "centering":
            t_dino = self.dino_loss.softmax_center_teacher(t_cls, temp)
            self._accumulate("dino", t_cls)
        else:
            t_dino = self.dino_loss.sinkhorn_knopp_teacher(t_cls, temp)
        t_dino = t_dino.view(2, b, -1)

        out = engine(global_crops, local_crops, masks)
        terms = 2 + 2 * n_local  # (student crop, teacher crop) pairs: global-global (not the same crop) and local
        losses: dict[str, torch.Tensor] = {}
        if n_local:
            losses["dino_local"] = self.dino_loss(out["local"].float().chunk(n_local), list(t_dino)) / terms
        # The two global crops are scored in one call against the swapped targets: x2 for the two pairs.
        losses["dino_global"] = self.dino_loss([out["global"].float()], [t_dino.flatten(0, 1)]) * 2 / terms
        total = d.dino_loss_weight * sum(losses.values())
        if d.koleo_loss_weight > 0:  # not between the two crops of one image: each crop's batch apart
            losses["koleo"] = d.koleo_loss_weight * sum(self.koleo_loss(c.float()) for c in out["global_cls"].chunk(2))
            total = total + losses["koleo"]
        if masks is not None:
            t_masked = t_masked.float()
            if d.centering == "centering":
                t_ibot = self.ibot_loss.softmax_center_teacher(t_masked.unsqueeze(0), temp).squeeze(0)
                self._accumulate("ibot", t_masked)
            else:
                t_ibot = self.ibot_loss.sinkhorn_knopp_teacher(t_masked, temp, masks.sum())
            # Meta's scale: x2 (the global crops together) x 1/2 (per global crop) = 1.
            losses["ibot"] = self.ibot_loss.forward_masked(out["masked"].float(), t_ibot, masks)
            total = total + d.ibot_loss_weight * losses["ibot"]
        self._log_terms(losses, t_dino, total)
        return total

    @torch.no_grad()
    def _log_terms(self, losses: dict[str, torch.Tensor], t_dino: torch.Tensor, total: torch.Tensor) -> None:
        """Adds this micro batch's terms to the log window, on the device (no sync), unless its loss is not
        finite (the trainer skips such a micro batch). Names as in Meta's loss_dict, each weighted as it is
        added to the loss, so that they sum to it (Meta logs ibot_loss at half of what it adds). The
        entropy of the teacher's DINO targets watches for collapse: log(dino.head_n_prototypes) when they are
        uniform (the centre has caught up with outputs that no longer differ between images), near 0 when
        every image gets one prototype."""
        d = self.cfg.dino
        names = {"dino_local": ("dino_local_crops_loss", d.dino_loss_weight),
                 "dino_global": ("dino_global_crops_loss", d.dino_loss_weight),
                 "koleo": ("koleo_loss", 1.0), "ibot": ("ibot_loss", d.ibot_loss_weight)}  # koleo's is inside
        self._window_names = [names[k][0] for k in losses] + ["dino_teacher_entropy"]
        # One vector per micro batch (the terms, the entropy, a count of 1), zeroed when the loss is not
        # finite: a few kernels per micro batch, whatever the number of terms.
        values = torch.stack([*(names[k][1] * v.float() for k, v in losses.items()),
                              torch.special.entr(t_dino).sum(-1).mean(), torch.ones_like(total)])
        values = torch.where(torch.isfinite(total), values, 0.0)
        self._window = values if self._window is None else self._window + values

    def train_metrics(self) -> dict[str, torch.Tensor]:
        if self._window is None:
            return {}
        sums, self._window = self._window, None
        means = sums[:-1] / sums[-1].clamp_min(1)  # the last entry counts the finite micro batches
        return dict(zip(self._window_names, means.unbind()))

    @torch.no_grad()
    def after_step(self, engine: Any, step: int) -> None:
        # The centres move once per step, from the whole global batch's teacher outputs (layout-free).
        for name, loss in (("dino", self.dino_loss), ("ibot", self.ibot_loss)):
            if name not in self._sums:
                continue
            total = self._sums.pop(name)
            if dist.is_initialized():
                dist.all_reduce(total)
            if total[-1] > 0:
                batch_center = (total[:-1] / total[-1]).float().view_as(loss.center)
                loss.center = loss.center * loss.center_momentum + batch_center * (1 - loss.center_momentum)
        self.teacher_ema.update(engine.module, self.momentum(step - 1))  # the momentum of the step just taken
        self.step = step

    # -- evaluation, cost, state
    @torch.no_grad()
    def evaluate(self, engine: Any, dtype: torch.dtype, run_dir: Path | None, step: int) -> EvalResult:
        metrics, image = evaluate_teacher(self, engine.device, dtype, run_dir, step)
        knn = f" | k-NN top-1 {100 * metrics['eval/knn_top1']:.2f}%" if "eval/knn_top1" in metrics else ""
        return EvalResult(metrics, f"eval step {step} | teacher{knn or ': no labels, no k-NN'}",
                          [(image, "pca")] if image is not None else [])

    def expected_masked_patches(self, model_kwargs: dict[str, Any]) -> float:
        """iBOT's masked patches per image on average: 2 global crops, each masked with probability
        dino.mask_probability, a fraction uniform in dino.mask_ratio of its patches (block masking can
        stop a little short of its target when no block fits; `launch/bench.py dino` counts the real ones)."""
        d = self.cfg.dino
        if d.ibot_loss_weight <= 0:
            return 0.0
        img, patch = model_kwargs["img_size"], model_kwargs["patch_size"]
        side = (img if isinstance(img, int) else img[0]) // patch
        return 2 * d.mask_probability * side * side * sum(d.mask_ratio) / 2

    def flops_per_image(self, model_kwargs: dict[str, Any]) -> float:
        """The student's forward (global and local crops, the DINO head on their class tokens, the iBOT
        head on the expected masked patches) plus a third of the teacher's (it runs forward only, on the
        global crops and the same masked patches; the trainer counts 3 x this for forward + backward)."""
        d, dim = self.cfg.dino, model_kwargs["embed_dim"]
        head = _head_flops(model_kwargs, dim, d.head_n_prototypes)
        patch_head = (_head_flops({**model_kwargs, "head_bottleneck_dim": d.ibot_head_bottleneck_dim}, dim,
                                  d.ibot_head_n_prototypes) if d.ibot_separate_head else head)
        ibot = self.expected_masked_patches(model_kwargs) * patch_head
        global_fwd = 2 * (model_flops(model_kwargs) + head) + ibot
        local_fwd = d.local_crops_number * (model_flops(model_kwargs, d.local_crops_size) + head)
        return global_fwd + local_fwd + global_fwd / 3

    def exported_weights(self, engine: Any) -> dict[str, torch.Tensor]:
        """The teacher's backbone, in `VisionTransformer`'s (timm's) names: what fine-tuning starts from."""
        return _backbone(self._teacher_state())

    checkpoint_weights = "the teacher's backbone"

    @classmethod
    def weights_from_checkpoint(cls, run_dir: Path, tag: str, cfg: Config) -> dict[str, torch.Tensor]:
        """The teacher's backbone saved in checkpoint `tag`: the tensors `exported_weights` gives at that step.
        The checkpoint holds the teacher whole on every ZeRO stage (`state_dict` gathers it before the save),
        so no partitions are reassembled here; DeepSpeed's module in the tag is the student."""
        objective = read_client_state(run_dir, tag).get("objective") or {}
        if "teacher" not in objective:
            raise CheckpointError(f"{checkpoint_dir(run_dir) / tag}: its client state has no DINOv2 teacher "
                                  f"(objective.teacher), though {run_dir / 'config.yaml'} says "
                                  f"model.objective={cfg.model.objective}")
        return _backbone(objective["teacher"])

    def _teacher_state(self) -> dict[str, torch.Tensor]:
        """The teacher's full fp32 state dict on the CPU (collective under ZeRO-3)."""
        return self.teacher_ema.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "teacher": self._teacher_state(), "dino_center": self.dino_loss.center.cpu(),
                "ibot_center": self.ibot_loss.center.cpu()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            raise ValueError("the checkpoint holds no DINOv2 state (teacher, centres): it was not written by a "
                             "model.objective=dinov2 run")
        self.step = int(state["step"])
        self.teacher_ema.load_state_dict(state["teacher"])
        self.dino_loss.center = state["dino_center"].clone()
        self.ibot_loss.center = state["ibot_center"].clone()


def _backbone(teacher: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The backbone's tensors of a `DINOv2Model` state dict, under `VisionTransformer`'s (timm's) names."""
    return {k[len("backbone."):]: v for k, v in teacher.items() if k.startswith("backbone.")}


# ----------------------------------------------------------------------------- evaluation


def evaluate_teacher(objective: DINOv2, device: torch.device, dtype: torch.dtype, run_dir: Path | None,
                     step: int) -> tuple[dict[str, float], Path | None]:
    """The teacher over the validation split: k-NN top-1 of its L2-normalised class token against the
    labelled train subset (where there are labels; `mae.knn_top1`, DINO's weighted vote), and on rank 0
    the PCA image of the patch features of its first `dino.pca_images` validation images. Every rank runs
    the same number of forwards (the teacher is gathered once under ZeRO-3)."""
    teacher, cfg = objective.teacher, objective.cfg
    teacher_dtype = next(teacher.parameters()).dtype
    feats, labels, shown = [], [], []
    mem_feats, mem_labels = [], []
    samples = torch.zeros(1, dtype=torch.float64, device=device)
    with ds_compat.gathered(teacher):
        for images, targets, valid in objective.eval_loader:
            tokens = teacher.backbone.forward_tokens(images.to(device, teacher_dtype, non_blocking=True))
            feats.append(F.normalize(tokens.cls_token.float(), dim=-1))
            labels.append(torch.where(valid.to(device), targets.to(device), -1))
            samples += valid.sum()
            keep = [k for k in range(len(valid)) if bool(valid[k])][:cfg.dino.pca_images - len(shown)]
            shown += [(images[k].float().cpu(), tokens.patch_tokens[k].float().cpu()) for k in keep]
        if objective.knn_loader is not None:
            for images, targets, valid in objective.knn_loader:
                tokens = teacher.backbone.forward_tokens(images.to(device, teacher_dtype, non_blocking=True))
                mem_feats.append(F.normalize(tokens.cls_token.float(), dim=-1))
                mem_labels.append(torch.where(valid.to(device), targets.to(device), -1))
    metrics: dict[str, float] = {}
    if objective.knn_loader is not None:
        metrics.update(knn_top1(torch.cat(feats), torch.cat(labels), torch.cat(mem_feats), torch.cat(mem_labels),
                                cfg.dino.knn_k))
    raise_if_any_failed(objective.eval_loader, objective.knn_loader)  # collective: one failed pass stops all
    if dist.is_initialized():
        dist.all_reduce(samples)
    metrics["eval/samples"] = samples.item()
    image = None
    if shown and run_dir is not None:
        grid = teacher.backbone.grid_size
        image = save_pca_image(shown, grid, cfg.data, run_dir / "pca" / f"step{step:08d}.png")
    return metrics, image


def pca_rgb(patch_tokens: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """DINOv2's figure: the first 3 principal components of the patch features of all given images
    (n, N, D), each scaled to [0, 1] over them, as RGB: (n, 3, h, w)."""
    n, count, dim = patch_tokens.shape
    x = patch_tokens.reshape(n * count, dim).double()
    x = x - x.mean(0, keepdim=True)
    _, _, v = torch.linalg.svd(x, full_matrices=False)
    comps = x @ v[:3].T  # (n N, <=3)
    if comps.shape[1] < 3:  # fewer than 3 features or patches: pad with zeros
        comps = F.pad(comps, (0, 3 - comps.shape[1]))
    low, high = comps.min(0).values, comps.max(0).values
    comps = (comps - low) / (high - low).clamp(min=1e-12)
    return comps.float().T.reshape(3, n, *grid).transpose(0, 1)


def save_pca_image(shown: list[tuple[torch.Tensor, torch.Tensor]], grid: tuple[int, int], data: DataConfig,
                   path: Path) -> Path:
    """One PNG, a row per image: the image and its patch features' first 3 principal components as RGB."""
    from PIL import Image

    images = torch.stack([im for im, _ in shown])
    rgb = pca_rgb(torch.stack([t for _, t in shown]), grid)
    rgb = F.interpolate(rgb, size=images.shape[-2:], mode="nearest")  # one colour per patch
    mean, std = torch.tensor(data.mean).view(1, 3, 1, 1), torch.tensor(data.std).view(1, 3, 1, 1)
    rows = torch.cat([(images * std + mean).clamp(0, 1), rgb], dim=3)  # (n, 3, H, 2W)
    grid_img = torch.cat(list(rows), dim=1)  # (3, n H, 2W)
    pixels = (grid_img * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.fromarray(pixels)
    scale = max(1, 256 // max(1, images.shape[-1]))  # tiny digits: enlarge to be seen
    img.resize((img.width * scale, img.height * scale), Image.NEAREST).save(path)
    return path
