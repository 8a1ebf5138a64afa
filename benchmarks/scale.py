"""What a layout reads and fetches per epoch, from the real order and partitions with no data:
`python launch/bench.py scale --nodes 512` (`bench_scale` at the end of this file).

For a data set of `shards` x `samples_per_shard` samples of `sample_bytes` each, one epoch's
positions go through `GlobalOrder.sample_ids` and `micro_batch_positions`' arithmetic (rank r of
W takes the slots [r G / W, (r + 1) G / W); its micro batch j goes to DataLoader worker j mod K):

- fetched / data set: distinct (node, shard) pairs x shard bytes / data set bytes - what remote
  shards cost when each node's cache holds its shuffle spans (`loader.check_cache` ensures it);
- index reads / data set: an index header (`index.encode_index`, real size) per distinct
  (process, shard) pair plus one record per sample read, over the sample bytes read;
- distinct shards per global batch: the mean over the epoch's first steps.

With `--mix NAME=WEIGHT:SHARDS,...` (data.sources: `project_mix`), a mixture's order (mix_order.py) over one
epoch of each source: for every source, the distinct (node, shard) pairs of its shards over the steps of its
own first epoch (its samples / (weight x global batch)), per its shard count: 1.0 when every node fetches
only its own slices' shards.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.data.index import SampleMembers, encode_index
from pipeline.data.mix_order import MixPeriod, MixtureOrder, choose_blocks
from pipeline.data.order import GlobalOrder


@dataclass
class ScaleRow:
    nodes: int
    fetched: float
    """Shard bytes fetched per epoch / data set bytes (1.0: every shard by one node)."""
    shared_partitions: int
    """Partition slices (the partitions when each is one slice) read by more than one node."""
    index_reads: float
    """Index bytes read per epoch / sample bytes read."""
    distinct_shards: float
    """Mean distinct shards in a global batch."""

    def line(self) -> str:
        return (f"nodes {self.nodes}: fetched/data set {self.fetched:.3f}, index reads/data set "
                f"{self.index_reads:.5f}, distinct shards per global batch {self.distinct_shards:.0f}"
                + (f" ({self.shared_partitions} partition slices read by more than one node)"
                   if self.shared_partitions else ""))


def index_sizes(exts: tuple[str, ...] = ("cls", "jpg")) -> tuple[int, int]:
    """(header bytes, record bytes per sample) of a shard's index, as index.py writes it."""
    one = encode_index([SampleMembers("0", {e: (0, 1) for e in exts})], 1 << 40)
    record = 8 * (1 + 2 * len(exts))
    return len(one) - record, record


def project(shards: int, samples_per_shard: int, global_batch: int, node_counts: list[int], gpus_per_node: int,
            workers: int, sample_bytes: int = 110_000, partitions: int | None = None, span: int | None = None,
            seed: int = 0, batches_for_mixing: int = 8) -> tuple[GlobalOrder, list[ScaleRow | str]]:
    kwargs = {} if span is None else {"span": span}
    order = GlobalOrder([samples_per_shard] * shards, seed, global_batch, partitions, **kwargs)
    steps = order.n // global_batch  # whole steps within the first epoch
    positions = np.arange(steps * global_batch, dtype=np.int64)
    shard = order.shard_of(order.sample_ids(positions))  # the real order: one pass over the epoch
    slot = positions % global_batch
    step = positions // global_batch
    distinct = float(np.mean([len(np.unique(shard[t * global_batch:(t + 1) * global_batch]))
                              for t in range(min(steps, batches_for_mixing))]))
    header, record = index_sizes()
    data_bytes = shards * samples_per_shard * sample_bytes
    rows: list[ScaleRow | str] = []
    for nodes in node_counts:
        world = nodes * gpus_per_node
        if global_batch % world:
            rows.append(f"nodes {nodes}: skipped, global batch {global_batch} is not a multiple of "
                        f"{world} ranks")
            continue
        node = slot // (global_batch // nodes)
        fetched_pairs = len(np.unique(node * shards + shard))
        rank = slot // (global_batch // world)
        # one micro batch per step per rank at the largest micro batch, which fewest workers share: j = step
        process = rank * workers + step % workers
        index_pairs = len(np.unique(process * shards + shard))
        read = len(positions)
        readers = np.zeros(order.slices, dtype=np.int64)  # nodes reading each slice
        for n in range(nodes):
            readers[list(order.node_slices(n, nodes))] += 1
        shared = int(np.count_nonzero(readers > 1))
        rows.append(ScaleRow(nodes, fetched_pairs * samples_per_shard * sample_bytes / data_bytes,
                             shared, (index_pairs * header + read * record) / (read * sample_bytes), distinct))
    return order, rows


