"""The data section's mixture keys (data.sources, data.allow_mix_change; pipeline/config.py's DataConfig extends
`MixtureConfig`) and their checks, in a file of their own. What a mixture is: docs/data.md, Mixtures."""

from __future__ import annotations

import math
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
    allowed_origins: list[str] = field(default_factory=list)
    """Places other than its own location a data set's shards may be fetched from: origins (https://cdn.example.org, s3://bucket) or prefixes under one (s3://bucket/datasets). Empty: a dataset.json's shards resolve under its own location only (the same bucket and prefix, the same http origin, the same folder), and one naming a shard elsewhere is refused in one line (docs/data.md, Object storage)."""
    allow_mix_change: bool = False
    """Resume a checkpoint written with another mix (a weight changed, a source added or removed): the new mix applies from the resumed step on, each source continuing where it was; recorded in RUN_DIR/data_mix.jsonl and MLflow. Off: such a resume is refused in one line naming the change."""


def name_problem(name: str) -> str:
    """Why a source's name is not a plain name ('' when it is one): it becomes a metric name (data/<name>/...)
    and an MLflow parameter, which refuse '/' and '..' (MLflow then refuses the whole run's parameters)."""
    if not name:
        return "needs a name"
    if not all(c.isascii() and (c.isalnum() or c in "_-.") for c in name) or ".." in name:
        return (f"has the name {name[:80]!r}: a plain name of letters, digits, '_', '-' and '.' (no '/', '..' or "
                f"spaces) is expected; it becomes the metric names data/<name>/... and an MLflow parameter")
    return ""


def weight_problem(kind: str, value: Any) -> str:
    """Why a weight, repeat or samples value is not a finite number > 0 ('' when it is one). NaN compares false
    with everything, so `value <= 0` alone lets it through."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{kind} must be a number > 0, got {value!r}"
    if not math.isfinite(value) or value <= 0:
        return f"{kind} must be a finite number > 0, got {value!r}"
    return ""


def check_sources(data: Any, where: str) -> None:
    """data.sources: names plain and unique, a path each, one kind of weight for all (Streaming's rule: relative
    weights and absolute repeat/samples do not mix), each a finite number > 0, and their sum finite (weights are
    normalised by it)."""
    kinds = set()
    for i, s in enumerate(data.sources):
        key = f"data.sources[{i}]"
        given = [k for k in ("weight", "repeat", "samples") if getattr(s, k) is not None]
        problem = (name_problem(s.name) or ("needs a path" if not s.path else "")
                   or ("needs one of weight, repeat or samples" if not given
                       else f"sets {' and '.join(given)}: give one" if len(given) > 1
                       else weight_problem(given[0], getattr(s, given[0]))))
        if problem:
            raise ConfigError(f"{where}: {key} ('{s.name[:80]}') {problem}")
        kinds.add("weight" if given == ["weight"] else "repeat/samples")
    weights = [float(s.weight) for s in data.sources if s.weight is not None]
    total = sum(weights)  # as mix.py normalises them
    if not math.isfinite(total) or any(w / total == 0 for w in weights):
        raise ConfigError(f"{where}: data.sources weights {weights} cannot be normalised (their sum is {total!r}; "
                          f"each source's share must be a number > 0): give weights of a sensible scale, such as "
                          f"0.7 and 0.3")
    names = [s.name for s in data.sources]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: data.sources names must be unique, got {names}")
    if len(kinds) > 1:
        raise ConfigError(f"{where}: data.sources mixes weight with repeat/samples; use weights for all, or "
                          f"repeat/samples for all")
    for i, entry in enumerate(data.allowed_origins):
        scheme, sep, rest = entry.partition("://")
        if scheme not in ("s3", "http", "https") or not sep or not rest.split("/")[0]:
            raise ConfigError(f"{where}: data.allowed_origins[{i}] is {entry!r}; expected an origin such as "
                              f"https://HOST[:PORT] or s3://BUCKET, or a prefix under one (s3://BUCKET/PREFIX)")
    if data.sources and data.partitions is not None:
        raise ConfigError(f"{where}: key 'data.partitions' applies to data.path alone; a mixture's sources are "
                          f"partitioned each on its own (docs/data.md, Mixtures)")
