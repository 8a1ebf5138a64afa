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
3. Slices. Each partition is cut into k slices of equal sample count (within one sample), in its
   shards' order; a cut that falls inside a shard splits that shard's samples between two slices
   of the partition. The slot run of a partition is cut the same way: slice j of partition p takes
   G / (P k) of its slots. k is the largest power of two with P k <= DEFAULT_PARTITIONS, P k
   dividing G, and P (k - 1) <= MAX_SPLIT_FETCH x the non-empty shards (`choose_slices`), with
   the automatic P; k = 1 when data.partitions sets P. A function of the data set, G and P only. With N nodes dividing P k, node n reads slices
   [n P k / N, (n + 1) P k / N): at most P (k - 1) shards (the split ones) are read by two nodes,
   so an epoch fetches at most 1 + MAX_SPLIT_FETCH times the data set, up to P k nodes, while the
   partitions themselves stay whole-shard and balanced. With k = 1 a slice is its partition.
4. Passes. Slice q's i-th slot of step t is its draw d = t G / (P k) + i. Draws walk through
   the slice's samples in passes: pass e = d // n_q permutes the slice's shards (or shard pieces;
   seeded from (seed, q, e)), concatenates their samples and spreads each shard's samples
   uniformly over a span of `span` samples centred on the shard's place (Streaming's py1e), then
   sorts: a sample moves at most span / 2 away, so a node needs only about span / shard size
   shards of the slice at a time (the cache) while a global batch mixes samples of many
   shards. A span at least the slice's size is a plain permutation of the whole slice.

Partitions of unequal size run their passes at the same rate (G / P draws per step), so a
sample of a smaller partition is seen more often, by the ratio of the partition sizes; the
automatic partition count keeps that ratio within `MAX_IMBALANCE` (see `choose_partitions`).

A global position q counts samples consumed since the start of training: step q // G, slot
q % G. Rank r of W takes the slots [r G / W, (r + 1) G / W) of every step, cut into micro
batches of m (`micro_batch_positions`).

All seeds go through numpy's SeedSequence: `seed_for(*parts)`.

`SlicedOrder` is what this order and a mixture's (`mix_order.MixtureOrder`, data.sources) share: a slice's
passes, draw -> sample id, the augmentation seeds, shard arithmetic.
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
# MAE's masks: a training sample's by its global position, a validation sample's by its index (the MAE objective).
MASK, MASK_EVAL = 5, 6
# DINOv2's iBOT block masks: from a training sample's augmentation seed and the global crop's index.
IBOT_MASK = 7
# DINOv3: a step's crop sizes (high-resolution stage) from (seed, step); a crop's RoPE boxes from its sample's seed.
CROP_SIZES, ROPE_AUG = 8, 9

DEFAULT_PARTITIONS = 512
"""Upper bound of the automatic partition count: locality on up to 512 nodes where the data set allows."""
MAX_IMBALANCE = 0.02
"""The automatic partition count keeps (largest partition / smallest) - 1 within this."""
MAX_SPLIT_FETCH = 0.05
"""Slices may split at most this fraction of the non-empty shards: what an epoch fetches beyond the data set."""
DEFAULT_SPAN = 1 << 18
"""Shuffle span in samples (Streaming's minimum shuffle block), or the whole partition when smaller."""