def parse_mix(text: str) -> list[tuple[str, float, int]]:
    """'web=0.5:6000,books=0.3:3000' -> [(name, weight, shards)]."""
    out = []
    for item in text.split(","):
        name, _, rest = item.partition("=")
        weight, _, shards = rest.partition(":")
        try:
            out.append((name.strip(), float(weight), int(shards)))
        except ValueError:
            raise SystemExit(f"--mix: '{item}' is not NAME=WEIGHT:SHARDS") from None
    return out


def mix_order(mix: list[tuple[str, float, int]], samples_per_shard: int, global_batch: int, seed: int = 0
              ) -> MixtureOrder:
    """A fresh mixture of sources of `shards` x `samples_per_shard` samples, at their normalised weights."""
    total = sum(w for _, w, _ in mix)
    weights = [w / total for _, w, _ in mix]
    counts = [np.full(shards, samples_per_shard, dtype=np.int64) for _, _, shards in mix]
    blocks, cuts = choose_blocks(global_batch, weights, counts, [None] * len(mix))
    period = MixPeriod(0, tuple((name, w) for (name, _, _), w in zip(mix, weights)), blocks)
    return MixtureOrder([(name, c.tolist()) for (name, _, _), c in zip(mix, counts)], seed, global_batch,
                        1 << 18, [period], {name: cut for (name, _, _), cut in zip(mix, cuts)})


def project_mix(order: MixtureOrder, node_counts: list[int], gpus_per_node: int, chunk: int = 32
                ) -> dict[int, list[float] | str]:
    """Per node count: each source's shards fetched over its first epoch / its shards (see the docstring)."""
    G, sources = order.global_batch, len(order.names)
    shards_of = [int(order.shard_offset[i + 1] - order.shard_offset[i]) for i in range(sources)]
    epoch_steps = [int(np.ceil(order.n_of(i) / (G * order.weights[i]))) for i in range(sources)]
    usable = [n for n in node_counts if G % (n * gpus_per_node) == 0]
    seen = {n: np.zeros(n * len(order.counts), dtype=bool) for n in usable}  # (node, shard) pairs fetched
    slot = np.arange(G, dtype=np.int64)
    for t0 in range(0, max(epoch_steps), chunk):
        steps = np.arange(t0, min(t0 + chunk, max(epoch_steps)), dtype=np.int64)
        positions = (steps[:, None] * G + slot[None, :]).ravel()
        shard = order.shard_of(order.sample_ids(positions))
        source = order.source_of_shard[shard]
        keep = steps.repeat(G) < np.asarray(epoch_steps)[source]  # each source over its own first epoch
        for n in usable:
            node = (positions % G) // (G // n)
            seen[n][(node * len(order.counts) + shard)[keep]] = True
    out: dict[int, list[float] | str] = {}
    for n in node_counts:
        if n not in usable:
            out[n] = f"skipped, global batch {G} is not a multiple of {n * gpus_per_node} ranks"
            continue
        pairs = seen[n].reshape(n, len(order.counts)).sum(axis=0)  # nodes that fetched each shard
        out[n] = [float(pairs[order.shard_offset[i]:order.shard_offset[i + 1]].sum()) / shards_of[i]
                  for i in range(sources)]
    return out


