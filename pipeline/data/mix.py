"""A mixture's sources (`data.sources`): each data set read and checked on its own, the weights resolved, one
label space for the run, and the mix a checkpoint records (and what changed since).

- Each source's dataset.json is read as `data.path`'s would be (local, s3://, http(s)://, its retries, its
  shard sizes and digests, its `pipe:` rule); the run sees their shards one source after another.
- Weights: `weight` (normalised over the sources), or Streaming's absolute forms, `repeat` (samples per epoch
  of the mixture as a multiple of the source's size) and `samples` (its samples per epoch of the mixture); an
  epoch of the mixture is the sum of those, and the weight of a source its part of it.
- Labels: the run's classes are the sources' class names, source after source, each name once; a sample's
  label is its class name's place in that list (the same name in two sources is one class). A run that reads
  labels needs them from every source; a label-free objective reads none (`label_free`).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pipeline.config import DataConfig

from . import tario
from .bad import DataError
from .info import DatasetInfo, SplitInfo, dataset_info_of
from .mix_order import MixPeriod, MixtureOrder, Slicing, choose_blocks


@dataclass
class MixSource:
    name: str
    info: DatasetInfo
    split: SplitInfo
    """Its train split."""
    weight: float
    """Its share of every global batch (the weights sum to 1)."""
    label_key: str | None = None
    """Where its labels are; None: as data.label_key says (resolved by `labels_for`)."""


@dataclass
class Mixture:
    sources: list[MixSource]
    class_names: list[str]
    """The run's label space: every labelled source's class names, in order, each once."""

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def weights(self) -> tuple[tuple[str, float], ...]:
        return tuple((s.name, s.weight) for s in self.sources)

    def source_of_shard(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.sources)), [len(s.split.shards) for s in self.sources])


def read_mixture(cfg: DataConfig) -> Mixture:
    """The sources of `cfg.sources`, each one's dataset.json read and checked (DataError naming the source)."""
    sources, sizes = [], []
    for sc in cfg.sources:
        try:
            info = dataset_info_of(replace(cfg, path=sc.path, sources=[]))
            split = info.split(sc.train_split or cfg.train_split)
        except DataError as e:
            raise DataError(f"data.sources '{sc.name}': {e}") from None
        if split.num_samples == 0:
            raise DataError(f"data.sources '{sc.name}': split '{sc.train_split or cfg.train_split}' of {sc.path} "
                            f"has no samples")
        sources.append(MixSource(sc.name, info, split, 0.0, sc.label_key))
        sizes.append(split.num_samples)
    given = [sc.weight if sc.weight is not None else sc.samples if sc.samples is not None else sc.repeat * n
             for sc, n in zip(cfg.sources, sizes)]
    total = float(sum(given))
    if not math.isfinite(total):  # a repeat of 1e308 times a size: the config's checks see the factor only
        raise DataError(f"data.sources: the samples per epoch {given} sum to {total}; give factors of a sensible scale")
    for s, g in zip(sources, given):
        s.weight = g / total
    names: list[str] = []
    for s in sources:
        names += [c for c in s.info.class_names if c not in names]
    return Mixture(sources, names)


def merged_info(mixture: Mixture, cfg: DataConfig) -> DatasetInfo:
    """One DatasetInfo for the objectives and the loaders: the run's label space (none unless every source has
    labels), the train split (and the validation split of every source that has one) as the sources' shards
    one after another."""
    def joined(parts: list[SplitInfo]) -> SplitInfo:
        return SplitInfo(sum(p.num_samples for p in parts), [s for p in parts for s in p.shards],
                         [c for p in parts for c in p.shard_counts],
                         [b for p in parts for b in (p.shard_bytes or [None] * len(p.shards))],
                         [d for p in parts for d in (p.shard_sha256 or [None] * len(p.shards))])

    splits = {cfg.train_split: joined([part for _, part in split_parts(mixture, cfg, cfg.train_split)])}
    val = [part for _, part in split_parts(mixture, cfg, cfg.val_split)]
    if val:
        splits[cfg.val_split] = joined(val)
    where = ", ".join(f"{s.name}: {s.info.path}" + ("" if s.info.num_classes else " (no labels)")
                      for s in mixture.sources)
    # Labelled only when every source is: a run or an evaluation that reads labels reads them from every sample.
    classes = mixture.class_names if all(s.info.num_classes for s in mixture.sources) else []
    return DatasetInfo(len(classes), classes, splits, mixture.sources[0].info.image_format, "cls",
                       f"data.sources ({where})", mixture=mixture)


# ----------------------------------------------------------------------------- labels


