"""DINOv3 pretraining end to end on CPU (gloo): with Gram anchoring (the Gram teacher copied from the EMA
teacher three times, twice after the preemption), preempted on 2 ranks and resumed on 1, it ends where the
uninterrupted run ends: the exported teacher, the student and the Gram teacher within 1e-6, at ZeRO-1 and at
ZeRO-3 (gradient checkpointing on in both: TINY's), with Sinkhorn-Knopp's targets (the step's global batch). A later stage (`--from RUN_DIR`, at other crop sizes)
starts from the finished run's student, teacher, Gram teacher and centres."""

import pytest
import torch

from pipeline.train import checkpoint as ckpt
from tests.integration.runs import TINY, WORKERS, metrics, run, run_and_signal, run_here, weights
from tests.integration.test_dino import assert_close, assert_equal

pytestmark = pytest.mark.dist
CONFIG = "configs/pretrain/dinov3_demo.yaml"
DINOV3 = ["model.objective=dinov3", "model.variant=dinov3_vits16", "deepspeed.bf16=false",
          "dinov3.local_crops_number=2", "dinov3.local_crops_size=8", "dinov3.head_n_prototypes=64",
          "dinov3.head_hidden_dim=32", "dinov3.head_bottleneck_dim=16", "dinov3.ibot_head_n_prototypes=48",
          "dinov3.ibot_head_bottleneck_dim=16", "dinov3.teacher_temp_warmup_steps=4",
          "dinov3.freeze_last_layer_steps=2", "dinov3.knn_train_samples=64", "dinov3.pca_images=0",
          "gram.loss_weight=1.0", "gram.start_step=2", "gram.update_every=3", "gram.max_updates=2",
          # No clipping: the global norm is summed over ZeRO partitions in a layout-dependent order (test_dino.py).
          "train.grad_clip=0.0"]
# Sinkhorn-Knopp (DINOv3's default) normalises over the step's global batch on any layout: 2 ranks of 1 micro
# batch and 1 rank of 2 give the same targets (pipeline/objectives/dino/targets.py; before, each round of micro
# batches apart: the ZeRO-1 and ZeRO-3 cases ended 2.3e-6 from the uninterrupted run, in gamma_2 of block 0).


def base(data, run_dir, steps=9, *extra):
    return [*TINY, *DINOV3, f"data.path={data}", f"run.dir={run_dir}", "deepspeed.zero_stage=1",
            f"train.steps={steps}", "train.ckpt_every=4", "train.eval_every=0", "train.keep_last=5", *extra]


def gram_teacher(run_dir) -> dict[str, torch.Tensor]:
    return ckpt.read_client_state(run_dir, ckpt.newest_complete_tag(run_dir))["objective"]["gram_teacher"]


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory):
    """The uninterrupted run (2 ranks, ZeRO-1), shared by the tests below."""
    ref_dir = tmp_path_factory.mktemp("dinov3") / "ref"
    ref = run("pretrain.py", CONFIG, base(shards, ref_dir), ranks=2)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    return ref_dir, ref.stdout


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 3])
def test_dinov3_with_gram_preempted_on_2_ranks_resumes_on_1_and_ends_where_the_uninterrupted_run_ends(
        shards, reference, tmp_path, zero):
    ref_dir, ref_out = reference
    copies = [line for line in ref_out.splitlines() if line.startswith("gram: the Gram teacher is")]
    assert [line.split("step ")[1].split(" ")[0] for line in copies] == ["2", "5", "8"]

    run_dir = tmp_path / "preempted"
    # At ZeRO-3 the student, the teacher and the Gram teacher are partitioned over the ranks, and the checkpoint
    # of 2 ranks is loaded by 1.
    stage = f"deepspeed.zero_stage={zero}"
    code, out = run_and_signal("pretrain.py", CONFIG, base(shards, run_dir, 9, stage), when="step 4/9")
    assert code == 75, out[-3000:]
    # At ZeRO-1 loader workers in the resumed run, none in the reference: the same crops.
    resumed = run_here("pretrain.py", CONFIG, base(shards, run_dir, 9, stage, *([WORKERS] if zero == 1 else [])))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "layout changed (world size 2 -> 1)" in resumed.stdout
    assert "gram: the Gram teacher is the EMA teacher of step 8" in resumed.stdout
    assert_close(weights(ref_dir), weights(run_dir))  # the exported teacher
    assert_close(ckpt.consolidate(ref_dir), ckpt.consolidate(run_dir))  # the student
    ref_gram, gram = gram_teacher(ref_dir), gram_teacher(run_dir)
    assert_close(ref_gram, gram)
    # The Gram teacher is the teacher of step 8, not the final one; saved whole (gathered) at ZeRO-3 too.
    assert not torch.equal(gram["blocks.0.attn.qkv.weight"], weights(run_dir)["blocks.0.attn.qkv.weight"])
    assert gram["blocks.0.attn.qkv.weight"].shape == ref_gram["blocks.0.attn.qkv.weight"].shape


@pytest.mark.slow
def test_a_later_stage_starts_from_the_finished_runs_student_teachers_and_centres(reference, shards, tmp_path):
    """The high-resolution stage's shape: `--from` the finished run at a larger model.img_size (RoPE: no
    position table), each step's crops drawn from dinov3.resolutions, the Gram teacher carried and kept."""
    ref_dir, _ = reference
    run_dir = tmp_path / "highres"
    # lr 0 and teacher momentum 1: the student and teacher stay what they start as, so what was carried can be
    # compared bit for bit; the steps still run every term (the Gram loss at the new sizes among them).
    stage = base(shards, run_dir, 2, "model.img_size=24", "gram.start_step=0", "gram.update_every=0",
                 "dinov3.momentum_teacher=1.0", "train.lr=0",
                 "dinov3.resolutions=[{global_crops_size: 24, local_crops_size: 8, gram_crops_size: 32, weight: 1}, "
                 "{global_crops_size: 32, local_crops_size: 12, weight: 1}]")
    out = run_here("pretrain.py", CONFIG, stage, extra=["--from", str(ref_dir)])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (f"dinov3.continue_from: {ref_dir}, checkpoint step_0000009: its student, teacher, centres, Gram "
            f"teacher are this run's start") in out.stdout
    assert "gram: the Gram teacher is" not in out.stdout  # carried, not copied again
    # The student, the teacher and the Gram teacher are the source's, bit for bit.
    assert_equal(ckpt.consolidate(ref_dir), ckpt.consolidate(run_dir))
    assert_equal(weights(ref_dir), weights(run_dir))
    assert_equal(gram_teacher(ref_dir), gram_teacher(run_dir))
    losses = [m["metrics"] for m in metrics(run_dir) if "train/gram_loss" in m["metrics"]]
    assert losses and all(m["train/gram_loss"] > 0 for m in losses)