def bench_scale_mix(args: argparse.Namespace, node_counts: list[int]) -> dict[str, Any]:
    t0 = time.perf_counter()
    mix = parse_mix(args.mix)
    order = mix_order(mix, args.samples_per_shard, args.global_batch)
    print(f"mixture of {len(mix)} sources, shards of {args.samples_per_shard} samples, global batch "
          f"{args.global_batch}, {args.gpus_per_node} GPUs per node: {order.blocks} blocks")
    for i, (name, _, shards) in enumerate(mix):
        cut = order.slicing[i]
        print(f"  {name}: weight {order.weights[i]:.4g}, {shards} shards, {cut.partitions} partitions x "
              f"{cut.slices_per_partition} slices")
    rows = project_mix(order, node_counts, args.gpus_per_node)
    figures: dict[str, Any] = {"mix": args.mix, "samples_per_shard": args.samples_per_shard,
                               "global_batch": args.global_batch, "gpus_per_node": args.gpus_per_node,
                               "blocks": order.blocks, "bench": "scale-mix"}
    for i, (name, _, shards) in enumerate(mix):
        figures[name] = {"weight": round(float(order.weights[i]), 4), "shards": shards,
                         "slices": order.slicing[i].slices}
    for n, row in rows.items():
        if isinstance(row, str):
            print(f"nodes {n}: {row}")
            continue
        print(f"nodes {n}: fetched/data set " + ", ".join(f"{name} {r:.3f}" for (name, _, _), r in zip(mix, row)))
        for (name, _, _), r in zip(mix, row):
            figures[name][f"nodes{n}_fetched_per_dataset"] = round(r, 4)
    figures["seconds"] = round(time.perf_counter() - t0, 1)
    return figures


def bench_scale(args: argparse.Namespace) -> dict[str, Any]:
    """What 1, 2, 4, ... N nodes fetch and read per epoch: the real order and partitions, no data."""
    counts = [2**i for i in range(args.nodes.bit_length()) if 2**i <= args.nodes]
    if getattr(args, "mix", None):
        return bench_scale_mix(args, counts)
    t0 = time.perf_counter()
    order, rows = project(args.shards, args.samples_per_shard, args.global_batch, counts, args.gpus_per_node,
                          getattr(args, "scale_workers", 8), args.sample_bytes, args.partitions)
    print(f"{args.shards} shards x {args.samples_per_shard} samples of {args.sample_bytes} bytes, global batch "
          f"{args.global_batch}, {args.gpus_per_node} GPUs and {getattr(args, 'scale_workers', 8)} loader workers "
          f"per node: {order.partitions} partitions (sizes {order.sizes.min()}-{order.sizes.max()}) of "
          f"{order.slices_per_partition} slices each, shuffle span {order.span}")
    for row in rows:
        print(row.line() if isinstance(row, ScaleRow) else row)
    figures: dict[str, Any] = {"shards": args.shards, "samples_per_shard": args.samples_per_shard,
                               "sample_bytes": args.sample_bytes, "global_batch": args.global_batch,
                               "gpus_per_node": args.gpus_per_node, "workers": getattr(args, "scale_workers", 8),
                               "partitions": order.partitions, "slices": order.slices, "shuffle_span": order.span}
    for row in rows:
        if isinstance(row, ScaleRow):
            figures[f"nodes{row.nodes}"] = {"fetched_per_dataset": round(row.fetched, 4),
                                            "index_reads_per_dataset": round(row.index_reads, 6),
                                            "distinct_shards_per_batch": round(row.distinct_shards, 1),
                                            "partitions_shared": row.shared_partitions}
    figures["seconds"] = round(time.perf_counter() - t0, 1)
    return figures


def add_scale_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=512, help="largest node count: 1, 2, 4, ... up to it (default 512)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node (default 8)")
    if "--workers" not in p._option_string_actions:  # `all`: the loader benchmark's flag; scale keeps 8
        p.add_argument("--workers", dest="scale_workers", type=int, default=8,
                       help="DataLoader workers per rank (default 8)")
    p.add_argument("--shards", type=int, default=10_000, help="shards in the data set (default 10000)")
    p.add_argument("--samples-per-shard", type=int, default=1000, help="samples per shard (default 1000)")
    p.add_argument("--global-batch", type=int, default=4096, help="train.global_batch_size (default 4096)")
    p.add_argument("--sample-bytes", type=int, default=110_000,
                   help="mean sample size in bytes (default 110000, ImageNet's mean JPEG)")
    p.add_argument("--partitions", type=int, default=None, help="data.partitions (default: automatic)")
    p.add_argument("--mix", default=None, metavar="NAME=WEIGHT:SHARDS,...",
                   help="a mixture (data.sources) instead: each source's weight and shard count (shards of "
                        "--samples-per-shard); its row is filed as scale-mix")
