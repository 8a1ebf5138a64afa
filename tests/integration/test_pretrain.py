"""Multi-process pretraining on CPU (gloo): loss goes down, checkpoints, exact resume, preemption, failures."""

import shutil
import signal
import subprocess

import pytest

from pipeline.train import checkpoint as ckpt
from tests.integration.runs import (
    WORKERS,
    assert_same_weights,
    metrics,
    run,
    run_and_signal,
    run_here,
    supervised,
    weights,
)

pytestmark = pytest.mark.dist
CONFIG = "configs/pretrain/demo.yaml"


base = supervised  # TINY on demo.yaml: 24 steps, checkpoints every 8 (runs.py)


@pytest.mark.parametrize("zero", [1, 3])
def test_sigusr1_on_one_rank_checkpoints_exits_75_and_resume_is_bit_exact(shards, tmp_path, zero, request):
    # Uninterrupted reference run (no loader workers; the preempted run has them: the same batches). At ZeRO-1
    # the session's (test_run_remote.py ends against it too).
    if zero == 1:
        ref_dir, ref_out = request.getfixturevalue("supervised_reference")
    else:
        ref_dir = tmp_path / "ref"
        ref = run("pretrain.py", CONFIG, base(shards, ref_dir, zero))
        assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
        ref_out = ref.stdout
    assert "world size 2" in ref_out
    losses = [m["metrics"]["train/loss"] for m in metrics(ref_dir) if "train/loss" in m["metrics"]]
    assert losses[-1] < 0.8 * losses[0], losses  # it learns
    assert (ref_dir / "checkpoints" / "latest").read_text().strip() == "step_0000024"
    kept = sorted(p.name for p in (ref_dir / "checkpoints").glob("step_*"))
    assert kept == ["step_0000016", "step_0000024"]  # keep_last=2

    # Same run, SIGUSR1 to rank 1 only, mid-way: all ranks stop at one step boundary, checkpoint, exit 75.
    run_dir = tmp_path / "preempted"
    code, out = run_and_signal("pretrain.py", CONFIG, [*base(shards, run_dir, zero), WORKERS], when="step 4/24",
                               launcher="deepspeed")  # its pass-through of 75: tested here
    assert code == 75, out[-3000:]
    assert "preempted: checkpoint at step" in out
    stopped_at = int((run_dir / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert 4 <= stopped_at < 24
    assert not (run_dir / "model.safetensors").exists()

    # The restart resumes from `latest` and ends with exactly the uninterrupted weights.
    resumed = run("pretrain.py", CONFIG, [*base(shards, run_dir, zero), WORKERS])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and f"at step {stopped_at}" in resumed.stdout
    assert "does not keep" not in resumed.stdout  # DeepSpeed's own keys (ds_config, ...) are not parts
    assert_same_weights(weights(ref_dir), weights(run_dir))


KILL_DURING_SAVE = """
import os, runpy, signal, sys, torch
real_save = torch.save
def dying_save(obj, f, *a, **k):
    if "step_0000008" in str(f):  # the second checkpoint: write half a file, then die like an OOM kill
        with open(f, "wb") as fh:
            fh.write(b"half a checkpoint")
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, f, *a, **k)
torch.save = dying_save
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_killed_while_saving_keeps_latest_on_the_previous_checkpoint(shards, tmp_path):
    from tests.integration.runs import PYTHON, ROOT, env

    run_dir = tmp_path / "run"
    overrides = [*base(shards, run_dir, 1, steps=12), "train.ckpt_every=4"]
    proc = subprocess.run([PYTHON, "-c", KILL_DURING_SAVE, str(ROOT / "launch/pretrain.py"), "--config", CONFIG,
                           *overrides], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (run_dir / "checkpoints" / "step_0000008").exists()  # the half-written one is there...
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_0000004"  # ...but not used

    resumed = run_here("pretrain.py", CONFIG, overrides)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "at step 4" in resumed.stdout
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_0000012"


def test_non_finite_losses_stop_the_run_without_saving(shards, tmp_path):
    run_dir = tmp_path / "run"
    first = run_here("pretrain.py", CONFIG, [*base(shards, run_dir, 1, steps=4), "train.ckpt_every=0"])
    assert first.returncode == 0, first.stderr[-3000:]
    # Resume with inputs that become infinite (std 1e-38): every loss is NaN from here on.
    poisoned = [*base(shards, run_dir, 1, steps=8), "data.std=[1e-38, 1e-38, 1e-38]", "train.max_nonfinite_steps=3"]
    # train.check_finite: each micro batch read before backward, skipped and replaced; 3 in a row stop it.
    second = run_here("pretrain.py", CONFIG, [*poisoned, "train.check_finite=true"])
    assert second.returncode == 3, second.stdout[-2000:] + second.stderr[-2000:]
    assert "3 non-finite losses in a row at step 4" in second.stderr
    assert "Last good checkpoint: step_0000004" in second.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_0000004"]
    # The default reads nothing per step: the steps are taken with zero gradients, counted on the device and
    # read at the log steps (TINY: every 2): 4 in a row by step 8 stop it there, before its checkpoint.
    third = run_here("pretrain.py", CONFIG, poisoned)
    assert third.returncode == 3, third.stdout[-2000:] + third.stderr[-2000:]
    assert "4 optimizer steps in a row with a non-finite gradient norm by step 8" in third.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_0000004"]


def test_checkpoint_of_another_model_is_refused(shards, tmp_path):
    run_dir = tmp_path / "run"
    assert run_here("pretrain.py", CONFIG, base(shards, run_dir, 1, steps=2)).returncode == 0
    other = run_here("pretrain.py", CONFIG, [*base(shards, run_dir, 1, steps=4), "model.embed_dim=48"])
    assert other.returncode == 1
    assert "different model" in other.stderr and "embed_dim: 32 (checkpoint) vs 48 (config)" in other.stderr


def test_zero3_init_builds_the_same_model_as_stage0(shards, tmp_path):
    """Under deepspeed.zero.Init every parameter is partitioned as it is created; the ViT's init must
    still produce the seed's weights. lr=0 for one step: the exported weights are the initial ones."""
    one_step = ["train.steps=1", "train.warmup_steps=0", "train.lr=0.0", "train.log_every=1", "train.eval_every=0"]
    results = {}
    for zero in (0, 3):  # ZeRO-3 partitioned over 2 ranks; the seed's weights at ZeRO-0 on 1 (in this process)
        run_dir = tmp_path / f"zero{zero}"
        overrides = [*base(shards, run_dir, zero), *one_step]
        out = run("pretrain.py", CONFIG, overrides) if zero else run_here("pretrain.py", CONFIG, overrides)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        first_loss = next(m["metrics"]["train/loss"] for m in metrics(run_dir) if "train/loss" in m["metrics"])
        results[zero] = weights(run_dir), first_loss
    assert_same_weights(results[0][0], results[3][0])
    assert results[3][1] == pytest.approx(results[0][1], rel=1e-2)  # first-step loss, bf16 tolerance


SIGNAL_IN_SETUP = """
import os, runpy, signal, sys
import deepspeed
real_initialize = deepspeed.initialize
def initialize(*args, **kwargs):  # SIGUSR1 to rank 1 while DeepSpeed sets up, as Slurm may send it
    if os.environ.get("LOCAL_RANK") == "1":
        os.kill(os.getpid(), signal.SIGUSR1)
    return real_initialize(*args, **kwargs)
deepspeed.initialize = initialize
sys.argv = [os.environ["WRAPPED_SCRIPT"], *sys.argv[1:]]  # the launcher put --local_rank first
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_signal_during_setup_exits_75_before_the_first_step(shards, tmp_path):
    from tests.integration.runs import DEEPSPEED, ROOT, env, free_port

    wrapper = tmp_path / "signal_in_setup.py"
    wrapper.write_text(SIGNAL_IN_SETUP)
    run_dir = tmp_path / "run"
    argv = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), str(wrapper),
            "--config", CONFIG, *base(shards, run_dir, 1)]
    out = subprocess.run(argv, cwd=ROOT, env={**env(), "WRAPPED_SCRIPT": str(ROOT / "launch/pretrain.py")},
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 75, out.stdout[-3000:] + out.stderr[-3000:]
    assert "preempted during setup" in out.stdout
    assert "step 2/" not in out.stdout  # stopped before training
    assert not (run_dir / "checkpoints" / "latest").exists()  # nothing new to save


def fp32(shards, run_dir, zero, *extra):
    return [*base(shards, run_dir, zero, steps=12), "deepspeed.bf16=false", "train.ckpt_every=4", *extra]


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def preempted_zero1(shards, tmp_path_factory):
    """An uninterrupted 2-rank ZeRO-1 fp32 run, and the same run preempted by SIGUSR1 mid-way."""
    ref_dir = tmp_path_factory.mktemp("ref")
    ref = run("pretrain.py", CONFIG, fp32(shards, ref_dir, 1))
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    run_dir = tmp_path_factory.mktemp("preempted")
    code, out = run_and_signal("pretrain.py", CONFIG, fp32(shards, run_dir, 1), when="step 4/12")
    assert code == 75, out[-3000:]
    return weights(ref_dir), run_dir


def resumed_diff(ref, run_dir, overrides, converted, ranks=2):
    """Resume run_dir with `overrides`; check it converted (`converted` says from what to what); return the
    largest weight difference to the uninterrupted run `ref`."""
    out = run("pretrain.py", CONFIG, overrides, ranks=ranks) if ranks > 1 else run_here("pretrain.py", CONFIG, overrides)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"layout changed ({converted}): converted" in out.stdout
    return max_diff(ref, weights(run_dir))


def test_resume_on_2_ranks_at_zero3_converts_and_matches(shards, tmp_path, preempted_zero1):
    ref, preempted = preempted_zero1
    run_dir = tmp_path / "zero3"
    shutil.copytree(preempted, run_dir)
    diff = resumed_diff(ref, run_dir, fp32(shards, run_dir, 3), "ZeRO-1 -> ZeRO-3")
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_0000012"
    assert not (run_dir / "universal" / "step_0000004").exists()  # superseded by the newer checkpoints
    print(f"ZeRO-1 x2 -> ZeRO-3 x2: max |diff| to the uninterrupted run {diff:.3e}")
    assert diff < 1e-5

    # And back: the ZeRO-3 checkpoint at step 8, resumed at ZeRO-2.
    back = tmp_path / "zero2"
    shutil.copytree(run_dir, back)
    (back / "model.safetensors").unlink()
    shutil.rmtree(back / "checkpoints" / "step_0000012")  # resume picks the newest complete tag: step 8
    diff = resumed_diff(ref, back, fp32(shards, back, 2), "ZeRO-3 -> ZeRO-2")
    print(f"... -> ZeRO-2 x2 from step 8: max |diff| to the uninterrupted run {diff:.3e}")
    assert diff < 1e-5


def test_resume_on_1_rank_converts_and_matches(shards, tmp_path, preempted_zero1):
    ref, preempted = preempted_zero1
    run_dir = tmp_path / "one_rank"
    # train.global_batch_size=16 (TINY): two micro batches of 8 per step here, one on each of two ranks before.
    shutil.copytree(preempted, run_dir)
    diff = resumed_diff(ref, run_dir, fp32(shards, run_dir, 1), "world size 2 -> 1", ranks=1)
    print(f"ZeRO-1 x2 -> ZeRO-1 x1: max |diff| to the uninterrupted run {diff:.3e}")
    # Through a universal checkpoint the optimizer state is re-partitioned: fp32 rounding, not bit-exact
    # (docs/training.md gives the measured difference and this bound).
    assert diff < 1e-6


def test_resume_errors_are_one_line_and_overrides_are_applied(shards, tmp_path):
    run_dir = tmp_path / "run"
    first = run_here("pretrain.py", CONFIG, base(shards, run_dir, 1, steps=2))
    assert first.returncode == 0, first.stderr[-3000:]

    def refused(*overrides, expect):
        out = run_here("pretrain.py", CONFIG, [*base(shards, run_dir, 1, steps=4), *overrides])
        assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
        assert "Traceback" not in out.stderr and str(run_dir) in out.stderr and expect in out.stderr, out.stderr

    refused("deepspeed.zero_stage=0", expect="resume with deepspeed.zero_stage=1")
    refused("train.layer_decay=0.7", expect="Resume with train.layer_decay=null")

    changed = run_here("pretrain.py", CONFIG, [*base(shards, run_dir, 1, steps=4), "train.lr=1e-3"])
    assert changed.returncode == 0, changed.stdout[-3000:] + changed.stderr[-3000:]
    assert "overrides applied to the resumed optimizer and schedule: train.lr 0.003 -> 0.001" in changed.stdout
    assert "train.steps 2 -> 4" in changed.stdout
    lrs = [m["metrics"]["train/lr"] for m in metrics(run_dir) if m["step"] == 4 and "train/lr" in m["metrics"]]
    assert lrs and lrs[-1] < 1e-3  # the new peak's schedule, not the checkpoint's 3e-3


def test_ckpt_every_s_saves_the_same_steps_on_every_rank(shards, tmp_path):
    """train.ckpt_every_s with no step interval: a tiny interval makes every step due; each save is a
    complete tag (every rank wrote its files for that step), so the ranks agreed."""
    run_dir = tmp_path / "timed"
    overrides = [*base(shards, run_dir, 1, steps=4), "train.ckpt_every=0", "train.ckpt_every_s=0.001",
                 "train.keep_last=10", "train.eval_every=0"]
    proc = run("pretrain.py", CONFIG, overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tags = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert tags == [f"step_{s:07d}" for s in (1, 2, 3, 4)]
    assert all(ckpt.check_tag(run_dir / "checkpoints" / t) is None for t in tags)
