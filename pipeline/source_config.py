"""The data section's mixture keys (data.sources, data.allow_mix_change; pipeline/config.py's DataConfig extends
`MixtureConfig`) and their checks, in a file of their own. What a mixture is: docs/data.md, Mixtures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.typed_yaml import ConfigError


@dataclass
class SourceConfig:
    name: str = ""
    """The source's name: its figures are data/<name>/..., its order's seed follows it, a resume matches sources by it."""
    path: str = ""
    """Its data set: a folder, s3:// or http(s):// prefix holding dataset.json and the shards, as data.path."""
    weight: float | None = None
    """Its share of every global batch (normalised over the sources): floor or ceil of weight x global batch samples in each, the count within one sample of it over any run of steps (docs/data.md, Mixtures)."""
    repeat: float | None = None
    """Instead of weight (MosaicML Streaming's repeat): its samples per epoch of the mixture as a multiple of its size; the weight is then repeat x size over the sum."""
    samples: int | None = None
    """Instead of weight (Streaming's choose): its samples per epoch of the mixture; the weight is samples over their sum."""
    train_split: str | None = None
    """Its split to train on; None: data.train_split."""
    label_key: str | None = None
    """Where its labels are (as data.label_key); None: data.label_key when set, else what its dataset.json says."""


@dataclass
class MixtureConfig:
    sources: list[SourceConfig] = field(default_factory=list)
    """Several data sets mixed in one run, each at its weight in every global batch (docs/data.md, Mixtures): a list of {name, path, weight} (or repeat, or samples, the same kind for all). Empty: data.path alone."""
    allow_mix_change: bool = False
    """Resume a checkpoint written with another mix (a weight changed, a source added or removed): the new mix applies from the resumed step on, each source continuing where it was; recorded in RUN_DIR/data_mix.jsonl and MLflow. Off: such a resume is refused in one line naming the change."""


def check_sources(data: Any, where: str) -> None:
    """data.sources: names given and unique, a path each, one kind of weight for all (Streaming's rule: relative
    weights and absolute repeat/samples do not mix), each positive."""
    kinds = set()
    for i, s in enumerate(data.sources):
        key = f"data.sources[{i}]"
        given = [k for k in ("weight", "repeat", "samples") if getattr(s, k) is not None]
        problem = ("needs a name" if not s.name else "needs a path" if not s.path
                   else "needs one of weight, repeat or samples" if not given
                   else f"sets {' and '.join(given)}: give one" if len(given) > 1
                   else f"{given[0]} must be > 0" if getattr(s, given[0]) <= 0 else "")
        if problem:
            raise ConfigError(f"{where}: {key} ('{s.name}') {problem}")
        kinds.add("weight" if given == ["weight"] else "repeat/samples")
    names = [s.name for s in data.sources]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: data.sources names must be unique, got {names}")
    if len(kinds) > 1:
        raise ConfigError(f"{where}: data.sources mixes weight with repeat/samples; use weights for all, or "
                          f"repeat/samples for all")
    if data.sources and data.partitions is not None:
        raise ConfigError(f"{where}: key 'data.partitions' applies to data.path alone; a mixture's sources are "
                          f"partitioned each on its own (docs/data.md, Mixtures)")
