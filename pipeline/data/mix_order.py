"""The global order of a mixture (`data.sources`): several data sets in every global batch, each at its weight,
the same samples at every step on any layout.

Slices. Each source is cut as one data set is (order.py): partitions of whole shards (balanced within
MAX_IMBALANCE), each cut into slices of equal sample count. A source's cut (`Slicing`) is chosen once, at the
first step it is in the mix, and kept for the run: a later change of its weight leaves it alone. The
mixture's slices are its sources' slices, source after source; sample ids number all sources' shards one
after another.

Blocks. The global batch of G slots is cut into U blocks of g = G / U slots (U a power of two dividing G and
every source's slice count). Block b holds slices [b S_i / U, (b + 1) S_i / U) of every source i (S_i slices).
With N nodes dividing U, node n takes blocks [n U / N, (n + 1) U / N): it reads only its own slices of every
source, each source's shards fetched once per epoch as a single data set's are.

Shares: exact in every global batch, to one sample. Let w_i be the normalised weights and tau the steps since
the mix began. Every source but the one of largest weight (i*) has taken

    A_i(b, tau) = floor(tau g w_i + b / U)

slots of block b in the first tau steps; i* takes the rest of each block, tau g - sum A. Summed over the
blocks (Hermite's identity: sum_b floor(x + b / U) = floor(U x)) source i has had floor(tau G w_i) samples:
every global batch holds floor(G w_i) or ceil(G w_i) of source i, and any T consecutive steps within one
sample of T G w_i (i*: within n - 1, n sources). i*'s share of a block and step is never negative when
g w_i* >= n - 1, which the block count keeps (`choose_blocks`).

Within a block, source i's m_i = S_i / U slices take its slots in turn: slice j of the block has been drawn
floor((A_i(b, tau) + j) / m_i) times. A step's slots are laid out block by block, source by source, slice by
slice. A slice's draws walk through its passes as in order.py (a seeded permutation per pass, spread over the
shuffle span), seeded by (seed, the source's name, slice, pass): the samples and augmentation of step t are
functions of (seed, the mix and its history, G, t), never of the layout.

Mix changes (`MixPeriod`): another weight, a source added or removed starts a new period at step t_k. The
slices stay (an added source gets its own), the shares start again from tau = 0 with the new weights, and
every slice continues from the draws it had made: its pass and its place in it, so nothing a source saw in
its current pass comes back before that pass ends. A source that leaves keeps its draws, and continues from
them if it comes back.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .order import (
    DEFAULT_PARTITIONS,
    SlicedOrder,
    cached,
    choose_partitions,
    choose_slices,
    deal_shards,
    slice_partition,
)

MIX_PASS = 8  # SeedSequence namespace of a mixture slice's passes (order.py's are 2-7)
MIN_SLICE_SAMPLES = 2  # a source is cut into no more slices than it has samples / this


def source_key(name: str) -> int:
    """A stable 63-bit number for a source's name: its passes' seeds (the list's order may change)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") >> 1


@dataclass(frozen=True)
class Slicing:
    """How one source is cut, fixed from its first step in the mix: partitions x slices per partition."""

    partitions: int
    slices_per_partition: int

    @property
    def slices(self) -> int:
        return self.partitions * self.slices_per_partition


@dataclass(frozen=True)
class MixPeriod:
    """One mix from `step` on: the sources in order with their normalised weights, and the block count."""

    step: int
    weights: tuple[tuple[str, float], ...]
    blocks: int

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.weights]


def natural_slicing(counts: list[int] | np.ndarray) -> Slicing:
    """A source's cut as a data set of its own would have it with a global batch of DEFAULT_PARTITIONS (every
    power of two up to it divides): partitions balanced, shards split by slices within MAX_SPLIT_FETCH."""
    p = choose_partitions(counts, DEFAULT_PARTITIONS, None)
    return Slicing(p, choose_slices(counts, DEFAULT_PARTITIONS, p))


