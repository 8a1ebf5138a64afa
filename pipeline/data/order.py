"""The global sample order of the train stream: a function of (seed, data set, shuffle window) only.

Samples are numbered by global id, shard by shard in dataset.json's order (shard s holds ids
[start_s, start_s + count_s)). Epoch e:

1. permutes the shard list with a generator seeded from (seed, e);
2. concatenates the shards' samples in that order and cuts the sequence into windows of
   `shuffle_buffer` samples;
3. permutes each window with a generator seeded from (seed, e, window).

So a window touches only the few shards it overlaps (a bounded working set, as a shuffle
buffer), and sample `index` of epoch e is found without materialising the epoch.

A global position p counts samples consumed since the start of training: epoch p // N,
index p % N. Step t of global batch G consumes positions [t G, (t + 1) G); rank r of W takes
[t G + r G / W, t G + (r + 1) G / W), cut into micro batches of m. None of this depends on
the layout, which is what makes the stream elastic (see `micro_batch_positions`).

All seeds go through numpy's SeedSequence: `seed_for(*parts)`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

# First entry of a SeedSequence: which stream the seed is for (not a salt: a namespace).
SHARDS, WINDOW, AUGMENT, MIXUP = 0, 1, 2, 3


def seed_for(*parts: int) -> int:
    """A 63-bit seed from non-negative integers (numpy SeedSequence: nearby inputs, unrelated seeds)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0] >> 1)


AUGMENT_BLOCK = 1024  # augmentation seeds are drawn for this many consecutive indices at once


def _rng(*parts: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(p) for p in parts]))


def _cached(cache: OrderedDict, key: Any, size: int, make: Callable[[], Any]) -> Any:
    """cache[key], made on a miss; the least recently made entries beyond `size` are dropped."""
    if key not in cache:
        cache[key] = make()
        if len(cache) > size:
            cache.popitem(last=False)
    return cache[key]


class GlobalOrder:
    """position -> global sample id, for shards with `counts` samples each."""

    def __init__(self, counts: list[int], seed: int, window: int):
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.counts = np.asarray(counts, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)])
        self.n = int(self.starts[-1])
        self.seed = seed
        self.window = max(1, int(window))
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._windows: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._augment: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard order, where each shard starts in the epoch's concatenated sequence)."""
        def make() -> tuple[np.ndarray, np.ndarray]:
            perm = _rng(SHARDS, self.seed, epoch).permutation(len(self.counts))
            return perm, np.concatenate([[0], np.cumsum(self.counts[perm])])
        return _cached(self._epochs, epoch, 2, make)

    def _window(self, epoch: int, w: int) -> np.ndarray:
        size = min(self.window, self.n - w * self.window)
        return _cached(self._windows, (epoch, w), 8, lambda: _rng(WINDOW, self.seed, epoch, w).permutation(size))

    def sample_id(self, position: int) -> int:
        epoch, index = divmod(int(position), self.n)
        w, k = divmod(index, self.window)
        concat = w * self.window + int(self._window(epoch, w)[k])
        perm, cstarts = self._epoch(epoch)
        j = int(np.searchsorted(cstarts, concat, side="right")) - 1
        shard = int(perm[j])
        return int(self.starts[shard]) + concat - int(cstarts[j])

    def augment_seed(self, position: int) -> int:
        """The seed of the augmentation of the sample at `position`: a function of (seed, epoch, index in
        epoch) only. Word `index % AUGMENT_BLOCK` of SeedSequence(AUGMENT, seed, epoch, block) - the same
        scheme as `seed_for`, drawn a block at a time (one SeedSequence per block, not per sample)."""
        epoch, index = divmod(int(position), self.n)
        block, k = divmod(index, AUGMENT_BLOCK)
        words = _cached(self._augment, (epoch, block), 8, lambda: np.random.SeedSequence(
            [AUGMENT, self.seed, epoch, block]).generate_state(AUGMENT_BLOCK, np.uint64) >> np.uint64(1))  # 63 bits
        return int(words[k])

    def locate(self, sample_id: int) -> tuple[int, int]:
        """Global id -> (shard number, index in the shard)."""
        shard = int(np.searchsorted(self.starts, sample_id, side="right")) - 1
        return shard, sample_id - int(self.starts[shard])


def micro_batch_positions(j: int, rank: int, world_size: int, micro: int, accum: int) -> range:
    """Global positions of this rank's j-th micro batch (step j // accum, micro batch j % accum)."""
    step, a = divmod(j, accum)
    start = step * micro * accum * world_size + rank * micro * accum + a * micro
    return range(start, start + micro)


def check_layout(global_batch: int, world_size: int, micro: int) -> int:
    """The accumulation steps that make `global_batch` on this layout; ValueError naming the numbers."""
    if global_batch % (world_size * micro):
        raise ValueError(f"train.global_batch_size={global_batch} is not a multiple of world size {world_size} "
                         f"x train.micro_batch_size={micro} = {world_size * micro}")
    return global_batch // (world_size * micro)
