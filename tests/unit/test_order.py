"""The partitioned global order (pipeline/data/order.py), no data read: which sample each step holds."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.data.order import GlobalOrder, choose_partitions, deal_shards, imbalance, micro_batch_positions

# 24 shards of uneven sizes (20..43 samples): partitions differ by a few samples.
COUNTS = [20 + (7 * s) % 24 for s in range(24)]


def step_ids(order: GlobalOrder, nodes: int, gpus: int, accum: int, steps: int) -> list[dict[int, set[int]]]:
    """Per step: node -> the sample ids its ranks take (ranks numbered node by node)."""
    world = nodes * gpus
    micro = order.global_batch // (world * accum)
    out: list[dict[int, set[int]]] = [{n: set() for n in range(nodes)} for _ in range(steps)]
    for rank in range(world):
        for j in range(steps * accum):
            ids = order.sample_ids(micro_batch_positions(j, rank, world, micro, accum))
            out[j // accum][rank // gpus] |= set(ids.tolist())
    return out


def test_step_samples_are_identical_on_every_layout_and_local_when_nodes_divide_partitions() -> None:
    G, steps = 48, 20  # 756 samples, partitions of ~94: steps 15-16 cross into every partition's second pass
    order = GlobalOrder(COUNTS, seed=3, global_batch=G, partitions=8, span=60)
    assert order.partitions == 8 and order.per_step == 6
    reference = [set().union(*s.values()) for s in step_ids(order, 1, 1, 1, steps)]
    assert all(len(s) == G for s in reference[:15])
    shard_partition = order.partition_of_shard
    layouts = [(n, g, a) for n in (1, 2, 3, 4, 6, 8, 12) for g in (1, 2) for a in (1, 2)
               if G % (n * g * a) == 0]
    assert len(layouts) == 27
    for nodes, gpus, accum in layouts:
        # A fresh order per layout: its caches start empty, as in another job.
        layout = GlobalOrder(COUNTS, seed=3, global_batch=G, partitions=8, span=60)
        got = step_ids(layout, nodes, gpus, accum, steps)
        assert [set().union(*s.values()) for s in got] == reference, (nodes, gpus, accum)
        for n in range(nodes):
            read = {int(shard_partition[s]) for t in got for s in order.shard_of(np.fromiter(t[n], int))}
            assert read <= set(layout.node_partitions(n, nodes)), (nodes, n)
            if 8 % nodes == 0:  # nodes divide partitions: exactly this node's partitions
                assert read == set(range(n * 8 // nodes, (n + 1) * 8 // nodes)), (nodes, n)


def test_nodes_not_dividing_partitions_share_only_the_partitions_on_their_borders() -> None:
    order = GlobalOrder(COUNTS, seed=0, global_batch=48, partitions=8)
    # 3 nodes: slots [0, 16), [16, 32), [32, 48) over partitions of 6 slots: 2 and 5 are cut in two.
    assert [list(order.node_partitions(n, 3)) for n in range(3)] == [[0, 1, 2], [2, 3, 4, 5], [5, 6, 7]]
    assert [list(order.node_partitions(n, 4)) for n in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_every_sample_once_per_epoch_and_each_partition_once_per_pass() -> None:
    counts = [25] * 32  # equal partitions: global epochs of 800 samples = 20 steps of 40
    order = GlobalOrder(counts, seed=1, global_batch=40, partitions=8, span=50)
    for e in range(3):
        ids = order.sample_ids(np.arange(e * 800, (e + 1) * 800))
        assert sorted(ids.tolist()) == list(range(800)), e
    assert not np.array_equal(order.sample_ids(np.arange(800)), order.sample_ids(np.arange(800, 1600)))
    # Uneven partitions: each one's draws visit its own samples once per pass.
    uneven = GlobalOrder(COUNTS, seed=1, global_batch=48, partitions=8, span=60)
    starts = np.concatenate([[0], np.cumsum(COUNTS)])
    for p in range(8):
        mine = sorted(i for s in uneven.shards[p] for i in range(starts[s], starts[s + 1]))
        for e in range(2):
            d = np.arange(e * uneven.sizes[p], (e + 1) * uneven.sizes[p])
            assert sorted(uneven.draw_ids(np.full_like(d, p), d).tolist()) == mine, (p, e)


def test_span_bounds_the_shards_a_partition_needs_at_once() -> None:
    counts = [100] * 64
    order = GlobalOrder(counts, seed=2, global_batch=64, partitions=2, span=400)
    assert order.span_shards(0) == 6  # 400 / 100 + the shard being read and the next
    for p in range(2):
        shards = order.shard_of(order.pass_order(p, 0))
        # any 100 consecutive draws (what a step ahead of a reader takes from it) touch few shards
        widest = max(len(set(shards[i:i + 100].tolist())) for i in range(0, len(shards) - 100, 50))
        assert widest <= order.span_shards(p), widest
    whole = GlobalOrder(counts, seed=2, global_batch=64, partitions=2, span=10**6)
    assert whole.span_shards(0) == 32  # the span covers the partition: all of it


def test_defaults_put_256_distinct_shards_in_a_global_batch_of_4096() -> None:
    order = GlobalOrder([1000] * 10_000, seed=0, global_batch=4096)
    assert order.partitions == 128 and order.span == 1 << 18
    for t in (0, 1, 150):
        distinct = len(np.unique(order.shard_of(order.sample_ids(np.arange(t * 4096, (t + 1) * 4096)))))
        assert distinct >= 256, (t, distinct)


def test_automatic_partition_count_keeps_partitions_balanced() -> None:
    assert choose_partitions([1000] * 10_000, 4096, None) == 128  # 256: 40 or 39 shards, 2.6% apart
    assert choose_partitions([1000] * 200, 4096, None) == 8  # 200 / 16 = 12.5 shards: 8% apart
    imagenet = [1000] * 1281 + [167]
    assert choose_partitions(imagenet, 4096, None) == 16
    assert imbalance(imagenet, deal_shards(imagenet, 16)) <= 0.02
    assert choose_partitions([1000] * 10_000, 24, None) == 8  # must divide the global batch
    assert choose_partitions([5, 0, 7], 64, None) == 1
    assert choose_partitions([10] * 6, 24, 3) == 3
    with pytest.raises(ValueError, match="data.partitions=5 must divide train.global_batch_size=24"):
        choose_partitions([10] * 6, 24, 5)
    with pytest.raises(ValueError, match="data.partitions=4 is more than the 3 non-empty shards"):
        choose_partitions([10, 0, 10, 10], 24, 4)


def test_partitions_are_whole_shards_fixed_for_the_run() -> None:
    order = GlobalOrder(COUNTS, seed=0, global_batch=48, partitions=8, span=60)
    assert sorted(np.concatenate(order.shards).tolist()) == list(range(24))
    assert max(order.sizes) - min(order.sizes) <= max(COUNTS)
    for p in range(8):  # every pass of a partition draws from its own shards only
        for e in range(3):
            assert set(order.shard_of(order.pass_order(p, e)).tolist()) == set(order.shards[p].tolist())


def test_scale_projection_fetches_each_shard_once_when_nodes_divide_partitions() -> None:
    from benchmarks.scale import ScaleRow, project

    order, rows = project(64, 50, 64, [1, 2, 3, 4, 8, 16], gpus_per_node=2, workers=2, partitions=8)
    by_nodes = {r.nodes: r for r in rows if isinstance(r, ScaleRow)}
    assert order.partitions == 8 and sorted(by_nodes) == [1, 2, 4, 8, 16]  # 3 x 2 ranks do not make 64
    for n in (1, 2, 4, 8):
        assert by_nodes[n].fetched == 1.0 and by_nodes[n].shared_partitions == 0, n
    assert by_nodes[16].fetched == 2.0 and by_nodes[16].shared_partitions == 8  # two nodes per partition
    assert all(0 < r.index_reads < 0.02 for r in by_nodes.values())
    _, rows = project(48, 50, 48, [3], gpus_per_node=1, workers=1, partitions=8)
    assert rows[0].shared_partitions == 2 and 1.0 < rows[0].fetched <= 1.0 + 2 / 8  # partitions 2 and 5 (see above)


def nodes_per_shard_fetch(order: GlobalOrder, nodes: int) -> float:
    """Shards fetched per epoch / shards, from the slices each node reads (each slice's pass reads all of it)."""
    fetched = sum(len(set().union(*(order.slice_shards[q].tolist() for q in order.node_slices(n, nodes))))
                  for n in range(nodes))
    return fetched / int(np.count_nonzero(order.counts))


def test_slices_fetch_each_shard_about_once_up_to_512_nodes() -> None:
    big = GlobalOrder([1000] * 10_000, seed=0, global_batch=4096)
    assert big.partitions == 128 and big.slices_per_partition == 4 and big.slices == 512
    assert big.slice_sizes.max() - big.slice_sizes.min() <= 250  # 78000 / 4 or 79000 / 4
    by_nodes = {n: nodes_per_shard_fetch(big, n) for n in (2**i for i in range(10))}
    assert all(by_nodes[n] == 1.0 for n in (1, 2, 4, 8, 16, 32, 64, 128)), by_nodes
    assert 1.0 < by_nodes[256] < by_nodes[512] <= 1.05, by_nodes  # the cuts inside shards, nothing else
    small = GlobalOrder([1000] * 1000, seed=0, global_batch=4096)
    assert small.partitions == 16 and small.slices == 64 and nodes_per_shard_fetch(small, 64) <= 1.05
    assert nodes_per_shard_fetch(small, 128) > 1.9  # beyond the slices: two nodes per slice
    # data.partitions set by hand: one slice per partition, as asked
    assert GlobalOrder([1000] * 10_000, seed=0, global_batch=4096, partitions=128).slices == 128


def test_slices_keep_the_order_layout_free_and_every_sample_once_per_epoch() -> None:
    counts = [40] * 200  # 8 partitions of 25 shards, 2 slices each: a cut inside every partition's 13th shard
    G, steps = 32, 12
    order = GlobalOrder(counts, seed=5, global_batch=G, span=60)
    assert order.partitions == 8 and order.slices_per_partition == 2 and order.slice_step == 2
    split = [s for s in range(200) if sum(s in sh for sh in order.slice_shards) > 1]
    assert len(split) == 8 and all(order.slice_sizes == 500)
    ids = order.sample_ids(np.arange(8000))  # one epoch: 250 steps
    assert sorted(ids.tolist()) == list(range(8000))
    reference = [set().union(*s.values()) for s in step_ids(order, 1, 1, 1, steps)]
    layouts = [(n, g, a) for n in (1, 2, 4, 8, 16) for g in (1, 2) for a in (1, 2) if G % (n * g * a) == 0]
    for nodes, gpus, accum in layouts:
        layout = GlobalOrder(counts, seed=5, global_batch=G, span=60)
        got = step_ids(layout, nodes, gpus, accum, steps)
        assert [set().union(*s.values()) for s in got] == reference, (nodes, gpus, accum)
        for n in range(nodes):
            mine = set().union(*(layout.slice_shards[q].tolist() for q in layout.node_slices(n, nodes)))
            read = {int(s) for t in got for s in layout.shard_of(np.fromiter(t[n], int))}
            assert read <= mine, (nodes, n)