def choose_blocks(global_batch: int, weights: list[float], sources: list[np.ndarray], fixed: list[Slicing | None]
                  ) -> tuple[int, list[Slicing]]:
    """The block count U of a mix and every source's cut. U: the largest power of two <= DEFAULT_PARTITIONS
    dividing the global batch, with g w_max >= n - 1 (g = G / U: the largest source's share of a block is
    never negative), at most a source's fixed slice count (`fixed`: the sources already cut), and leaving
    every new source slices of MIN_SLICE_SAMPLES or more when cut into max(natural, U) slices."""
    n, w_max = len(weights), max(weights)
    natural = [f or natural_slicing(c) for c, f in zip(sources, fixed)]
    smallest = [min(int(counts[s].sum()) for s in deal_shards(counts, cut.partitions))
                for counts, cut in zip(sources, natural)]  # each source's smallest partition
    u = DEFAULT_PARTITIONS
    while u > 1:
        ok = global_batch % u == 0 and (global_batch // u) * w_max >= n - 1 - 1e-9
        ok = ok and all(f is None or f.slices % u == 0 for f in fixed)
        if ok:
            cut = [f or _grown(c, u) for c, f in zip(natural, fixed)]
            if all(size // c.slices_per_partition >= MIN_SLICE_SAMPLES for size, c in zip(smallest, cut)):
                return u, cut
        u //= 2
    if global_batch * w_max < n - 1 - 1e-9:
        raise ValueError(f"train.global_batch_size={global_batch} is too small for {n} sources at these weights "
                         f"(the largest weight's share, {global_batch * w_max:g} samples, must be at least {n - 1})")
    return 1, natural


def _grown(s: Slicing, blocks: int) -> Slicing:
    """`s` with at least `blocks` slices (more slices per partition; both are powers of two)."""
    return s if s.slices >= blocks else Slicing(s.partitions, blocks // s.partitions)


def block_shares(weights: np.ndarray, blocks: int, g: int, tau: int) -> np.ndarray:
    """[U, n]: slots of each block each source has had in the first `tau` steps of a period."""
    b = np.arange(blocks, dtype=np.float64)[:, None]
    taken = np.floor(float(tau * g) * weights[None, :] + b / blocks).astype(np.int64)
    big = int(np.argmax(weights))  # the first of the largest: takes what the others leave
    taken[:, big] = tau * g - (taken.sum(axis=1) - taken[:, big])
    return taken


def fill(bases: np.ndarray, taken: np.ndarray) -> np.ndarray:
    """[U, m]: the draws each of a block's m slices of one source gets out of the `taken` [U] slots of its
    block, lowest total first (water-filling from `bases`, the slices' draws when the period began; ties: the
    lower slice). From equal bases: in turn. A function of (bases, taken), monotone in taken."""
    u, m = bases.shape
    perm = np.argsort(bases, axis=1, kind="stable")
    low = np.take_along_axis(bases, perm, axis=1)  # each block's bases, lowest first
    prefix = np.concatenate([np.zeros((u, 1), np.int64), np.cumsum(low, axis=1)], axis=1)
    k = np.arange(m, dtype=np.int64)[None, :]
    # slices that take part: the lowest k, where raising the k lowest to the next one's level costs <= taken
    cost = k[:, 1:] * low[:, 1:] - prefix[:, 1:m] if m > 1 else np.zeros((u, 0), np.int64)
    part = 1 + (cost <= taken[:, None]).sum(axis=1)
    total = taken + np.take_along_axis(prefix, part[:, None], axis=1)[:, 0]
    level, extra = np.divmod(total, part)
    after = np.where(k < part[:, None], level[:, None] + (k < extra[:, None]), low)
    out = np.empty_like(bases)
    np.put_along_axis(out, perm, after - low, axis=1)
    return out


class MixtureOrder(SlicedOrder):
    """position -> global sample id for a mixture: `sources` the active sources' (name, shard counts) in the
    current period's order; `periods` the mix's history, the last one current; `slicing` every source's cut."""

    def __init__(self, sources: list[tuple[str, list[int]]], seed: int, global_batch: int, span: int,
                 periods: list[MixPeriod], slicing: dict[str, Slicing]):
        self.period = periods[-1]
        if [name for name, _ in sources] != self.period.names:
            raise ValueError(f"sources {[n for n, _ in sources]} are not the mix's {self.period.names}")
        self.names = self.period.names
        self.seed, self.global_batch, self.span = seed, int(global_batch), max(1, int(span))
        self.weights = np.asarray([w for _, w in self.period.weights], dtype=np.float64)
        self.blocks = self.period.blocks
        self.block_slots = self.global_batch // self.blocks  # g
        per_source = [np.asarray(c, dtype=np.int64) for _, c in sources]
        self.counts = np.concatenate(per_source)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)])
        self.n = int(self.starts[-1])
        self.slicing = [slicing[name] for name in self.names]
        self.shard_offset = np.concatenate([[0], np.cumsum([len(c) for c in per_source])]).astype(np.int64)
        self.slice_offset = np.concatenate([[0], np.cumsum([s.slices for s in self.slicing])]).astype(np.int64)
        self.source_of_shard = np.repeat(np.arange(len(sources)), [len(c) for c in per_source])
        self.source_of_slice = np.repeat(np.arange(len(sources)), [s.slices for s in self.slicing])
        self.per_block = [s.slices // self.blocks for s in self.slicing]  # m_i
        self.partition_of_slice: list[int] = []
        self.segments = []
        for i, (counts, cut) in enumerate(zip(per_source, self.slicing)):
            if counts.sum() == 0:
                raise ValueError(f"source '{self.names[i]}' holds no samples")
            for p, shards in enumerate(deal_shards(counts, cut.partitions)):
                for seg in slice_partition(counts, shards, cut.slices_per_partition):
                    self.segments.append(seg + np.asarray([self.shard_offset[i], 0, 0], dtype=np.int64))
                    self.partition_of_slice.append(p)
        self._init_passes()
        self.base = self._draws_before(periods)  # each slice's draws when this period began
        self._layouts: OrderedDict[int, tuple[np.ndarray, ...]] = OrderedDict()

    def n_of(self, i: int) -> int:
        """Samples of source i."""
        return int(self.starts[self.shard_offset[i + 1]] - self.starts[self.shard_offset[i]])

    def pass_seed(self, q: int, e: int) -> tuple[int, ...]:
        i = int(self.source_of_slice[q])
        return (MIX_PASS, self.seed, source_key(self.names[i]), q - int(self.slice_offset[i]), e)

    # ------------------------------------------------------------------------- draws per slice

    def period_draws(self, period: MixPeriod, tau: int, bases: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Draws of the slices of each source in `bases` (their draws when `period` began, in slice order) in
        the first `tau` steps of `period`."""
        weights = np.asarray([w for _, w in period.weights], dtype=np.float64)
        taken = block_shares(weights, period.blocks, self.global_batch // period.blocks, tau)
        return {name: fill(bases[name].reshape(period.blocks, -1), taken[:, i]).ravel()
                for i, name in enumerate(period.names) if name in bases}

    def _draws_before(self, periods: list[MixPeriod]) -> np.ndarray:
        bases = {name: np.zeros(self.slicing[i].slices, dtype=np.int64) for i, name in enumerate(self.names)}
        for period, nxt in zip(periods, periods[1:]):
            for name, d in self.period_draws(period, nxt.step - period.step, bases).items():
                bases[name] = bases[name] + d
        return np.concatenate([bases[name] for name in self.names])

    def slice_draws_at(self, step: int) -> np.ndarray:
        """Draws every slice has made before `step` (>= this period's first step), history included."""
        tau = step - self.period.step
        if tau < 0:
            raise ValueError(f"step {step} is before this mix began (step {self.period.step})")
        bases = {name: self.base[self.slice_offset[i]:self.slice_offset[i + 1]] for i, name in enumerate(self.names)}
        done = self.period_draws(self.period, tau, bases)
        return self.base + np.concatenate([done[name] for name in self.names])

    def source_figures(self, step: int) -> dict[str, tuple[int, int]]:
        """Per source: (samples drawn, passes every one of its slices has completed) before `step`."""
        draws = self.slice_draws_at(step)
        out = {}
        for i, name in enumerate(self.names):
            lo, hi = self.slice_offset[i], self.slice_offset[i + 1]
            out[name] = (int(draws[lo:hi].sum()), int((draws[lo:hi] // self.slice_sizes[lo:hi]).min()))
        return out

    # ------------------------------------------------------------------------- positions

    def _layout(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Step `step`'s slot runs, block by block, source by source, slice by slice: (slice of each run,
        its first draw, the slot after it)."""
        def make() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            tau = step - self.period.step
            if tau < 0:
                raise ValueError(f"step {step} is before this mix began (step {self.period.step})")
            before = block_shares(self.weights, self.blocks, self.block_slots, tau)
            after = block_shares(self.weights, self.blocks, self.block_slots, tau + 1)
            slices, first, count = [], [], []
            for i, m in enumerate(self.per_block):
                q = self.slice_offset[i] + np.arange(self.blocks * m, dtype=np.int64).reshape(self.blocks, m)
                d0, d1 = fill(self.base[q], before[:, i]), fill(self.base[q], after[:, i])
                slices.append(q)
                first.append(self.base[q] + d0)
                count.append(d1 - d0)
            q, d, c = (np.concatenate(x, axis=1).ravel() for x in (slices, first, count))
            return q, d, np.cumsum(c)
        return cached(self._layouts, step, 4, make)

    def draws(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        positions = np.asarray(positions, dtype=np.int64)
        step, slot = np.divmod(positions, self.global_batch)
        q = np.empty(positions.shape, dtype=np.int64)
        d = np.empty(positions.shape, dtype=np.int64)
        for t in np.unique(step).tolist():
            mask = step == t
            slices, first, ends = self._layout(t)
            run = np.searchsorted(ends, slot[mask], side="right")  # runs of no slots are never found
            q[mask] = slices[run]
            d[mask] = first[run] + slot[mask] - np.concatenate([[0], ends[:-1]])[run]
        return q, d

    def steps_per_pass(self) -> int:
        rate = self.global_batch * self.weights[self.source_of_slice] / np.asarray(
            [s.slices for s in self.slicing])[self.source_of_slice]  # draws per step of each slice
        return int(np.ceil((self.slice_sizes / rate).max())) + 1

    def node_slices(self, node: int, nodes: int) -> list[int]:
        """The slices of the blocks the node's slots touch (exactly its own when the node count divides U)."""
        lo, hi = node * self.global_batch // nodes, (node + 1) * self.global_batch // nodes
        blocks = range(lo // self.block_slots, (hi - 1) // self.block_slots + 1)
        return sorted(int(self.slice_offset[i]) + b * m + j for i, m in enumerate(self.per_block)
                      for b in blocks for j in range(m))

    def node_partitions(self, node: int, nodes: int) -> list[tuple[int, int]]:
        """(source, partition) pairs the node reads from."""
        return sorted({(int(self.source_of_slice[q]), self.partition_of_slice[q]) for q in self.node_slices(node, nodes)})
