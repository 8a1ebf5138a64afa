"""The k-NN classifier every objective's features are judged by (Wu et al. 2018; DINOv2's eval/knn.py), and
the loaders an objective's own k-NN reads: the validation pass and a labelled subset of the train split as
its memory.

DINOv2's protocol: cosine similarity of L2-normalised features, each of the k nearest memory samples votes
for its class with weight exp(similarity / T), T = 0.07, for k in 10, 20 and 100 (DINOv2 adds 200), top-1
and top-5 of the votes. DINOv2 takes a softmax over the `max(k)` nearest and sums the first k: the same
ranking of the classes, since the softmax's denominator is one constant per sample.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipeline.config import DataConfig
from pipeline.data import EvalLoader, build_eval_loader, label_free
from pipeline.dist import DistEnv

# k-NN vote: neighbours weighted by exp(cosine similarity / T).
KNN_TEMPERATURE = 0.07
KNN_KS = (10, 20, 100)  # DINOv2's nb_knn without 200; k=20 is the headline figure ("usually working the best")
VAL_CHUNK = 1024  # validation rows scored at once: a (chunk, memory) similarity matrix at a time


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


def knn_accuracy(val_feats: torch.Tensor, val_labels: torch.Tensor, mem_feats: torch.Tensor,
                 mem_labels: torch.Tensor, ks: Sequence[int] = KNN_KS,
                 temperature: float = KNN_TEMPERATURE) -> dict[int, tuple[float, float]]:
    """{k: (top-1, top-5)} of the weighted k-NN vote over all ranks. Features are L2-normalised rows (the
    caller's); labels -1 mark padding and bad samples (left out of both). Collective where a process group
    is up: the memory is gathered to every rank (each rank holds the same number of rows: an eval pass's),
    each rank scores its own validation rows, the hits are summed. A k larger than the memory takes it all."""
    if dist.is_initialized():
        mem_feats, mem_labels = all_gather(mem_feats), all_gather(mem_labels)
    keep = mem_labels >= 0
    mem_feats, mem_labels = mem_feats[keep], mem_labels[keep]
    real = val_labels >= 0
    val_feats, val_labels = val_feats[real], val_labels[real]
    hits = torch.zeros(2 * len(ks) + 1, dtype=torch.float64, device=val_feats.device)
    hits[-1] = len(val_labels)
    if len(mem_labels) and len(val_labels):
        classes = int(max(mem_labels.max().item(), val_labels.max().item())) + 1
        largest = min(max(ks), len(mem_labels))
        for lo in range(0, len(val_labels), VAL_CHUNK):
            feats, labels = val_feats[lo:lo + VAL_CHUNK], val_labels[lo:lo + VAL_CHUNK]
            sims, idx = (feats @ mem_feats.T).topk(largest, dim=1)  # sorted, nearest first
            weights, neighbours = (sims / temperature).exp(), mem_labels[idx]
            for j, k in enumerate(ks):
                votes = torch.zeros(len(feats), classes, dtype=weights.dtype, device=feats.device)
                votes.scatter_add_(1, neighbours[:, :k], weights[:, :k])
                top, ranked = votes.topk(min(5, classes), dim=1)
                hits[2 * j] += (ranked[:, 0] == labels).sum()
                # A class no neighbour voted for is not among the top 5, whatever topk's order of the zeros.
                hits[2 * j + 1] += ((ranked == labels[:, None]) & (top > 0)).any(1).sum()
    if dist.is_initialized():
        dist.all_reduce(hits)
    n = max(hits[-1].item(), 1.0)
    return {k: (hits[2 * j].item() / n, hits[2 * j + 1].item() / n) for j, k in enumerate(ks)}


def knn_top1(val_feats: torch.Tensor, val_labels: torch.Tensor, mem_feats: torch.Tensor, mem_labels: torch.Tensor,
             k: int) -> dict[str, float]:
    """{"eval/knn_top1": the top-1 of `knn_accuracy` at this one k}: an objective's own k-NN on its
    pretraining shards (mae.knn_k, dino.knn_k)."""
    return {"eval/knn_top1": knn_accuracy(val_feats, val_labels, mem_feats, mem_labels, (k,))[k][0]}


def all_gather(t: torch.Tensor) -> torch.Tensor:
    """Every rank's `t` (same shape on each), concatenated in rank order."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)
