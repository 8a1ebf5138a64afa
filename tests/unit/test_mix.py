"""Mixtures (data.sources): the order itself with no data read (pipeline/data/mix_order.py), then the loader
over real shards of two data sets (pipeline/data/mix.py): shares, layouts, resume, changes, labels."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import DataConfig
from pipeline.data import DataError, build_eval_loader, build_train_loader, read_data
from pipeline.data.mix_order import MixPeriod, MixtureOrder, Slicing, choose_blocks, fill
from pipeline.data.order import micro_batch_positions
from pipeline.data.shards import synthetic_source, write_dataset
from pipeline.source_config import SourceConfig

A = [40] * 24 + [17]  # 977 samples
B = [32] * 8  # 256
C = [25, 30, 20, 35, 10, 40]  # 160


def order_of(sources: dict[str, list[int]], weights: list[float], G: int, seed: int = 0, span: int = 50,
             periods: list[MixPeriod] | None = None, slicing: dict[str, Slicing] | None = None) -> MixtureOrder:
    """A fresh mixture (one period from step 0), or `periods` whose last one is `weights`' (with `slicing`)."""
    names = list(sources)
    if periods is None:
        blocks, cuts = choose_blocks(G, weights, [np.asarray(c) for c in sources.values()], [None] * len(names))
        periods, slicing = [MixPeriod(0, tuple(zip(names, weights)), blocks)], dict(zip(names, cuts))
    return MixtureOrder(list(sources.items()), seed, G, span, periods, slicing)


def source_of(order: MixtureOrder, ids: np.ndarray) -> np.ndarray:
    return order.source_of_shard[order.shard_of(ids)]


def test_every_batch_holds_each_source_at_its_weight_to_one_sample_and_1000_steps_to_one_sample() -> None:
    for sources, weights, G in (({"a": A, "b": B}, [0.7, 0.3], 16),
                                ({"a": A, "b": B, "c": C}, [0.5, 0.3, 0.2], 40),
                                ({"a": A, "b": B, "c": C}, [0.6, 0.35, 0.05], 64)):
        order = order_of(sources, weights, G)
        T = 1000
        src = source_of(order, order.sample_ids(np.arange(T * G))).reshape(T, G)
        for i, w in enumerate(weights):
            per_step = (src == i).sum(axis=1)
            # every global batch: floor or ceil of G w (the largest source: within n - 1 of it)
            slack = len(weights) - 1 if i == int(np.argmax(weights)) else 1
            assert per_step.min() >= np.floor(G * w) - slack + 1 and per_step.max() <= np.ceil(G * w) + slack - 1 \
                or i == int(np.argmax(weights)), (sources.keys(), i, np.unique(per_step))
            # every prefix of the run: within one sample (the largest source: n - 1) of T G w
            drift = np.abs(np.cumsum(per_step) - np.arange(1, T + 1) * G * w)
            assert drift.max() < slack + 1e-9, (i, drift.max())


