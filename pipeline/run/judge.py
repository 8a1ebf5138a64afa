"""Judging a run after the fact (launch/evaluate.py): its checkpoints' backbones on a labelled shard set, by
DINOv2's k-NN and linear probe on frozen features (pipeline/eval/), on 1 or N ranks.

    judge = Judge(data_path, first_backbone, env, batch, ("knn", "linear"))   # the set's two passes, once
    rows = judge.judge(backbone, device)                                       # one checkpoint: a row per figure

The features of each split are computed once per checkpoint (every sample once over the ranks, exactly as
eval.sets does during training) and cached in memory: the k-NN and the probe's grid read the same rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pipeline.data import build_eval_loader, raise_if_any_failed
from pipeline.data.pixels import for_model
from pipeline.dist import DistEnv
from pipeline.eval.features import class_tokens, extract, gather_rows
from pipeline.eval.knn import KNN_KS, knn_accuracy
from pipeline.eval.linear import linear_probe
from pipeline.eval.sets import HEADLINE_K, labelled_set
from pipeline.run.backbone import Backbone, backbone_features

PROTOCOLS = ("knn", "linear")


@dataclass
class Row:
    checkpoint: str
    step: int | None
    protocol: str
    top1: float
    top5: float


class Judge:
    def __init__(self, data_path: str, first: Backbone, env: DistEnv, batch: int, protocols: tuple[str, ...],
                 train_split: str = "train", val_split: str = "val"):
        self.protocols = protocols
        cfg, info = labelled_set(first.data, data_path, train_split, val_split, "--data")
        cfg = for_model(cfg, info, first.kwargs.get("in_chans", 3), "--data")  # the set's channels the model's
        img = first.kwargs["img_size"]
        self.train = build_eval_loader(dataclasses.replace(cfg, val_split=train_split), img, batch, rank=env.rank,
                                       world_size=env.world_size, info=info)
        self.val = build_eval_loader(cfg, img, batch, rank=env.rank, world_size=env.world_size, info=info)

    @torch.no_grad()
    def judge(self, backbone: Backbone, device: torch.device, name: str) -> tuple[list[Row], dict[str, float]]:
        """Collective. (the table's rows, the metrics to log) of one backbone."""
        model = backbone.model.to(device)
        train = extract(self.train, lambda x: backbone_features(model, x), device, torch.float32)
        val = extract(self.val, lambda x: backbone_features(model, x), device, torch.float32)
        raise_if_any_failed(self.train, self.val)
        (tf, tl), (vf, vl) = train.tensors(), val.tensors()
        rows, metrics = [], {}
        if "knn" in self.protocols:
            found = knn_accuracy(class_tokens(vf), vl, class_tokens(tf), tl, KNN_KS)
            for k, (top1, top5) in found.items():
                rows.append(Row(name, backbone.step, f"k-NN k={k}", top1, top5))
                metrics[f"knn_top1_k{k}"], metrics[f"knn_top5_k{k}"] = top1, top5
            metrics["knn_top1"], metrics["knn_top5"] = found[HEADLINE_K]
        if "linear" in self.protocols:
            probe = linear_probe(*gather_rows(tf, tl), *gather_rows(vf, vl))  # every rank the same rows, same result
            rows.append(Row(name, backbone.step, f"linear (lr {probe.lr:g})", probe.top1, probe.top5))
            metrics.update(linear_top1=probe.top1, linear_top5=probe.top5, linear_lr=probe.lr)
        backbone.model.to("cpu")
        return rows, metrics


def table(rows: list[Row]) -> str:
    """One table: checkpoint x protocol x accuracy."""
    head = ("checkpoint", "protocol", "top-1", "top-5")
    body = [(r.checkpoint, r.protocol, f"{100 * r.top1:.2f}%", f"{100 * r.top5:.2f}%") for r in rows]
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(4)]
    line = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(head), *(line(b) for b in body)])