def seed_for(*parts: int) -> int:
    """A 63-bit seed from non-negative integers (numpy SeedSequence: nearby inputs, unrelated seeds)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0] >> 1)


AUGMENT_BLOCK = 1024  # augmentation seeds are drawn for this many consecutive positions at once


def _rng(*parts: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(p) for p in parts]))


def cached(cache: OrderedDict, key: Any, size: int, make: Callable[[], Any]) -> Any:
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


def choose_slices(counts: list[int] | np.ndarray, global_batch: int, partitions: int) -> int:
    """Slices per partition: the largest power of two k with P k <= DEFAULT_PARTITIONS, P k dividing the
    global batch, and P (k - 1) shards split (at most one per cut) within MAX_SPLIT_FETCH of the non-empty
    shards. A function of the data set, G and P: never of the layout."""
    counts = np.asarray(counts)
    nonempty = int(np.count_nonzero(counts))
    smallest = int(min(counts[s].sum() for s in deal_shards(counts, partitions)))
    k = 1
    while (partitions * 2 * k <= DEFAULT_PARTITIONS and global_batch % (partitions * 2 * k) == 0
           and partitions * (2 * k - 1) <= MAX_SPLIT_FETCH * nonempty and smallest >= 2 * k):
        k *= 2
    return k


def slice_partition(counts: np.ndarray, shards: np.ndarray, k: int) -> list[np.ndarray]:
    """Cut a partition (its shards in order) into k slices of equal sample count (within one sample):
    each slice a [segments, 3] array of (shard, first, end) sample ranges. A cut inside a shard splits
    it between two slices; an empty shard stays whole in the slice where its place falls."""
    size = int(counts[shards].sum())
    cuts = [j * size // k for j in range(k + 1)]
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(k)]
    place = 0
    for s in shards.tolist():
        n = int(counts[s])
        if n == 0:
            out[min(k - 1, int(np.searchsorted(cuts, place, side="right")) - 1)].append((s, 0, 0))
            continue
        for j in range(k):
            lo, hi = max(place, cuts[j]), min(place + n, cuts[j + 1])
            if lo < hi:
                out[j].append((s, lo - place, hi - place))
        place += n
    return [np.asarray(seg, dtype=np.int64).reshape(-1, 3) for seg in out]


# ----------------------------------------------------------------------------- the order


class SlicedOrder:
    """What every order built of slices shares (a data set's `GlobalOrder`, a mixture's `MixtureOrder` in
    mix_order.py): a slice's passes, draw -> sample id, the augmentation seeds, shard arithmetic. A subclass
    sets the attributes below and says which slice and draw a global position is (`draws`) and which slices
    a node reads (`node_slices`)."""

    counts: np.ndarray  # samples per shard; shards are numbered 0.. (a mixture: its sources' one after another)
    starts: np.ndarray  # global id of each shard's first sample, and the total at the end
    n: int
    seed: int
    global_batch: int
    span: int
    segments: list[np.ndarray]  # per slice: [pieces, 3] (shard, first, end) sample ranges
    slice_sizes: np.ndarray
    slice_shards: list[np.ndarray]

    def _init_passes(self) -> None:
        self.slices = len(self.segments)
        self.slice_sizes = np.asarray([int((seg[:, 2] - seg[:, 1]).sum()) for seg in self.segments], dtype=np.int64)
        self.slice_shards = [np.unique(seg[:, 0]) for seg in self.segments]
        # Two passes of every slice: a step may straddle a pass boundary.
        self._passes: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._pass_cache = 2 * self.slices
        self._augment: OrderedDict[int, np.ndarray] = OrderedDict()

    def pass_seed(self, q: int, e: int) -> tuple[int, ...]:
        """The SeedSequence entropy of slice q's pass e."""
        return (PASS, self.seed, q, e)

    def pass_order(self, q: int, e: int) -> np.ndarray:
        """Global ids of slice q (with one slice per partition: partition q) in the order of its pass e."""
        return cached(self._passes, (q, e), self._pass_cache, lambda: self._make_pass(q, e))

    def _make_pass(self, q: int, e: int) -> np.ndarray:
        rng = _rng(*self.pass_seed(q, e))
        segs = self.segments[q][rng.permutation(len(self.segments[q]))]
        counts = segs[:, 2] - segs[:, 1]
        # ids in segment order: segment (s, a, b) contributes starts[s] + a, ..., starts[s] + b - 1
        first = np.repeat(self.starts[segs[:, 0]] + segs[:, 1] - np.concatenate([[0], np.cumsum(counts)[:-1]]),
                          counts)
        ids = first + np.arange(int(counts.sum()), dtype=np.int64)
        n = len(ids)
        if self.span >= n:  # the span covers the slice: a plain permutation
            return ids[rng.permutation(n)]
        # py1e: each sample lands uniformly within span / 2 of its shard's middle; sort by landing place.
        middles = np.repeat(np.cumsum(counts) - counts / 2.0, counts)
        keys = middles + rng.uniform(-self.span / 2, self.span / 2, n)
        return ids[np.argsort(keys, kind="stable")]

    def draws(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slice, draw number in that slice) of each global position."""
        raise NotImplementedError

    def node_slices(self, node: int, nodes: int) -> list[int] | range:
        """Slices whose slots the ranks of `node` (of `nodes`, ranks numbered node by node) take: what it reads."""
        raise NotImplementedError

    def steps_per_pass(self) -> int:
        """Steps within which every slice makes at least one whole pass (what fetching ahead looks across)."""
        raise NotImplementedError

    def draw_ids(self, p: np.ndarray, d: np.ndarray) -> np.ndarray:
        """Global ids of draws d of slices p (arrays of the same shape)."""
        p, d = np.asarray(p, dtype=np.int64).ravel(), np.asarray(d, dtype=np.int64)
        e, k = np.divmod(d.ravel(), self.slice_sizes[p])
        out = np.empty(p.shape, dtype=np.int64)
        # grouped by (slice, pass): one lookup per pass however many draws are asked for at once
        by = np.argsort(p * (int(e.max(initial=0)) + 1) + e, kind="stable")
        cuts = np.flatnonzero((np.diff(p[by]) != 0) | (np.diff(e[by]) != 0)) + 1
        for group in np.split(by, cuts) if len(by) else []:
            out[group] = self.pass_order(int(p[group[0]]), int(e[group[0]]))[k[group]]
        return out.reshape(d.shape)

    def sample_ids(self, positions: np.ndarray | range | list[int]) -> np.ndarray:
        return self.draw_ids(*self.draws(np.asarray(positions, dtype=np.int64)))

    def sample_id(self, position: int) -> int:
        return int(self.sample_ids([position])[0])

    def augment_seed(self, position: int) -> int:
        """The seed of the augmentation of the sample at `position`: a function of (seed, position)
        only. Word `position % AUGMENT_BLOCK` of SeedSequence(AUGMENT, seed, block) - the same scheme
        as `seed_for`, drawn a block at a time (one SeedSequence per block, not per sample)."""
        block, k = divmod(int(position), AUGMENT_BLOCK)
        words = cached(self._augment, block, 8, lambda: np.random.SeedSequence(
            [AUGMENT, self.seed, block]).generate_state(AUGMENT_BLOCK, np.uint64) >> np.uint64(1))  # 63 bits
        return int(words[k])

    def locate(self, sample_id: int) -> tuple[int, int]:
        """Global id -> (shard number, index in the shard)."""
        shard = int(np.searchsorted(self.starts, sample_id, side="right")) - 1
        return shard, sample_id - int(self.starts[shard])

    def shard_of(self, ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.starts, np.asarray(ids, dtype=np.int64), side="right") - 1

    def span_shards(self, q: int) -> int:
        """Shards of slice q a reader needs at once: those within span / 2 of the read place on
        either side, plus the one being read (the whole slice when the span covers it)."""
        count = len(self.segments[q])
        if self.span >= self.slice_sizes[q]:
            return count
        mean = self.slice_sizes[q] / count
        return min(count, int(np.ceil(self.span / mean)) + 2)


class GlobalOrder(SlicedOrder):
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
        # Slices: what the order and the nodes work on (with k = 1, the partitions themselves).
        # A partition count set by hand (data.partitions) is taken as the unit the user asked for: one slice.
        self.slices_per_partition = (choose_slices(self.counts, self.global_batch, self.partitions)
                                     if partitions is None else 1)
        k = self.slices_per_partition
        self.segments = [seg for s in self.shards for seg in slice_partition(self.counts, s, k)]
        self._init_passes()
        self.slice_step = self.global_batch // self.slices  # draws of each slice per step

    def draws(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slice, draw number in that slice) of each global position."""
        step, slot = np.divmod(np.asarray(positions, dtype=np.int64), self.global_batch)
        q, i = np.divmod(slot, self.slice_step)
        return q, step * self.slice_step + i

    def steps_per_pass(self) -> int:
        return int(self.slice_sizes.max()) // self.slice_step + 1

    def node_partitions(self, node: int, nodes: int) -> range:
        """Partitions whose slots the ranks of `node` (of `nodes`, ranks numbered node by node) take."""
        lo, hi = node * self.global_batch // nodes, (node + 1) * self.global_batch // nodes
        return range(lo // self.per_step, (hi - 1) // self.per_step + 1)

    def node_slices(self, node: int, nodes: int) -> range:
        """Slices whose slots the ranks of `node` (of `nodes`) take: what the node reads."""
        lo, hi = node * self.global_batch // nodes, (node + 1) * self.global_batch // nodes
        return range(lo // self.slice_step, (hi - 1) // self.slice_step + 1)


def micro_batch_positions(j: int, rank: int, world_size: int, micro: int, accum: int) -> range:
    """Global positions of this rank's j-th micro batch (step j // accum, micro batch j % accum)."""
    step, a = divmod(j, accum)
    start = step * micro * accum * world_size + rank * micro * accum + a * micro
    return range(start, start + micro)
