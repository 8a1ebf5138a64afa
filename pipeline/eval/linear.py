"""The linear probe on frozen, cached features: DINOv2's eval/linear.py, on features computed once.

DINOv2 trains one linear classifier per learning rate of a grid (1e-5 .. 0.1, each scaled by batch / 256) at
once, SGD with momentum 0.9, no weight decay, a cosine schedule to 0, weights drawn N(0, 0.01), on the class
token with the mean of the patch tokens beside it (its `avgpool` inputs, here `features.embedding`), and keeps
the best. Two differences, both for a figure that is a measurement rather than a choice made on it: the
learning rate is chosen on a held-out part of the train split (DINOv2 chooses on the validation set it
reports), and the chosen one is trained again on the whole train split before the validation set is
scored; and the features are computed once, without augmentation (DINOv2 runs the frozen model on
augmented crops at every step), so the probe costs seconds where features cost minutes.
Deterministic: the draws come from `seed`, the same rows on every rank give the same classifier.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

LEARNING_RATES = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1)  # DINOv2's grid
PROBE_STEPS = 2000  # SGD steps per training (DINOv2: 10 epochs of 1,250 at batch 128 on ImageNet)
PROBE_BATCH = 256
HELD_OUT = 0.1  # fraction of the train split the learning rate is chosen on


@dataclass
class ProbeResult:
    top1: float
    """Validation top-1 of the classifier trained on the whole train split at the chosen learning rate."""
    top5: float
    lr: float
    """The chosen learning rate (of the grid, before the batch / 256 scaling)."""
    held_out: dict[float, float] = field(default_factory=dict)
    """Held-out top-1 of each learning rate of the grid."""


def train_linear(x: torch.Tensor, y: torch.Tensor, classes: int, learning_rates: Sequence[float],
                 steps: int = PROBE_STEPS, batch_size: int = PROBE_BATCH, seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One linear classifier per learning rate, trained together on (x (N, D), y (N,)): (weights (L, D, C),
    biases (L, C)). Mini-batches from a seeded permutation of the rows per pass; DINOv2's optimiser."""
    gen = torch.Generator().manual_seed(seed)
    n, dim = x.shape
    batch = min(batch_size, n)
    lrs = torch.tensor([lr * batch / 256.0 for lr in learning_rates], dtype=x.dtype, device=x.device)
    weight = (torch.randn(len(lrs), dim, classes, generator=gen, dtype=x.dtype) * 0.01).to(x.device)
    bias = torch.zeros(len(lrs), classes, dtype=x.dtype, device=x.device)
    momentum = [torch.zeros_like(weight), torch.zeros_like(bias)]
    order, at = torch.randperm(n, generator=gen), 0
    for t in range(steps):
        if at + batch > n:  # a new pass over the rows
            order, at = torch.randperm(n, generator=gen), 0
        rows = order[at:at + batch].to(x.device)
        at += batch
        xb, yb = x[rows], y[rows]
        # Each classifier's gradient of its mean cross-entropy, written out (softmax - one-hot): autograd's
        # bookkeeping costs more than the arithmetic at these sizes.
        probs = torch.softmax(torch.einsum("nd,ldc->lnc", xb, weight) + bias[:, None], dim=-1)
        probs[:, torch.arange(len(yb), device=x.device), yb] -= 1
        probs /= len(yb)
        grads = (torch.einsum("nd,lnc->ldc", xb, probs), probs.sum(1))
        scale = lrs * 0.5 * (1 + math.cos(math.pi * t / steps))  # CosineAnnealingLR to 0, stepped per iteration
        for p, g, buf in zip((weight, bias), grads, momentum):
            buf.mul_(0.9).add_(g)  # torch.optim.SGD's momentum, dampening 0
            p.sub_(scale.view(-1, *[1] * (p.dim() - 1)) * buf)
    return weight, bias


def scores(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(L, 2): the top-1 and top-5 of each classifier on (x, y)."""
    logits = torch.einsum("nd,ldc->lnc", x, weight) + bias[:, None]
    ranked = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
    n = max(len(y), 1)
    return torch.stack([(ranked[..., 0] == y).sum(-1) / n, (ranked == y[:, None]).any(-1).sum(-1) / n], dim=1)


def linear_probe(train_x: torch.Tensor, train_y: torch.Tensor, val_x: torch.Tensor, val_y: torch.Tensor,
                 learning_rates: Sequence[float] = LEARNING_RATES, steps: int = PROBE_STEPS,
                 batch_size: int = PROBE_BATCH, held_out: float = HELD_OUT, seed: int = 0) -> ProbeResult:
    """Validation accuracy of a linear classifier on frozen features (rows of labelled samples; float32).
    The learning rate is the grid's best on `held_out` of the train rows (a seeded draw; the first best on a
    tie), then trained on all train rows."""
    train_x, val_x = train_x.float(), val_x.float()
    classes = int(max(train_y.max().item(), val_y.max().item() if len(val_y) else 0)) + 1
    n = len(train_y)
    cut = n - max(1, round(held_out * n)) if n > 1 else n
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1)).to(train_x.device)
    fit, check = perm[:cut], perm[cut:]
    weight, bias = train_linear(train_x[fit], train_y[fit], classes, learning_rates, steps, batch_size, seed)
    held = scores(weight, bias, train_x[check], train_y[check])[:, 0].tolist()
    best = max(range(len(learning_rates)), key=lambda i: (held[i], -i))
    weight, bias = train_linear(train_x, train_y, classes, [learning_rates[best]], steps, batch_size, seed)
    top1, top5 = scores(weight, bias, val_x, val_y)[0].tolist()
    return ProbeResult(top1, top5, learning_rates[best], dict(zip(learning_rates, held)))
