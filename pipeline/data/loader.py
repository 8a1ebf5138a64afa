"""Builders of the train stream and the eval pass over WebDataset shards.

- `build_train_loader`: the elastic, resumable train stream of one rank (stream.py; the global
  order in order.py, random access to tar shards in reader.py).
- `build_eval_loader`: one exactly-once pass over the validation split (eval.py).

Bad data (corrupt image, oversized image, missing image or label, duplicate member, truncated tar,
unreadable shard) is counted by kind (bad.py): replaced within its micro batch when training, an invalid
slot when evaluating; past `data.max_bad_fraction` of the samples read (after 100)
`BadDataError` names the shard with the most bad samples and why it could not be read.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pipeline.config import DataConfig
from pipeline.derived import accumulation_steps, image_size

from .bad import Counters, DataError, merge_counters
from .cache import needs_copy
from .eval import EvalLoader, EvalStream
from .info import DatasetInfo, check_shard_names
from .mix import labels_for, read_data
from .nodes import node_place
from .order import SlicedOrder
from .origins import check_origins
from .pixels import resolve_data
from .stream import TrainStream
from .train_loader import LOADER_STATE_VERSION, TrainLoader

__all__ = ["LOADER_STATE_VERSION", "Counters", "EvalLoader", "TrainLoader", "build_eval_loader", "build_train_loader",
           "merge_counters"]


def _label_key(cfg: DataConfig, info: DatasetInfo) -> str:
    # dataset.json records where make_shards found the labels; the config wins when it is set.
    return cfg.label_key if cfg.label_key != "cls" else info.label_key


def _check_placement(batch_size: int, rank: int, world_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")


def label_free(data: DataConfig) -> DataConfig:
    """The data config of a pass that reads no labels: label-free shards are valid, a labelled data set's
    labels are unused, and a sample without one is not counted as bad (MAE's and DINOv2's training)."""
    return dataclasses.replace(data, label_key="")


def build_train_loader(cfg: DataConfig, img_size: int | tuple[int, int], batch_size: int, seed: int,
                       rank: int = 0, world_size: int = 1, num_classes: int | None = None,
                       info: DatasetInfo | None = None, global_batch_size: int | None = None,
                       ids_only: bool = False, per_batch: Callable[[range], np.ndarray] | None = None,
                       view: Callable[[Any, int], tuple[torch.Tensor, ...]] | None = None) -> TrainLoader:
    """The infinite, resumable train stream of one rank: micro batches of `batch_size`.

    `global_batch_size` (default batch_size x world_size) must be a multiple of
    batch_size x world_size; `loader.accum` micro batches make one step. `ids_only`: batches
    are the sample ids only (nothing read; for tests and tools). `per_batch(positions)`: an array
    computed with each micro batch where it is built (a worker), then `loader.last_per_batch`.
    `view(image, seed)`: an objective's tensors of one sample in place of the train transform (seeded with
    the sample's augmentation seed); the micro batch's images are then a tuple, each part stacked.
    """
    _check_placement(batch_size, rank, world_size)
    if seed < 0:
        raise DataError(f"train.seed must be >= 0, got {seed}")
    global_batch = global_batch_size or batch_size * world_size
    accum = accumulation_steps(global_batch, world_size, batch_size)
    info = info or read_data(cfg)  # with data.sources: the mixture's merged description (mix.py)
    cfg = resolve_data(cfg, info)  # data.mean/std for its channels (null: dataset.json's); RGB-only keys refused
    check_shard_names(info, cfg.allow_pipe_shards)  # before any worker could run one
    check_origins(info, cfg.allowed_origins)  # nor fetch from where the data set is not (origins.py)
    split = info.split(cfg.train_split)
    if split.num_samples == 0:
        raise DataError(f"split '{cfg.train_split}' of {info.path} has no samples")
    stream = TrainStream(split, cfg, image_size(img_size), batch_size, accum, seed, rank, world_size,
                         num_classes or info.num_classes, _label_key(cfg, info), ids_only=ids_only,
                         per_batch=per_batch, view=view, labels=labels_for(cfg, info, cfg.train_split),
                         mixture=info.mixture)
    place = node_place()
    loader = TrainLoader(stream, cfg, global_batch, local_ranks=max(1, world_size // place.nodes))
    if not ids_only:
        check_cache(stream.order, split.shards, split.shard_bytes, cfg, place.node, place.nodes)
        # a resumed mixture's order is its checkpoint's history (another cut, perhaps a new period): again
        loader.recheck = lambda order: check_cache(order, split.shards, split.shard_bytes, cfg, place.node,
                                                   place.nodes)
    return loader


FETCH_AHEAD_SHARDS = 2
"""Shards per partition a node's cache holds beyond the shuffle span: the next ones, fetched ahead."""


