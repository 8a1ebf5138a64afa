"""The global sample order of the train stream: partitions of whole shards, each shuffled on its own.

Samples are numbered by global id, shard by shard in dataset.json's order (shard s holds ids
[start_s, start_s + count_s)). The order is a function of (seed, data set, global batch G,
partitions P, shuffle span) and of nothing about the layout:

1. Partitions (MosaicML Streaming's canonical nodes). The shards are dealt into P partitions,
   fixed for the run, balanced by sample count (largest shard first to the partition with the
   fewest samples). P divides G.
2. Slots. Step t's global batch is G slots; slot k belongs to partition k // (G / P). So every
   step takes G / P samples from every partition, and a contiguous run of slots - what the
   ranks of one node take, see `micro_batch_positions` - reads a contiguous run of partitions:
   with N nodes and N dividing P, node n reads partitions [n P / N, (n + 1) P / N) only.
3. Passes. Partition p's i-th slot of step t is its draw d = t G / P + i. Draws walk through
   the partition's samples in passes: pass e = d // n_p permutes the partition's shards
   (seeded from (seed, p, e)), concatenates their samples and spreads each shard's samples
   uniformly over a span of `span` samples centred on the shard's place (Streaming's py1e), then
   sorts: a sample moves at most span / 2 away, so a node needs only about span / shard size
   shards of the partition at a time (the cache) while a global batch mixes samples of many
   shards. A span at least the partition's size is a plain permutation of the whole partition.

Partitions of unequal size run their passes at the same rate (G / P draws per step), so a
sample of a smaller partition is seen more often, by the ratio of the partition sizes; the
automatic partition count keeps that ratio within `MAX_IMBALANCE` (see `choose_partitions`).

A global position q counts samples consumed since the start of training: step q // G, slot
q % G. Rank r of W takes the slots [r G / W, (r + 1) G / W) of every step, cut into micro
batches of m (`micro_batch_positions`).

All seeds go through numpy's SeedSequence: `seed_for(*parts)`.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

# First entry of a SeedSequence: which stream the seed is for (not a salt: a namespace).
# 0 and 1 were the shard and window streams of the order before partitions.
AUGMENT, MIXUP, PASS = 2, 3, 4
# MAE's masks: a training sample's by its global position, a validation sample's by its index (pipeline/train/mae.py).
MASK, MASK_EVAL = 5, 6

DEFAULT_PARTITIONS = 512
"""Upper bound of the automatic partition count: locality on up to 512 nodes where the data set allows."""
MAX_IMBALANCE = 0.02
"""The automatic partition count keeps (largest partition / smallest) - 1 within this."""
DEFAULT_SPAN = 1 << 18
"""Shuffle span in samples (Streaming's minimum shuffle block), or the whole partition when smaller."""


def seed_for(*parts: int) -> int:
    """A 63-bit seed from non-negative integers (numpy SeedSequence: nearby inputs, unrelated seeds)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0] >> 1)


AUGMENT_BLOCK = 1024  # augmentation seeds are drawn for this many consecutive positions at once


def _rng(*parts: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(p) for p in parts]))


def _cached(cache: OrderedDict, key: Any, size: int, make: Callable[[], Any]) -> Any:
    """cache[key], made on a miss; the least recently used entries beyond `size` are dropped."""
    if key in cache:
        cache.move_to_end(key)
    else:
        cache[key] = make()
        if len(cache) > size:
            cache.popitem(last=False)
    return cache[key]


# ----------------------------------------------------------------------------- partitions


def deal_shards(counts: list[int] | np.ndarray, partitions: int) -> list[np.ndarray]:
    """Shard numbers of each partition: largest shard first to the partition with the fewest samples
    (ties: the lower partition, the lower shard number), so that sizes differ by at most one shard.
    Shard numbers within a partition are sorted."""
    counts = np.asarray(counts, dtype=np.int64)
    heap = [(0, p) for p in range(partitions)]
    members: list[list[int]] = [[] for _ in range(partitions)]
    for s in sorted(range(len(counts)), key=lambda s: (-counts[s], s)):
        total, p = heapq.heappop(heap)
        members[p].append(s)
        heapq.heappush(heap, (total + int(counts[s]), p))
    return [np.asarray(sorted(m), dtype=np.int64) for m in members]


def imbalance(counts: list[int] | np.ndarray, shards: list[np.ndarray]) -> float:
    """(largest partition / smallest) - 1, in samples; inf when a partition is empty."""
    sizes = [int(np.asarray(counts)[s].sum()) for s in shards]
    return float("inf") if min(sizes) == 0 else max(sizes) / min(sizes) - 1


def choose_partitions(counts: list[int] | np.ndarray, global_batch: int, requested: int | None) -> int:
    """The partition count: `requested` as it is (ValueError naming data.partitions when it cannot
    work), or the largest power of two <= DEFAULT_PARTITIONS that divides the global batch, is at most
    the non-empty shards, and keeps the partition sizes within MAX_IMBALANCE of each other."""
    nonempty = int(np.count_nonzero(np.asarray(counts)))
    if requested is not None:
        if requested < 1 or global_batch % requested:
            raise ValueError(f"data.partitions={requested} must divide train.global_batch_size={global_batch} "
                             f"(every step takes global batch / partitions samples from each partition)")
        if requested > nonempty:
            raise ValueError(f"data.partitions={requested} is more than the {nonempty} non-empty shards of the "
                             f"split (a partition is a set of whole shards)")
        return requested
    p = DEFAULT_PARTITIONS
    while p > 1 and (global_batch % p or p > nonempty or imbalance(counts, deal_shards(counts, p)) > MAX_IMBALANCE):
        p //= 2
    return p


# ----------------------------------------------------------------------------- the order


class GlobalOrder:
    """position -> global sample id, for shards with `counts` samples each."""

    def __init__(self, counts: list[int], seed: int, global_batch: int, partitions: int | None = None,
                 span: int = DEFAULT_SPAN):
        self.counts = np.asarray(counts, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)])
        self.n = int(self.starts[-1])
        if self.n == 0:
            raise ValueError("the split holds no samples")
        self.seed, self.global_batch, self.span = seed, int(global_batch), max(1, int(span))
        self.partitions = choose_partitions(self.counts, self.global_batch, partitions)
        self.shards = deal_shards(self.counts, self.partitions)  # shard numbers of each partition
        self.sizes = np.asarray([int(self.counts[s].sum()) for s in self.shards], dtype=np.int64)
        self.per_step = self.global_batch // self.partitions  # draws of each partition per step
        # Partition of each shard: what a node reads, and the cache it needs.
        self.partition_of_shard = np.empty(len(self.counts), dtype=np.int64)
        for p, s in enumerate(self.shards):
            self.partition_of_shard[s] = p
        # Two passes of every partition: a step may straddle a pass boundary.
        self._passes: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._pass_cache = 2 * self.partitions
        self._augment: OrderedDict[int, np.ndarray] = OrderedDict()

    def pass_order(self, p: int, e: int) -> np.ndarray:
        """Global ids of partition p in the order of its pass e."""
        return _cached(self._passes, (p, e), self._pass_cache, lambda: self._make_pass(p, e))

    def _make_pass(self, p: int, e: int) -> np.ndarray:
        rng = _rng(PASS, self.seed, p, e)
        shards = self.shards[p][rng.permutation(len(self.shards[p]))]
        counts = self.counts[shards]
        # ids in shard order: shard s contributes starts[s], starts[s] + 1, ...
        first = np.repeat(self.starts[shards] - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
        ids = first + np.arange(int(counts.sum()), dtype=np.int64)
        n = len(ids)
        if self.span >= n:  # the span covers the partition: a plain permutation
            return ids[rng.permutation(n)]
        # py1e: each sample lands uniformly within span / 2 of its shard's middle; sort by landing place.
        middles = np.repeat(np.cumsum(counts) - counts / 2.0, counts)
        keys = middles + rng.uniform(-self.span / 2, self.span / 2, n)
        return ids[np.argsort(keys, kind="stable")]

    def draws(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(partition, draw number in that partition) of each global position."""
        step, slot = np.divmod(np.asarray(positions, dtype=np.int64), self.global_batch)
        p, i = np.divmod(slot, self.per_step)
        return p, step * self.per_step + i

    def draw_ids(self, p: np.ndarray, d: np.ndarray) -> np.ndarray:
        """Global ids of draws d of partitions p (arrays of the same shape)."""
        p, d = np.asarray(p, dtype=np.int64), np.asarray(d, dtype=np.int64)
        e, k = np.divmod(d, self.sizes[p])
        out = np.empty(p.shape, dtype=np.int64)
        for pp, ee in set(zip(p.tolist(), e.tolist())):
            mask = (p == pp) & (e == ee)
            out[mask] = self.pass_order(pp, ee)[k[mask]]
        return out

    def sample_ids(self, positions: np.ndarray | range | list[int]) -> np.ndarray:
        return self.draw_ids(*self.draws(np.asarray(positions, dtype=np.int64)))

    def sample_id(self, position: int) -> int:
        return int(self.sample_ids([position])[0])

    def augment_seed(self, position: int) -> int:
        """The seed of the augmentation of the sample at `position`: a function of (seed, position)
        only. Word `position % AUGMENT_BLOCK` of SeedSequence(AUGMENT, seed, block) - the same scheme
        as `seed_for`, drawn a block at a time (one SeedSequence per block, not per sample)."""
        block, k = divmod(int(position), AUGMENT_BLOCK)
        words = _cached(self._augment, block, 8, lambda: np.random.SeedSequence(
            [AUGMENT, self.seed, block]).generate_state(AUGMENT_BLOCK, np.uint64) >> np.uint64(1))  # 63 bits
        return int(words[k])

    def locate(self, sample_id: int) -> tuple[int, int]:
        """Global id -> (shard number, index in the shard)."""
        shard = int(np.searchsorted(self.starts, sample_id, side="right")) - 1
        return shard, sample_id - int(self.starts[shard])

    def shard_of(self, ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.starts, np.asarray(ids, dtype=np.int64), side="right") - 1

    def node_partitions(self, node: int, nodes: int) -> range:
        """Partitions whose slots the ranks of `node` (of `nodes`, ranks numbered node by node) take."""
        lo, hi = node * self.global_batch // nodes, (node + 1) * self.global_batch // nodes
        return range(lo // self.per_step, (hi - 1) // self.per_step + 1)

    def span_shards(self, p: int) -> int:
        """Shards of partition p a reader needs at once: those within span / 2 of the read place on
        either side, plus the one being read (the whole partition when the span covers it)."""
        count = len(self.shards[p])
        if self.span >= self.sizes[p]:
            return count
        mean = self.sizes[p] / count
        return min(count, int(np.ceil(self.span / mean)) + 2)


def micro_batch_positions(j: int, rank: int, world_size: int, micro: int, accum: int) -> range:
    """Global positions of this rank's j-th micro batch (step j // accum, micro batch j % accum)."""
    step, a = divmod(j, accum)
    start = step * micro * accum * world_size + rank * micro * accum + a * micro
    return range(start, start + micro)
