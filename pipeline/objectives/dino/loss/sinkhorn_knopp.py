"""What the DINO and iBOT losses compute over every rank: sums all-reduced whenever a default process group
is initialised (a no-op on one process without one), and SwAV's Sinkhorn-Knopp over the global batch."""

from __future__ import annotations

import torch
import torch.distributed as dist


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place, when a process group exists; a no-op on one process without one."""
    if distributed():
        dist.all_reduce(tensor)
    return tensor


def sinkhorn_knopp(teacher_output: torch.Tensor, teacher_temp: float, n_samples_total: torch.Tensor | int,
                   n_iterations: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """SwAV's Sinkhorn-Knopp over the batch of every rank: rows (prototypes) and columns (samples) are
    normalised in turn, the row sums all-reduced so each prototype gets 1/K of the global batch. `valid`
    (B,) bool: only those samples take part (padding rows of a fixed-size gather get zeros)."""
    q = torch.exp(teacher_output.float() / teacher_temp).t()  # K x B, the notation of the SwAV paper
    if valid is not None:
        q = q * valid
    n_prototypes = q.shape[0]
    total = q.sum()
    q /= all_reduce_sum(total)
    for _ in range(n_iterations):
        rows = q.sum(dim=1, keepdim=True)
        q /= all_reduce_sum(rows)
        q /= n_prototypes
        columns = q.sum(dim=0, keepdim=True)
        q /= columns if valid is None else torch.where(valid, columns, 1.0)  # padding: 0 / 1, not 0 / 0
        q /= n_samples_total
    q *= n_samples_total  # each column (sample) now sums to 1: an assignment
    return q.t()