class Labels:
    """Per shard of a split: where its samples' labels are, its data set's class count (a label beyond it is
    bad), and the run's class of each of its classes (None: as written). One source: one entry."""

    def __init__(self, keys: list[str], classes: list[int | None], maps: list[np.ndarray | None],
                 source_of_shard: np.ndarray):
        self.keys, self.classes, self.maps, self.source_of_shard = keys, classes, maps, source_of_shard

    @classmethod
    def single(cls, key: str, classes: int | None, shards: int) -> Labels:
        return cls([key], [classes], [None], np.zeros(shards, dtype=np.int64))

    def parse(self, raw: Any, shard_no: int) -> int:
        """The run's label of a sample of shard `shard_no` (tario.SampleError when it has none, or a bad one)."""
        i = int(self.source_of_shard[shard_no])
        label = tario.parse_label(raw, self.keys[i], self.classes[i])
        return label if label < 0 or self.maps[i] is None else int(self.maps[i][label])

    def decode(self, raw: Any, shard_no: int, max_pixels: int) -> tuple[Any, int]:
        """(RGB image, the run's label), as tario.decode: the label checked before the image is decoded."""
        label = self.parse(raw, shard_no)
        return tario.sample_image(raw, max_pixels), label


def labels_for(cfg: DataConfig, info: DatasetInfo, split: str) -> Labels:
    """How the samples of `split` are labelled: data.label_key '' reads no labels (a label-free objective);
    otherwise a source's own label_key, else data.label_key when set, else its dataset.json's. A mixture that
    reads labels needs them from every source (DataError naming the one without)."""
    def key_of(own: str | None, data_info: DatasetInfo) -> str:
        if cfg.label_key == "":
            return ""
        return own or (cfg.label_key if cfg.label_key != "cls" else data_info.label_key)

    mixture = info.mixture
    if mixture is None:
        return Labels.single(key_of(None, info), info.num_classes, len(info.split(split).shards))
    keys, classes, maps, parts = [], [], [], []
    for s, part in split_parts(mixture, cfg, split):
        key = key_of(s.label_key, s.info)
        if key and s.info.num_classes == 0:
            raise DataError(f"data.sources '{s.name}' ({s.info.path}) has no labels (dataset.json: num_classes 0) "
                            f"and this run reads labels: give every source labels, or train with a label-free "
                            f"objective (model.objective=mae or dinov2)")
        keys.append(key)
        classes.append(s.info.num_classes or None)
        maps.append(np.asarray([mixture.class_names.index(c) for c in s.info.class_names], dtype=np.int64))
        parts.append(len(part.shards))
    return Labels(keys, classes, maps, np.repeat(np.arange(len(parts)), parts))


def split_parts(mixture: Mixture, cfg: DataConfig, split: str) -> list[tuple[MixSource, SplitInfo]]:
    """The sources' parts of a split of the merged info, in its order: every source's train split for
    data.train_split, else the split of that name of the sources that have one."""
    if split == cfg.train_split:
        return [(s, s.split) for s in mixture.sources]
    return [(s, s.info.splits[split]) for s in mixture.sources if split in s.info.splits]


def read_data(cfg: DataConfig) -> DatasetInfo:
    """The data set a run's DataConfig names: data.path's (`dataset_info_of`), or with data.sources the merged
    description of the mixture (`merged_info`), which carries the mixture itself."""
    return merged_info(read_mixture(cfg), cfg) if cfg.sources else dataset_info_of(cfg)


# ----------------------------------------------------------------------------- what a checkpoint records


def shards_fingerprint(shards: list[str], counts: list[int], sha256: list[str | None]) -> dict[str, Any]:
    """What an order over these shards depends on: names (not paths: the same shards mounted elsewhere still
    resume) and counts, and their content (make_shards' digests: the same names over rewritten shards would
    be other samples at the same positions)."""
    names = [(sh.rsplit("/", 1)[-1], n) for sh, n in zip(shards, counts)]
    content = hashlib.sha256(repr(list(sha256)).encode()).hexdigest()[:16] if any(sha256) else None
    return {"num_samples": int(sum(counts)), "shards": hashlib.sha256(repr(names).encode()).hexdigest()[:16],
            "shard_content": content}


def source_fingerprints(mixture: Mixture) -> dict[str, dict[str, Any]]:
    return {s.name: shards_fingerprint(s.split.shards, s.split.shard_counts,
                                       list(s.split.shard_sha256 or [None] * len(s.split.shards)))
            for s in mixture.sources}


def history_state(periods: list[MixPeriod], slicing: dict[str, Slicing], sources: dict[str, Any]) -> dict[str, Any]:
    """The mix's history as plain data for the checkpoint: every period, every source's cut and fingerprint."""
    return {"periods": [{"step": p.step, "blocks": p.blocks, "weights": [[n, w] for n, w in p.weights]}
                        for p in periods],
            "slicing": {n: [s.partitions, s.slices_per_partition] for n, s in slicing.items()},
            "sources": sources}


