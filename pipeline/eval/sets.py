"""eval.sets: labelled shard sets a run's features are judged on at every evaluation, whatever the run trains
on (unlabelled shards included). Per set, DINOv2's k-NN (knn.py) of the class tokens: the set's val split
scored against its train split as the memory, both exactly-once eval passes (every rank the same number of
batches, each sample once: collective and exact on any number of ranks).

    sets = EvalSets.build(cfg.eval, cfg.data, env, img_size, batch)   # the loaders, once (bad input stops here)
    with objective.features(engine) as embed:                           # the run's features (the objective's)
        metrics = sets.evaluate(embed, device)                          # eval/<name>/knn_top1, ...
    metrics, line = sets.judge(objective.judged_features(engine), device)  # each model's; eval/<model>/<name>/...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.config import DataConfig
from pipeline.data import DataError, EvalLoader, build_eval_loader, dataset_info_of, raise_if_any_failed
from pipeline.data.pixels import set_channels
from pipeline.dist import DistEnv
from pipeline.eval.features import class_tokens, extract
from pipeline.eval.knn import KNN_KS, knn_accuracy

HEADLINE_K = 20  # eval/<name>/knn_top1 is k=20's (DINO's and DINOv2's reported figure)


def labelled_set(data: DataConfig, path: str, train_split: str, val_split: str, where: str) -> tuple[DataConfig, Any]:
    """(the data config that reads the set at `path` with the run's data.* transforms, its dataset.json); a
    set without labels or without either split is a DataError of one line naming `where` and the path."""
    cfg = dataclasses.replace(data, path=path, train_split=train_split, val_split=val_split)
    info = dataset_info_of(cfg)  # the storage, trust and digest rules of data.path: the same reader
    if info.num_classes == 0:
        raise DataError(f"{where}: {path} has no labels (dataset.json: num_classes 0); a k-NN or a linear probe "
                        f"needs labelled shards (launch/make_shards.py writes the labels of a class-folder source)")
    for split in (train_split, val_split):
        if split not in info.splits:
            raise DataError(f"{where}: {path} has no split '{split}' (it has: {', '.join(sorted(info.splits))})")
    return cfg, info


@dataclass
class LabelledSet:
    name: str
    val: EvalLoader
    memory: EvalLoader


class EvalSets:
    """The loaders of every set (each pass exact: every sample once, the same batches on every rank)."""

    def __init__(self, sets: list[LabelledSet]):
        self.sets = sets

    @classmethod
    def build(cls, eval_cfg: Any, data: DataConfig, env: DistEnv, img_size: tuple[int, int], batch: int) -> EvalSets:
        out = []
        for name, path in eval_cfg.sets.items():
            cfg, info = labelled_set(data, path, eval_cfg.train_split, eval_cfg.val_split, f"eval.sets.{name}")
            if set_channels(info) != len(data.mean):  # the run's data.mean has its model's channels (pixels.py)
                raise DataError(f"eval.sets.{name}: {path} holds {set_channels(info)}-channel images and the run's "
                                f"model takes {len(data.mean)}; judge it on a set of the channels it trains on")
            val = build_eval_loader(cfg, img_size, batch, rank=env.rank, world_size=env.world_size, info=info)
            memory = build_eval_loader(dataclasses.replace(cfg, val_split=cfg.train_split), img_size, batch,
                                       rank=env.rank, world_size=env.world_size, info=info,
                                       limit=eval_cfg.memory_samples)
            out.append(LabelledSet(name, val, memory))
        return cls(out)

    @property
    def loaders(self) -> list[EvalLoader]:
        return [x for s in self.sets for x in (s.val, s.memory)]

    def __bool__(self) -> bool:
        return bool(self.sets)

    def judge(self, models: dict[str, AbstractContextManager[Callable[[torch.Tensor], torch.Tensor]]],
              device: torch.device) -> tuple[dict[str, float], str]:
        """Collective: `evaluate` of each model's features (name -> an `Objective.features` context; '' the run's
        own, eval/<set>/..., another name eval/<model>/<set>/...), every model's metrics and one line of all."""
        metrics, lines = {}, []
        for model, features in models.items():
            with features as embed:
                found = self.evaluate(embed, device, model)
            metrics.update(found)
            lines.append(self.line(found, model))
        return metrics, " | ".join(lines)

    @torch.no_grad()
    def evaluate(self, embed: Callable[[torch.Tensor], torch.Tensor], device: torch.device,
                 model: str = "") -> dict[str, float]:
        """Collective: each set's k-NN on `embed`'s features (features.embedding rows of a batch of images on
        `device`). eval/<name>/knn_top1 and knn_top5 (k=20), knn_top1_k<k> and knn_top5_k<k> for each k; with
        `model`, eval/<model>/<name>/... (one of several models judged: a distillation's students, its teacher)."""
        metrics: dict[str, float] = {}
        at = f"{model}/" if model else ""
        for s in self.sets:
            val = extract(s.val, embed, device, torch.float32)
            memory = extract(s.memory, embed, device, torch.float32)
            raise_if_any_failed(s.val, s.memory)  # collective: a pass that failed on one rank stops all here
            (vf, vl), (mf, ml) = val.tensors(), memory.tensors()
            found = knn_accuracy(class_tokens(vf), vl, class_tokens(mf), ml, KNN_KS)
            for k, (top1, top5) in found.items():
                metrics[f"eval/{at}{s.name}/knn_top1_k{k}"] = top1
                metrics[f"eval/{at}{s.name}/knn_top5_k{k}"] = top5
            metrics[f"eval/{at}{s.name}/knn_top1"], metrics[f"eval/{at}{s.name}/knn_top5"] = found[HEADLINE_K]
        return metrics

    def line(self, metrics: dict[str, float], model: str = "") -> str:
        """What the evaluation prints of the sets: each set's k-NN top-1 (of `model`, as `evaluate` named it)."""
        at = f"{model}/" if model else ""
        return " | ".join(f"{at}{s.name} k-NN top-1 {100 * metrics[f'eval/{at}{s.name}/knn_top1']:.2f}%"
                          for s in self.sets)
