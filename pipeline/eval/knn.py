"""The k-NN top-1 every objective's features are judged by (Wu et al. 2018, as DINO evaluates), and the
loaders it reads: the validation pass and a labelled subset of the train split as its memory.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from pipeline.config import DataConfig
from pipeline.data import EvalLoader, build_eval_loader, label_free
from pipeline.dist import DistEnv

# k-NN vote: neighbours weighted by exp(cosine similarity / T).
KNN_TEMPERATURE = 0.07


def knn_loaders(data: DataConfig, info: Any, env: DistEnv, img_size: tuple[int, int], batch: int, k: int,
                memory_samples: int) -> tuple[EvalLoader, EvalLoader | None]:
    """(the validation pass, the k-NN memory or None). The validation pass reads labels where the data set
    has them (label-free shards evaluate too); the memory, the first `memory_samples` of the train split
    with the eval transform and labels, only where there are labels and `k` > 0."""
    labelled = info.num_classes > 0
    val = build_eval_loader(data if labelled else label_free(data), img_size, batch, rank=env.rank,
                            world_size=env.world_size, info=info)
    if not labelled or k <= 0:
        return val, None
    memory = build_eval_loader(dataclasses.replace(data, val_split=data.train_split), img_size, batch,
                               rank=env.rank, world_size=env.world_size, info=info, limit=memory_samples)
    return val, memory


def knn_top1(val_feats: torch.Tensor, val_labels: torch.Tensor, mem_feats: torch.Tensor, mem_labels: torch.Tensor,
             k: int) -> dict[str, float]:
    """Weighted k-NN top-1 over all ranks: the memory is gathered to every rank, each rank scores its own
    validation samples, the hits are summed. Labels -1 mark padding and bad samples (excluded)."""
    if dist.is_initialized():
        mem_feats, mem_labels = all_gather(mem_feats), all_gather(mem_labels)
    keep = mem_labels >= 0
    mem_feats, mem_labels = mem_feats[keep], mem_labels[keep]
    hits = torch.zeros(2, dtype=torch.float64, device=val_feats.device)
    if len(mem_labels):
        classes = int(mem_labels.max().item()) + 1
        classes = max(classes, int(val_labels.max().item()) + 1)
        sims, idx = (val_feats @ mem_feats.T).topk(min(k, len(mem_labels)), dim=1)
        votes = torch.zeros(len(val_feats), classes, device=val_feats.device)
        votes.scatter_add_(1, mem_labels[idx], (sims / KNN_TEMPERATURE).exp())
        real = val_labels >= 0
        hits += torch.stack([(votes.argmax(1) == val_labels)[real].sum().double(), real.sum().double()])
    else:
        hits[1] = (val_labels >= 0).sum()
    if dist.is_initialized():
        dist.all_reduce(hits)
    return {"eval/knn_top1": hits[0].item() / max(hits[1].item(), 1.0)}


def all_gather(t: torch.Tensor) -> torch.Tensor:
    """Every rank's `t` (same shape on each), concatenated in rank order."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)