def history_from_state(state: dict[str, Any]) -> tuple[list[MixPeriod], dict[str, Slicing], dict[str, Any]]:
    periods = [MixPeriod(int(p["step"]), tuple((str(n), float(w)) for n, w in p["weights"]), int(p["blocks"]))
               for p in state["periods"]]
    slicing = {n: Slicing(int(p), int(k)) for n, (p, k) in state["slicing"].items()}
    return periods, slicing, dict(state["sources"])


def mix_changes(recorded: MixPeriod, configured: tuple[tuple[str, float], ...]) -> list[str]:
    """What differs between the checkpoint's mix and the configured one, one phrase each (empty: the same)."""
    old, new = dict(recorded.weights), dict(configured)
    out = [f"'{n}' removed" for n in old if n not in new] + [f"'{n}' added" for n in new if n not in old]
    out += [f"'{n}' weight {old[n]:.4g} -> {new[n]:.4g}" for n in new if n in old and abs(old[n] - new[n]) > 1e-12]
    if not out and list(old) != list(new):
        out.append(f"order of the sources {list(old)} -> {list(new)}")
    return out


def start_period(mixture: Mixture, global_batch: int, step: int, slicing: dict[str, Slicing]
                 ) -> tuple[MixPeriod, dict[str, Slicing]]:
    """The period of `mixture` from `step` on: its block count, and the cut of every source (kept from
    `slicing` for a source already cut, chosen for a new one). ValueError when the global batch is too small."""
    counts = [np.asarray(s.split.shard_counts, dtype=np.int64) for s in mixture.sources]
    blocks, cuts = choose_blocks(global_batch, [s.weight for s in mixture.sources], counts,
                                 [slicing.get(s.name) for s in mixture.sources])
    return MixPeriod(step, mixture.weights(), blocks), {**slicing, **dict(zip(mixture.names, cuts))}


def mixture_order(mixture: Mixture, seed: int, global_batch: int, span: int, periods: list[MixPeriod],
                  slicing: dict[str, Slicing]) -> MixtureOrder:
    return MixtureOrder([(s.name, list(s.split.shard_counts)) for s in mixture.sources], seed, global_batch, span,
                        periods, slicing)


class MixHistory:
    """A mixture's periods and its sources' cuts: what the train stream's order is built from, what a checkpoint
    records, and what a resume continues (or refuses: `restore`)."""

    def __init__(self, mixture: Mixture, seed: int, global_batch: int, span: int):
        self.mixture, self.seed, self.global_batch, self.span = mixture, seed, global_batch, span
        try:
            period, self.slicing = start_period(mixture, global_batch, 0, {})
        except ValueError as e:
            raise DataError(f"data.sources: {e}") from None
        self.periods = [period]
        self.sources = source_fingerprints(mixture)  # of every source the history has seen

    def order(self) -> MixtureOrder:
        return mixture_order(self.mixture, self.seed, self.global_batch, self.span, self.periods, self.slicing)

    def state(self) -> dict[str, Any]:
        return history_state(self.periods, self.slicing, self.sources)

    def restore(self, state: dict[str, Any], step: int, allow_change: bool) -> dict[str, Any] | None:
        """Continue the checkpoint's history at `step`: the same mix exactly; another one (a weight changed, a
        source added or removed) only with `allow_change`, as a new period from `step`, returning what changed
        ({"step", "changes", "weights"}). A source of the same name over other shards is refused either way."""
        periods, slicing, sources = history_from_state(state)
        now = source_fingerprints(self.mixture)
        for name, fp in now.items():
            if name in sources and sources[name] != fp:
                what = "rewritten (the sha256 digests in its dataset.json differ)" if (
                    {**sources[name], "shard_content": None} == {**fp, "shard_content": None}) else "other shards"
                raise DataError(f"cannot continue the data stream: source '{name}' is {what} since the checkpoint, "
                                f"so its position would mean other samples; restore its shards, give the new data "
                                f"another name, or use a new run.dir")
        changes = mix_changes(periods[-1], self.mixture.weights())
        if changes and not allow_change:
            raise DataError(f"cannot continue the data stream at step {step}: the mix changed since the checkpoint "
                            f"({'; '.join(changes)}); set data.allow_mix_change=true to continue with the new mix "
                            f"from this step, or resume with the checkpoint's data.sources")
        self.sources = {**sources, **now}
        if not changes:
            self.periods, self.slicing = periods, slicing
            return None
        try:
            period, self.slicing = start_period(self.mixture, self.global_batch, step, slicing)
        except ValueError as e:
            raise DataError(f"data.sources: {e}") from None
        # A change at the very step the last period began replaces it (a resume that changed its mind twice).
        self.periods = [p for p in periods if p.step < step] + [period]
        return {"step": step, "changes": changes, "weights": dict(self.mixture.weights())}
