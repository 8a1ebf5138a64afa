"""DINOv2's loss pieces, equivalent to facebookresearch/dinov2's (issue 33).

What is here: `DINOHead`, `DINOLoss`, `iBOTPatchLoss` and `KoLeoLoss` with the official classes' names,
constructor arguments, buffers (`center`), state-dict keys and methods, so code and checkpoints written
against Meta's `dinov2/layers/dino_head.py` and `dinov2/loss/*.py` move across unchanged. They are checked
against the official code in tests/unit/test_dino_official.py (skipped without DINOV2_OFFICIAL_REPO).

What is not here yet: the DINO objective itself. Nothing in this module is registered as an objective
(`pipeline/objectives/__init__.py` does not know it); the student/teacher pair, the teacher EMA, the
schedules, multi-crop wiring and configs are later work. See docs/dino.md.

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

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["DINOHead", "DINOLoss", "iBOTPatchLoss", "KoLeoLoss"]


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
        linear = nn.Linear(in_features, out_features, bias=False)  # nn.Linear's init for v, as Meta's
        # g before v: the order weight_norm registers them in, so the state dicts list the same keys in turn.
        self.weight_g = nn.Parameter(torch.ones(out_features, 1))  # Meta fills g with 1
        self.weight_v = nn.Parameter(linear.weight.detach().clone())

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
