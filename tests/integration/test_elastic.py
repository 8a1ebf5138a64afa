"""Elastic data end to end, on a mixture (data.sources: digits at 0.7 and a synthetic set at 0.3 of every global
batch, tests/integration/mix_runs.py; the one-source order's layout freedom is unit-tested in test_order.py and
test_data_loader.py): the same weights on 1 rank with 2 micro batches and 1 worker as on 2 ranks with 2 workers,
the same after a resume on another world size, and a resume with a changed mix refused in one line, or, with
the opt-in, continued with each source where it was."""

import json
import shutil

import numpy as np
import pytest

from pipeline.data import build_train_loader
from pipeline.objectives import load_config
from pipeline.train.checkpoint import read_client_state
from tests.integration.mix_runs import (
    CONFIG,
    RECORD,
    mixture_data,
    overrides,
    recorded_ids,
    reference,
    sample_keys,
    sources,
)
from tests.integration.runs import (
    assert_same_weights,
    leaked_shm_buffers,
    metrics,
    run,
    run_here,
    shm_buffers,
    weights,
)

pytestmark = pytest.mark.dist


def cut_at(run_dir, step: int) -> None:
    """The run directory as a job stopped after `step`'s checkpoint left it (what a preemption there saves)."""
    for tag in (run_dir / "checkpoints").glob("step_*"):
        if int(tag.name.split("_")[1]) > step:
            shutil.rmtree(tag)
    (run_dir / "checkpoints" / "latest").write_text(f"step_{step:07d}\n")
    (run_dir / "model.safetensors").unlink()


def last(rows: list[dict], key: str) -> float:
    return [r["metrics"][key] for r in rows if key in r["metrics"]][-1]


def test_two_ranks_and_workers_train_the_weights_of_one_and_resume_on_one_rank_exactly(tmp_path, tmp_path_factory):
    ref_dir, ref = reference(tmp_path_factory)
    digits, synth = mixture_data(tmp_path_factory)
    two = tmp_path / "two"
    before = shm_buffers()
    res = run("pretrain.py", CONFIG, overrides(two, sources(digits, synth), workers=2), ranks=2)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert leaked_shm_buffers(before) == set()  # DeepSpeed's CPU all-reduce buffers (69 MB each) are gone
    # 2 micro batches summed on 1 rank = 2 ranks all-reduced: bit for bit (no summation order differs)
    assert_same_weights(weights(two), ref)
    # The per-source figures: the same on both layouts, and what the sample ids the reference trained on say.
    # synth's share of 8 steps of 16: floor(8 x 16 x 0.3) = 38 samples, digits the other 90.
    keys = sample_keys([digits, synth], [i for ids in recorded_ids(ref_dir.parent / "ids").values() for i in ids])
    assert sum(k[0] == "synth" for k in keys) == 38 and len(keys) == 128
    for run_dir in (ref_dir, two):
        rows = metrics(run_dir)
        assert (last(rows, "data/synth/samples_seen"), last(rows, "data/digits/samples_seen")) == (38, 90)
        assert last(rows, "data/synth/share") == 38 / 128 and last(rows, "data/synth/epochs_completed") == 0
    # Preempted on 2 ranks after step 4 (its checkpoint) and resumed on 1 rank: the uninterrupted weights.
    cut_at(two, 4)
    resumed = run_here("pretrain.py", CONFIG, overrides(two, sources(digits, synth)))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "at step 4" in resumed.stdout
    assert_same_weights(weights(two), ref)


def test_a_changed_weight_is_refused_in_one_line_and_continues_with_the_opt_in(tmp_path, tmp_path_factory):
    ref_dir, _ = reference(tmp_path_factory)
    digits, synth = mixture_data(tmp_path_factory)
    run_dir = tmp_path / "changed"
    shutil.copytree(ref_dir, run_dir)
    cut_at(run_dir, 4)
    changed = sources(digits, synth, (0.5, 0.5))
    refused = run_here("pretrain.py", CONFIG, overrides(run_dir, changed))
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode != 0 and errors == [
        "error: cannot continue the data stream at step 4: the mix changed since the checkpoint ('digits' weight "
        "0.7 -> 0.5; 'synth' weight 0.3 -> 0.5); set data.allow_mix_change=true to continue with the new mix from "
        "this step, or resume with the checkpoint's data.sources"], refused.stdout[-2000:] + refused.stderr[-2000:]

    ids = tmp_path / "ids"
    ids.mkdir()
    allowed = [*overrides(run_dir, changed), "data.allow_mix_change=true"]
    res = run(RECORD, CONFIG, allowed, ranks=1, extra_env={"RECORD_IDS": str(ids)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "data: the mix changed at step 4 ('digits' weight 0.7 -> 0.5; 'synth' weight 0.3 -> 0.5)" in res.stdout
    # Recorded: a line per mix in the run directory, and for MLflow a tag with the step and the new params
    # (tracking.json is what the run sends: a changed param becomes tag param_override.<key> there).
    mixes = [json.loads(line) for line in (run_dir / "data_mix.jsonl").read_text().splitlines()]
    assert [(m["step"], m["weights"]) for m in mixes] == [(0, {"digits": 0.7, "synth": 0.3}),
                                                          (4, {"digits": 0.5, "synth": 0.5})]
    record = json.loads((run_dir / "tracking.json").read_text())
    assert record["tags"]["data.mix_change.step_4"] == "'digits' weight 0.7 -> 0.5; 'synth' weight 0.3 -> 0.5"
    assert record["params"]["data.sources.synth.weight"] == "0.5"
    # The per-source counters: 4 steps at 0.3 (19 synth samples), 4 at 0.5 (32): 51 of synth's 48, so its
    # epoch wrapped once, after the change.
    rows = metrics(run_dir)
    assert (last(rows, "data/synth/samples_seen"), last(rows, "data/digits/samples_seen")) == (51, 77)

    # From the sample ids the two jobs trained on: each of synth's slices draws its samples once per pass
    # across the change (no sample came back before its pass ended), and the counts are the counters'.
    trained = {**{p: i for p, i in recorded_ids(ref_dir.parent / "ids").items() if p < 64}, **recorded_ids(ids)}
    order_ids = np.asarray([i for p in sorted(trained) for i in trained[p]])
    keys = sample_keys([digits, synth], order_ids.tolist())
    assert len(keys) == 128 and sum(k[0] == "synth" for k in keys) == 51
    cfg = load_config(CONFIG, [*allowed, "data.num_workers=0"])
    loader = build_train_loader(cfg.data, 16, 8, seed=0, global_batch_size=16, ids_only=True)
    loader.load_state_dict(read_client_state(run_dir, "step_0000008")["data"])  # the run's own history
    order = loader.stream.order
    assert last(rows, "data/synth/epochs_completed") == order.source_figures(8)["synth"][1] == 1  # every slice
    slice_of = np.full(order.n, -1)
    for q, seg in enumerate(order.segments):
        for shard, lo, hi in seg.tolist():
            slice_of[order.starts[shard] + lo:order.starts[shard] + hi] = q
    synth_slices = np.flatnonzero(order.source_of_slice == 1)
    wrapped = 0
    for q in synth_slices:
        mine, n = order_ids[slice_of[order_ids] == q], int(order.slice_sizes[q])
        assert all(len(set(mine[e * n:(e + 1) * n].tolist())) == len(mine[e * n:(e + 1) * n])
                   for e in range(-(-len(mine) // n))), q
        wrapped += len(mine) > n
    assert wrapped > 0  # some slice did start its second pass: the check above saw a pass boundary
