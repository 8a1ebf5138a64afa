"""What 1, 2, 4, ... N nodes fetch and read per epoch, through the real order and partitions
(`pipeline.data.scale`) with no data: `python launch/bench.py scale --nodes 512`."""

from __future__ import annotations

import argparse
import time
from typing import Any


def bench_scale(args: argparse.Namespace) -> dict[str, Any]:
    """What 1, 2, 4, ... N nodes fetch and read per epoch: the real order and partitions, no data."""
    from pipeline.data.scale import ScaleRow, project

    counts = [2**i for i in range(args.nodes.bit_length()) if 2**i <= args.nodes]
    t0 = time.perf_counter()
    order, rows = project(args.shards, args.samples_per_shard, args.global_batch, counts, args.gpus_per_node,
                          getattr(args, "scale_workers", 8), args.sample_bytes, args.partitions)
    print(f"{args.shards} shards x {args.samples_per_shard} samples of {args.sample_bytes} bytes, global batch "
          f"{args.global_batch}, {args.gpus_per_node} GPUs and {getattr(args, 'scale_workers', 8)} loader workers "
          f"per node: {order.partitions} partitions (sizes {order.sizes.min()}-{order.sizes.max()}), shuffle span "
          f"{order.span}")
    for row in rows:
        print(row.line() if isinstance(row, ScaleRow) else row)
    figures: dict[str, Any] = {"shards": args.shards, "samples_per_shard": args.samples_per_shard,
                               "sample_bytes": args.sample_bytes, "global_batch": args.global_batch,
                               "gpus_per_node": args.gpus_per_node, "workers": getattr(args, "scale_workers", 8),
                               "partitions": order.partitions, "shuffle_span": order.span}
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