def cache_needed_bytes(order: SlicedOrder, shard_bytes: list[int | None], node: int, nodes: int) -> int | None:
    """Bytes this node's cache must hold at once: for each partition slice it reads, the shards of one
    shuffle span plus those fetched ahead, at the slice's largest shard size, and never more than all the
    shards of the slices it reads (slices of one partition share the shards they split). None when no shard's
    size is known (dataset.json records it for shards make_shards wrote or indexed)."""
    known = [b for b in shard_bytes if b]
    if not known:
        return None
    fallback = max(known)  # shards of unknown size are taken to be as large as the largest known one
    total, every = 0, set()
    for q in order.node_slices(node, nodes):
        largest = max(shard_bytes[s] or fallback for s in order.slice_shards[q])
        total += min(len(order.slice_shards[q]), order.span_shards(q) + FETCH_AHEAD_SHARDS) * largest
        every.update(order.slice_shards[q].tolist())
    return min(total, sum(shard_bytes[s] or fallback for s in every))


def check_cache(order: SlicedOrder, shards: list[str], shard_bytes: list[int | None], cfg: DataConfig,
                node: int, nodes: int) -> None:
    """DataError before training when data.cache_limit_gb cannot hold what this node's shuffle spans need
    (it would evict shards still in use and fetch them again and again)."""
    if not any(needs_copy(s) for s in shards):
        return  # read in place: nothing is copied into the cache
    needed = cache_needed_bytes(order, shard_bytes, node, nodes)
    if needed is None or needed <= cfg.cache_limit_gb * 2**30:
        return
    parts = order.node_partitions(node, nodes)
    raise DataError(f"data.cache_limit_gb={cfg.cache_limit_gb:g} is too small: node {node} of {nodes} reads "
                    f"{len(parts)} partitions whose shuffle spans (data.shuffle_span={order.span}) need "
                    f"{size_text(needed)} of shards at once; set data.cache_limit_gb to at least "
                    f"{gib_at_least(needed)} or lower data.shuffle_span")


def size_text(n: int) -> str:
    """Bytes in the largest binary unit that keeps the figure at 1 or more (never '0.0 GiB'), rounded up."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{math.ceil(n / scale * 10) / 10:g} {unit}"
    return f"{n} bytes"


def gib_at_least(n: int) -> str:
    """`n` bytes in GiB, rounded up to 2 significant digits: a data.cache_limit_gb value never below `n`."""
    gib = n / 2**30
    step = 10.0 ** (math.floor(math.log10(gib)) - 1)
    return f"{math.ceil(round(gib / step, 9)) * step:.{max(0, 1 - math.floor(math.log10(gib)))}f}"


def build_eval_loader(cfg: DataConfig, img_size: int | tuple[int, int], batch_size: int, rank: int = 0,
                      world_size: int = 1, num_classes: int | None = None,
                      info: DatasetInfo | None = None, limit: int | None = None) -> EvalLoader:
    """One exactly-once pass over the validation split, the same number of batches on every rank
    (`limit`: over its first `limit` samples only)."""
    _check_placement(batch_size, rank, world_size)
    info = info or read_data(cfg)
    cfg = resolve_data(cfg, info)
    check_shard_names(info, cfg.allow_pipe_shards)
    check_origins(info, cfg.allowed_origins)
    split = info.split(cfg.val_split)
    n = split.num_samples if limit is None else min(limit, split.num_samples)
    lo, hi = rank * n // world_size, (rank + 1) * n // world_size
    per_rank = -(-n // world_size)
    num_batches = -(-per_rank // batch_size)
    workers = max(1, min(cfg.num_workers, num_batches))
    stream = EvalStream(split, cfg, image_size(img_size), batch_size, lo, hi, num_batches,
                        num_classes or info.num_classes, _label_key(cfg, info), workers,
                        labels_for(cfg, info, cfg.val_split))
    return EvalLoader(stream, cfg, rank)
