"""BatchNorm's running statistics, layout-free: one update per optimizer step from the whole global batch.

In a data-parallel run without SyncBatchNorm each rank's BatchNorm updates its running mean and variance from
its own micro batches, once per forward: how many updates a step makes, and from which images, depends on the
layout (ranks x micro batches), so a run resumed on another world size holds other statistics than the
uninterrupted one, and the ranks disagree with each other (a checkpoint keeps rank 0's).

`StepNormStats` makes them a function of the step's global batch alone, as one process stepping on the whole
batch would have them. Each training forward of a BatchNorm still normalises with its micro batch's statistics
(the gradient is PyTorch's, untouched), and still updates the running buffers in place; a forward hook also
records the micro batch's per-channel count, mean and sum of squared deviations (computed in float32, kept in
float64) in a slot of the
step: slot rank x accum + a for this rank's a-th micro batch, the micro batch's place in the global batch
(pipeline/data/order.py: `micro_batch_positions`). After the step the slots are summed over ranks (each slot is
filled on one rank and zero on the others: the sum is exact), combined in slot order on every rank (Chan et
al.'s pairwise update), and the buffers, first put back to what they were before the step, take one update as
PyTorch writes it: running = (1 - momentum) x running + momentum x statistic (the cumulative average with
`momentum=None`), the variance unbiased, `num_batches_tracked` + 1. Every rank then holds the same buffers, and a
run resumed on any layout with the same micro batch size (the micro batches are the same images) ends with the
uninterrupted run's statistics. On one rank without accumulation it is PyTorch's update rule (one forward per
step), rounded differently.

Several forwards of one micro batch (a student's global and local crops) add to its slot; a micro batch the
non-finite guard skips shares its slot with the one drawn in its place (the trainer calls `micro_batch` once per
slot).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def batch_norms(model: nn.Module) -> list[_BatchNorm]:
    """The model's BatchNorm layers that keep running statistics."""
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


class StepNormStats:
    """The running statistics of `model`'s BatchNorm layers updated once per step (module docstring).
    `before_step`, `micro_batch` (before each micro batch's forward) and `after_step` frame each step."""

    def __init__(self, model: nn.Module, accum: int, rank: int, world_size: int):
        self.norms = batch_norms(model)
        self.accum, self.rank, self.world_size = accum, rank, world_size
        self.slots: list[torch.Tensor] = []  # per norm: (world x accum, 3, C) float64: count, mean, M2
        self.saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # the buffers before the step
        self.a = -1  # this rank's micro batch within the step
        self.hooks = [m.register_forward_hook(self._record(i)) for i, m in enumerate(self.norms)]

    def _record(self, i: int):
        def hook(module: _BatchNorm, inputs: tuple[torch.Tensor, ...], _output: torch.Tensor) -> None:
            if not module.training or not self.slots or self.a < 0:
                return  # evaluation, or a forward outside a step (a FLOP count, a k-NN pass)
            x = inputs[0].detach()
            dims = [d for d in range(x.dim()) if d != 1]  # every axis but the channels'
            # In float32 as BatchNorm's own kernel (bf16 activations widened): no float64 copy of the activations
            var, mean = torch.var_mean(x.float(), dim=dims, correction=0)
            n = torch.full_like(mean, x.numel() // x.shape[1], dtype=torch.float64)
            mean, m2 = mean.double(), var.double() * n
            slot = self.slots[i][self.rank * self.accum + self.a]
            slot.copy_(combine(slot, torch.stack([n, mean, m2])))
        return hook

    @torch.no_grad()
    def before_step(self) -> None:
        self.saved = [(m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())
                      for m in self.norms]
        self.slots = [torch.zeros(self.world_size * self.accum, 3, m.num_features, dtype=torch.float64,
                                  device=m.running_mean.device) for m in self.norms]
        self.a = -1

    def micro_batch(self) -> None:
        self.a += 1

    @torch.no_grad()
    def after_step(self) -> None:
        if not self.slots:
            return
        flat = torch.cat([s.flatten() for s in self.slots])
        if self.world_size > 1 and dist.is_initialized():
            dist.all_reduce(flat)  # one slot filled per rank, zeros elsewhere: exact, the same on every rank
        offset = 0
        for m, slots, (mean0, var0, tracked0) in zip(self.norms, self.slots, self.saved):
            slots = flat[offset:offset + slots.numel()].view_as(slots)
            offset += slots.numel()
            total = slots[0]
            for slot in slots[1:]:  # in slot order: the global batch's order, whatever the layout
                total = combine(total, slot)
            n, mean, m2 = total
            seen = n > 0  # per channel (all or none): no training forward in the step leaves the buffers
            tracked = tracked0 + seen[0].long()
            # PyTorch's factor: momentum, or the cumulative average's 1 / num_batches_tracked (momentum=None)
            momentum = 1.0 / tracked.clamp_min(1).double() if m.momentum is None else m.momentum
            unbiased = m2 / (n - 1).clamp_min(1)
            mean1 = (1 - momentum) * mean0.double() + momentum * mean
            var1 = (1 - momentum) * var0.double() + momentum * unbiased
            m.running_mean.copy_(torch.where(seen, mean1, mean0.double()).to(mean0.dtype))
            m.running_var.copy_(torch.where(seen, var1, var0.double()).to(var0.dtype))
            m.num_batches_tracked.copy_(tracked)
        self.slots, self.saved, self.a = [], [], -1

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two groups' (count, mean, M2) as one (Chan et al. 1979); an empty group (count 0) leaves the other."""
    na, ma, m2a = a
    nb, mb, m2b = b
    n = na + nb
    safe = n.clamp_min(1)
    delta = mb - ma
    mean = ma + delta * nb / safe
    m2 = m2a + m2b + delta.square() * na * nb / safe
    merged = torch.stack([n, mean, m2])
    return torch.where(na == 0, b, torch.where(nb == 0, a, merged))  # exact where one side is empty