def test_a_step_holds_the_same_samples_on_every_layout_and_a_node_reads_its_own_slices() -> None:
    order = order_of({"a": A, "b": B, "c": C}, [0.5, 0.3, 0.2], 48)
    assert order.blocks == 8  # g = 6: the largest source's share of a block, 3, is at least n - 1 = 2
    G, steps = 48, 25  # past the end of c's first pass (160 samples at 9.6 a step)
    reference = order.sample_ids(np.arange(steps * G)).reshape(steps, G)
    for nodes, gpus, accum in [(n, g, a) for n in (1, 2, 3, 4, 8) for g in (1, 2) for a in (1, 3)
                               if G % (n * g * a) == 0]:
        world, fresh = nodes * gpus, order_of({"a": A, "b": B, "c": C}, [0.5, 0.3, 0.2], 48)
        micro = G // (world * accum)
        got = [[] for _ in range(steps)]
        read = {n: set() for n in range(nodes)}
        for rank in range(world):
            for j in range(steps * accum):
                positions = micro_batch_positions(j, rank, world, micro, accum)
                q, _ = fresh.draws(np.asarray(positions))
                got[j // accum] += fresh.sample_ids(positions).tolist()
                read[rank // gpus] |= set(q.tolist())
        assert [sorted(s) for s in got] == [sorted(s) for s in reference.tolist()], (nodes, gpus, accum)
        for n in range(nodes):  # a node reads only the slices of its blocks: exactly those when nodes divide them
            assert read[n] <= set(fresh.node_slices(n, nodes)), (nodes, n)
            if 8 % nodes == 0:
                mine = set(fresh.node_slices(n, nodes))
                assert read[n] == mine and all(set(fresh.node_slices(m, nodes)).isdisjoint(mine)
                                               for m in range(nodes) if m != n), (nodes, n)


def test_each_source_sees_every_sample_once_per_pass() -> None:
    order = order_of({"a": A, "b": B}, [0.7, 0.3], 16)
    ids = order.sample_ids(np.arange(400 * 16))
    src = source_of(order, ids)
    b = ids[src == 1] - order.starts[order.shard_offset[1]]
    # b's 8 slices of 32 samples, drawn in turn: its first 256 draws are its 256 samples, and so on
    assert all(sorted(b[e * 256:(e + 1) * 256].tolist()) == list(range(256)) for e in range(len(b) // 256))
    for q in range(order.slices):  # each pass of a slice its own permutation
        n = int(order.slice_sizes[q])
        assert not np.array_equal(order.draw_ids(np.full(n, q), np.arange(n)),
                                  order.draw_ids(np.full(n, q), np.arange(n, 2 * n))), q
    seen, epochs = order.source_figures(400)["b"]
    assert seen == len(b) and epochs == len(b) // 256
    # a pass is completed when every slice of the source has finished it: at step 52 one of b's 8 slices of 32
    # has drawn its 32 and the others 31 (0.6 a step each, block b of 8 a b/8 ahead); at 54 all have
    assert order.source_figures(52)["b"] == (249, 0) and order.source_figures(54)["b"] == (259, 1)


def slice_of_ids(order: MixtureOrder) -> np.ndarray:
    """The slice of every global id, from the slices' (shard, first, end) pieces."""
    out = np.full(order.n, -1, dtype=np.int64)
    for q, seg in enumerate(order.segments):
        for shard, lo, hi in seg.tolist():
            out[order.starts[shard] + lo:order.starts[shard] + hi] = q
    return out


def assert_once_per_pass(order: MixtureOrder, ids: np.ndarray) -> None:
    """In time order, each slice's draws come in passes: every n_q of them are its n_q samples, once each."""
    slices = slice_of_ids(order)[ids]
    for q in range(order.slices):
        mine, n = ids[slices == q], int(order.slice_sizes[q])
        assert all(len(set(mine[e * n:(e + 1) * n].tolist())) == n for e in range(len(mine) // n)), q


def test_a_block_deals_a_source_s_slots_to_its_slices_lowest_total_first() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        bases = rng.integers(0, 4, (int(rng.integers(1, 4)), int(rng.integers(1, 6))))
        before = np.zeros_like(bases)
        for taken in range(25):
            got = fill(bases, np.full(len(bases), taken))
            assert (got.sum(axis=1) == taken).all() and (got >= before).all()  # all dealt, never taken back
            total = bases + got
            for row in range(len(bases)):  # a slice that was given draws is at most one above every other
                assert (got[row] == 0).all() or total[row][got[row] > 0].max() <= total[row].min() + 1
            before = got


def test_a_changed_weight_continues_every_slice_where_it_was() -> None:
    before = order_of({"a": A, "b": B}, [0.7, 0.3], 16)
    t0 = 37
    periods = [MixPeriod(0, (("a", 0.7), ("b", 0.3)), before.blocks), MixPeriod(t0, (("a", 0.4), ("b", 0.6)), 8)]
    after = order_of({"a": A, "b": B}, [0.4, 0.6], 16, periods=periods, slicing=dict(zip("ab", before.slicing)))
    assert np.array_equal(after.base, before.slice_draws_at(t0))
    # The run's draws: the old mix to t0, the new one after. Every slice's are 0, 1, 2, ...: none skipped or
    # drawn twice at the change, so none of its samples comes back before its pass ends.
    q0, d0 = before.draws(np.arange(t0 * 16))
    q1, d1 = after.draws(np.arange(t0 * 16, 300 * 16))
    q, d = np.concatenate([q0, q1]), np.concatenate([d0, d1])
    for s in range(before.slices):
        assert (np.sort(d[q == s]) == np.arange((q == s).sum())).all(), s
    ids = np.concatenate([before.sample_ids(np.arange(t0 * 16)), after.sample_ids(np.arange(t0 * 16, 300 * 16))])
    assert_once_per_pass(after, ids)
    # the source's slices keep within a draw of each other: no sample is seen a third time before all are twice
    draws = after.slice_draws_at(300)
    assert all(np.ptp(draws[after.source_of_slice == i]) <= 1 for i in (0, 1))
    src = source_of(after, after.sample_ids(np.arange(t0 * 16, 1037 * 16)))
    assert abs((src == 1).sum() - 1000 * 16 * 0.6) < 1  # the new weight from t0 on, to one sample


def test_a_source_added_starts_at_its_first_draw_and_one_removed_and_back_continues() -> None:
    base = order_of({"a": A, "b": B}, [0.7, 0.3], 16)
    blocks, (cut_c,) = choose_blocks(16, [0.5], [np.asarray(C)], [None])
    slicing = {**dict(zip("ab", base.slicing)), "c": cut_c}
    periods = [MixPeriod(0, (("a", 0.7), ("b", 0.3)), base.blocks), MixPeriod(10, (("a", 0.5), ("c", 0.5)), 8),
               MixPeriod(20, (("a", 0.7), ("b", 0.3)), base.blocks)]
    with_c = order_of({"a": A, "c": C}, [0.5, 0.5], 16, periods=periods[:2], slicing=slicing)
    assert with_c.base[with_c.slice_offset[1]:].sum() == 0  # c is new: from its first draw
    back = order_of({"a": A, "b": B}, [0.7, 0.3], 16, periods=periods, slicing=slicing)
    b = slice(back.slice_offset[1], back.slice_offset[2])
    assert np.array_equal(back.base[b], base.slice_draws_at(10)[b])  # b kept its draws while it was out
    assert back.base[:back.slice_offset[1]].sum() == 112 + 80  # a drew throughout: 10 steps at 11.2, 10 at 8


def test_blocks_respect_the_global_batch_the_weights_and_the_smallest_source() -> None:
    blocks, cuts = choose_blocks(4096, [0.5, 0.3, 0.2], [np.full(10_000, 1000), np.full(300, 1000), np.full(40, 500)],
                                 [None] * 3)
    assert blocks == 512 and [c.slices for c in cuts] == [512, 512, 512]  # the small one cut finer to 512
    assert cuts[0] == Slicing(128, 4)  # a data set alone would have been cut so (order.py)
    assert choose_blocks(16, [0.7, 0.3], [np.full(20, 40), np.full(8, 32)], [None, None])[0] == 8  # g 2: 1.4 >= 1
    assert choose_blocks(12, [0.4, 0.3, 0.3], [np.full(20, 40)] * 3, [None] * 3)[0] == 2  # g = 6: 6 x 0.4 >= 2; g = 3 is not
    with pytest.raises(ValueError, match="too small for 3 sources"):
        choose_blocks(4, [0.4, 0.3, 0.3], [np.full(20, 40)] * 3, [None] * 3)
    # a source already cut keeps its cut; blocks divide it
    assert choose_blocks(64, [0.5, 0.5], [np.full(20, 40)] * 2, [Slicing(2, 2), None])[0] == 4


def test_a_node_s_cache_holds_the_spans_of_its_slices_of_every_source() -> None:
    from pipeline.data.loader import cache_needed_bytes

    sources = {"a": A, "b": B, "c": C}
    size = {"a": 100, "b": 1000, "c": 10_000}  # bytes per shard: which source's shards are counted shows
    shard_bytes = [size[name] for name, counts in sources.items() for _ in counts]
    whole = order_of(sources, [0.5, 0.3, 0.2], 48, span=10**6)  # a span past every slice: all its shards
    assert cache_needed_bytes(whole, shard_bytes, 0, 1) == sum(shard_bytes)
    for nodes in (2, 4, 8):  # each node: every source's shards its own slices cover, and only those
        for node in range(nodes):
            own = {int(s) for q in whole.node_slices(node, nodes) for s in whole.slice_shards[q]}
            assert {int(whole.source_of_shard[s]) for s in own} == {0, 1, 2}
            assert cache_needed_bytes(whole, shard_bytes, node, nodes) == sum(shard_bytes[s] for s in own)


def test_the_scale_projection_of_a_mixture_fetches_each_node_s_own_slices_shards() -> None:
    # launch/bench.py scale --mix walks the real order over each source's first epoch; what it counts must be
    # what the slicing says: node n (of N dividing the blocks) fetches the shards its slices of the source
    # cover and no other.
    from benchmarks.scale import mix_order, parse_mix, project_mix

    order = mix_order(parse_mix("web=0.5:96,books=0.3:40,rare=0.2:12"), 50, 256)
    rows = project_mix(order, [1, 2, 4, 8, 16, 32, 3], gpus_per_node=2)
    assert rows[3] == "skipped, global batch 256 is not a multiple of 6 ranks"
    for nodes in (1, 2, 4, 8, 16, 32):
        for i in range(3):
            pairs = sum(len({shard for q in order.node_slices(node, nodes) if order.source_of_slice[q] == i
                             for shard, _, _ in order.segments[q].tolist()}) for node in range(nodes))
            shards = int(order.shard_offset[i + 1] - order.shard_offset[i])
            assert rows[nodes][i] == pytest.approx(pairs / shards), (nodes, i)
    # rare's 12 shards in 64 slices: nodes share its shards first (8 nodes: 1.5 shards each, 16 pairs)
    assert rows[1] == [1.0] * 3 and rows[8][2] == pytest.approx(16 / 12) and rows[32][2] > rows[16][2] > rows[8][2]


# ----------------------------------------------------------------------------- the loader over real shards


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    big, small = tmp_path_factory.mktemp("big"), tmp_path_factory.mktemp("small")
    log = lambda s: None  # noqa: E731
    write_dataset(synthetic_source(360, 5, 16, val_fraction=0.2), big, max_samples_per_shard=24, progress=False, log=log)
    write_dataset(synthetic_source(120, 3, 24, val_fraction=0.2, seed=1), small, max_samples_per_shard=12,
                  progress=False, log=log)
    return big, small


def mix_cfg(two: tuple[Path, Path], weights: tuple[float, float] = (0.7, 0.3), **kw) -> DataConfig:
    big, small = two
    return DataConfig(num_workers=0, shuffle_span=16, cache_dir=str(big.parent / "cache"),
                      sources=[SourceConfig("big", str(big), weight=weights[0]),
                               SourceConfig("small", str(small), weight=weights[1])], **kw)


def ids_of(loader, steps: int) -> list[int]:
    out = []
    for _ in range(steps * loader.accum):
        next(loader)
        out += loader.last_ids.tolist()
    return out


def sample_keys(cfg: DataConfig, ids: list[int]) -> list[tuple[str, str, int]]:
    """(source, shard, index in the shard) of each global id, from the sources' dataset.json alone."""
    keys = []
    for s in cfg.sources:
        info = json.loads((Path(s.path) / "dataset.json").read_text())
        keys += [(s.name, e["name"], k) for e in info["splits"]["train"]["shards"] for k in range(e["num_samples"])]
    return [keys[i] for i in ids]


def test_realised_share_over_1000_steps_from_the_sample_keys(two) -> None:
    cfg = mix_cfg(two)
    keys = sample_keys(cfg, ids_of(build_train_loader(cfg, 16, 8, seed=0, global_batch_size=16, ids_only=True), 1000))
    small = np.asarray([k[0] == "small" for k in keys]).reshape(1000, 16).sum(axis=1)
    assert set(np.unique(small).tolist()) <= {4, 5}  # floor and ceil of 0.3 x 16 in every batch
    assert abs(small.sum() - 0.3 * 16 * 1000) <= 1  # the documented tolerance: one sample over any run of steps
    # every pass of the small source holds each of its 96 samples once
    mine = [k for k in keys if k[0] == "small"]
    assert all(len(set(mine[e * 96:(e + 1) * 96])) == 96 for e in range(len(mine) // 96))


def test_a_mixture_resumes_exactly_on_another_layout(two) -> None:
    cfg = mix_cfg(two)
    reference = ids_of(build_train_loader(cfg, 16, 8, seed=3, global_batch_size=16, ids_only=True), 6)
    first = build_train_loader(cfg, 16, 4, seed=3, rank=0, world_size=2, global_batch_size=16, ids_only=True)
    ids_of(first, 3)
    state = first.state_dict()
    assert state["mix"]["periods"] == [{"step": 0, "blocks": 8, "weights": [["big", 0.7], ["small", 0.3]]}]
    resumed = build_train_loader(cfg, 16, 16, seed=3, global_batch_size=16, ids_only=True)  # 1 rank, no accumulation
    resumed.load_state_dict(state)
    assert resumed.mix_change is None and ids_of(resumed, 3) == reference[48:]


def test_a_changed_mix_is_refused_in_one_line_unless_allowed(two, tmp_path: Path) -> None:
    loader = build_train_loader(mix_cfg(two), 16, 8, seed=0, global_batch_size=16, ids_only=True)
    ids_of(loader, 18)  # small mid-pass: 86 of its 96 samples drawn (10 or 11 of each slice's 12)
    state = loader.state_dict()
    changed = mix_cfg(two, (0.5, 0.5))
    with pytest.raises(DataError, match=r"^cannot continue the data stream at step 18: the mix changed since the "
                                        r"checkpoint \('big' weight 0.7 -> 0.5; 'small' weight 0.3 -> 0.5\); set "
                                        r"data.allow_mix_change=true") as e:
        build_train_loader(changed, 16, 8, seed=0, global_batch_size=16, ids_only=True).load_state_dict(state)
    assert "\n" not in str(e.value)
    allowed = build_train_loader(dataclasses.replace(changed, allow_mix_change=True), 16, 8, seed=0,
                                 global_batch_size=16, ids_only=True)
    allowed.load_state_dict(state)
    assert allowed.mix_change == {"step": 18, "changes": ["'big' weight 0.7 -> 0.5", "'small' weight 0.3 -> 0.5"],
                                  "weights": {"big": 0.5, "small": 0.5}}
    after = sample_keys(changed, ids_of(allowed, 40))
    assert sum(k[0] == "small" for k in after) == 320  # half of every batch from step 18 on
    # small continued where it was: in the keys of the whole run, each of its slices (here its shards of 12)
    # draws its samples once per pass, across the change (mid-pass: a slice that began its pass again, or drew
    # it in another permutation after the change, repeats a sample within it)
    before = sample_keys(changed, ids_of(build_train_loader(mix_cfg(two), 16, 8, seed=0, global_batch_size=16,
                                                            ids_only=True), 18))
    keys = [k for k in before + after if k[0] == "small"]
    for shard in {k[1] for k in keys}:
        mine = [k for k in keys if k[1] == shard]
        assert len(mine) > 24 and all(len(set(mine[e * 12:(e + 1) * 12])) == 12 for e in range(len(mine) // 12))
    saved = allowed.state_dict()["mix"]["periods"]
    assert [p["step"] for p in saved] == [0, 18]
    # a source removed: named; and one of the same name over other shards: refused whatever the opt-in
    alone = dataclasses.replace(mix_cfg(two), sources=mix_cfg(two).sources[:1])
    with pytest.raises(DataError, match=r"\('small' removed; 'big' weight 0.7 -> 1\)"):
        build_train_loader(alone, 16, 8, seed=0, global_batch_size=16, ids_only=True).load_state_dict(state)
    other = dataclasses.replace(mix_cfg(two), allow_mix_change=True, sources=[
        mix_cfg(two).sources[0], SourceConfig("small", str(two[0]), weight=0.3)])
    with pytest.raises(DataError, match="source 'small' is other shards since the checkpoint"):
        build_train_loader(other, 16, 8, seed=0, global_batch_size=16, ids_only=True).load_state_dict(state)
    one = DataConfig(path=str(two[0]), num_workers=0)
    with pytest.raises(DataError, match=r"written from data.sources \(a mixture\) and this run reads data.path"):
        build_train_loader(one, 16, 8, seed=0, global_batch_size=16, ids_only=True).load_state_dict(state)


def test_one_label_space_for_the_run_and_labels_off_for_a_label_free_run(two) -> None:
    cfg = mix_cfg(two)
    info = read_data(cfg)
    assert info.class_names == [f"class_{i}" for i in range(5)]  # small's 3 names are among big's: one class each
    big, small = two
    other = json.loads((small / "dataset.json").read_text())
    other["class_names"] = ["x", "y", "class_0"]
    (small / "dataset.json").write_text(json.dumps(other))
    try:
        info = read_data(cfg)
        assert info.class_names == [*(f"class_{i}" for i in range(5)), "x", "y"] and info.num_classes == 7
        loader = build_train_loader(cfg, 16, 16, seed=0, global_batch_size=16, info=info)
        targets = np.concatenate([next(loader)[1].numpy() for _ in range(6)])
        src = [k[0] for k in sample_keys(cfg, ids_of(build_train_loader(cfg, 16, 16, seed=0, global_batch_size=16,
                                                                        ids_only=True), 6))]
        assert set(targets[np.asarray(src) == "small"].tolist()) == {5, 6, 0}  # x, y, class_0 of the run
        assert set(targets[np.asarray(src) == "big"].tolist()) == set(range(5))
        ev = build_eval_loader(cfg, 16, 8, info=info)  # both sources' validation splits, labels mapped alike
        labels = np.concatenate([t[v].numpy() for _, t, v in ev])
        assert len(labels) == info.splits["val"].num_samples and set(labels.tolist()) == {0, 1, 2, 3, 4, 5, 6}
    finally:
        other["class_names"] = [f"class_{i}" for i in range(3)]
        (small / "dataset.json").write_text(json.dumps(other))
    unlabelled = json.loads((small / "dataset.json").read_text())
    (small / "dataset.json").write_text(json.dumps({**unlabelled, "num_classes": 0, "class_names": []}))
    try:
        info = read_data(cfg)  # labelled only when every source is: a supervised run is refused, naming it
        assert info.num_classes == 0 and "small: " in info.path and info.path.endswith("(no labels))")
        with pytest.raises(DataError, match=r"data.sources 'small' \(.*\) has no labels .* and this run reads labels"):
            build_train_loader(cfg, 16, 8, seed=0, global_batch_size=16)
        next(build_train_loader(dataclasses.replace(cfg, label_key=""), 16, 8, seed=0, global_batch_size=16))
    finally:
        (small / "dataset.json").write_text(json.dumps(unlabelled))


def test_weights_from_repeat_or_samples_and_per_source_figures(two) -> None:
    big, small = two
    by_repeat = DataConfig(num_workers=0, sources=[SourceConfig("big", str(big), repeat=1),
                                                   SourceConfig("small", str(small), repeat=2)])
    mixture = read_data(by_repeat).mixture
    assert [round(s.weight, 6) for s in mixture.sources] == [round(290 / 482, 6), round(192 / 482, 6)]  # 290 and 96
    by_samples = dataclasses.replace(by_repeat, sources=[SourceConfig("big", str(big), samples=300),
                                                         SourceConfig("small", str(small), samples=100)])
    assert [s.weight for s in read_data(by_samples).mixture.sources] == [0.75, 0.25]
    loader = build_train_loader(mix_cfg(two), 16, 8, seed=0, global_batch_size=16, ids_only=True)
    ids_of(loader, 50)
    m = loader.source_metrics()
    assert m["data/small/samples_seen"] == 240 and m["data/big/samples_seen"] == 560
    assert m["data/small/epochs_completed"] == 2 and m["data/big/epochs_completed"] == 1  # 96 and 290 samples
    assert m["data/small/share"] == 0.3 and m["data/big/bad_samples"] == 0


def test_sources_config_names_the_entry_at_fault_and_overrides_reach_an_entry_by_name() -> None:
    from pipeline.config import ConfigError, load_config
    from pipeline.tracking.tracker import flatten

    two = "data.sources=[{name: a, path: x, weight: 0.7}, {name: b, path: y, weight: 0.3}]"
    cfg = load_config(None, [two, "data.sources.b.weight=0.4", "data.sources.0.path=z"])
    assert [(s.name, s.path, s.weight) for s in cfg.data.sources] == [("a", "z", 0.7), ("b", "y", 0.4)]
    for bad, message in [
        ("[{name: a, path: x}]", "data.sources[0] ('a') needs one of weight, repeat or samples"),
        ("[{name: a, path: x, weight: 1, repeat: 2}]", "data.sources[0] ('a') sets weight and repeat: give one"),
        ("[{name: a, path: x, weight: 0}]", "data.sources[0] ('a') weight must be a finite number > 0, got 0.0"),
        ("[{name: a, path: x, weight: .nan}, {name: b, path: y, weight: 1}]", "('a') weight must be a finite number > 0, got nan"),
        ("[{name: a, path: x, weight: 1}, {name: b, path: y, weight: .inf}]", "('b') weight must be a finite number > 0, got inf"),
        ("[{name: a, path: x, repeat: -.inf}]", "('a') repeat must be a finite number > 0, got -inf"),
        ("[{name: a, path: x, weight: 1e308}, {name: b, path: y, weight: 1e308}]", "cannot be normalised (their sum is inf"),
        ("[{name: a, path: x, weight: 1e300}, {name: b, path: y, weight: 1e-300}]", "cannot be normalised"),
        ("[{name: a/b, path: x, weight: 1}]", "('a/b') has the name 'a/b': a plain name of letters"),
        ("[{name: .., path: x, weight: 1}]", "('..') has the name '..': a plain name"),
        ("[{name: 'my web', path: x, weight: 1}]", "('my web') has the name 'my web': a plain name"),
        ("[{name: a, path: x, wieght: 1}]", "unknown key 'data.sources[0].wieght'; valid keys here: name, path"),
        ("[{name: a, path: x, weight: 1}, {name: a, path: y, weight: 1}]", "names must be unique"),
        ("[{name: a, path: x, weight: 1}, {name: b, path: y, repeat: 1}]", "mixes weight with repeat/samples"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            load_config(None, [f"data.sources={bad}"])
    with pytest.raises(ConfigError, match=r"override 'data.sources.c.weight': no item 'c' in the list \(names: a, b"):
        load_config(None, [two, "data.sources.c.weight=1"])
    with pytest.raises(ConfigError, match="'data.partitions' applies to data.path alone"):
        load_config(None, [two, "data.partitions=2"])
    # MLflow params: one per source and key, so that a changed weight is a changed param
    params = flatten({"data": {"sources": [{"name": "a", "weight": 0.7}, {"name": "b", "weight": 0.4}]}})
    assert params == {"data.sources.a.weight": 0.7, "data.sources.b.weight": 0.4}
