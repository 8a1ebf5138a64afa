"""The commands' reader of any source's backbone (launch/evaluate.py, embed.py, export_weights.py): the one in
pipeline/objectives/backbone.py, which lives below the run so that an objective (a distillation's teacher) reads
a source as the commands do, with the run configs of every recipe."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipeline.objectives import backbone, config_files
from pipeline.objectives.backbone import (  # noqa: F401 - the commands' imports
    Backbone,
    backbone_features,
    complete_tags,
    read_back_of,
    tag_of_step,
)


def load_backbone(source: str | Path, tag: str | None = None, flag: str = "--from") -> Backbone:
    """`pipeline.objectives.backbone.load_backbone` with every recipe's run configs."""
    return backbone.load_backbone(source, config_files(), tag, flag)


def normalised(backbone: Backbone, mean: list[float] | None, std: list[float] | None) -> Backbone:
    """The commands' --mean/--std: `backbone` read with that normalisation instead of its source's."""
    data = backbone.data
    data = dataclasses.replace(data, mean=tuple(mean) if mean else data.mean, std=tuple(std) if std else data.std)
    return dataclasses.replace(backbone, data=data)
