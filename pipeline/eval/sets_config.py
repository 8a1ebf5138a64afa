"""The `eval` config section, light (read with the run config, before torch): eval.sets, the labelled shard
sets a run's features are judged on at every evaluation (pipeline/eval/sets.py), and its checks."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pipeline.config import Check, Config

SET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # a set's name is part of its metrics' names


@dataclass
class EvalConfig:
    sets: dict[str, str] = field(default_factory=dict)
    """Labelled shard sets judged at every train.eval_every and at the end on the run's features (the objective's: the encoder for supervised and MAE, the teacher's backbone for DINOv2): NAME: PATH (a folder, s3:// or http(s):// with dataset.json, read as data.path is: its storage, trust and digest rules, data.* transforms). Each logs DINOv2's k-NN (class tokens, k 10/20/100, T 0.07, the set's train split as memory) as eval/NAME/knn_top1 (k=20), knn_top5, knn_top1_k10 ... The pretraining shards need no labels. On the command line: eval.sets.NAME=PATH (docs/evaluation.md)."""
    train_split: str = "train"
    """Each set's split that is the k-NN's memory (DINOv2: the train set)."""
    val_split: str = "val"
    """Each set's split that is scored."""
    memory_samples: int | None = None
    """At most this many samples of each set's train split (its first) in the memory; None: all of it."""


def eval_checks(cfg: Config) -> list[Check]:
    """The section's checks (pipeline.config.validate's form)."""
    e = cfg.eval
    return [
        ("eval.sets", all(isinstance(k, str) and SET_NAME.fullmatch(k) for k in e.sets),
         "a mapping NAME: PATH, each NAME letters, digits, '_', '.', '-' (it is part of the metric names)"),
        ("eval.sets", all(isinstance(v, str) and v.strip() for v in e.sets.values()),
         "a mapping NAME: PATH, each PATH a shard folder or URL with dataset.json"),
        ("eval.memory_samples", e.memory_samples is None or e.memory_samples > 0, "> 0 or null"),
    ]
