"""DINOv2 pretraining end to end on CPU (gloo): preempted on 2 ranks, resumed on 1, it ends where the
uninterrupted run ends (teacher, student, centres and schedules restored); ZeRO-3 with gradient
checkpointing trains, its teacher an EMA of the student on each rank's shard, its prototypes still while
frozen; a run stopped before its export fine-tunes from its newest checkpoint's teacher backbone, the
tensors the run exports at that step (ZeRO-1 and ZeRO-3)."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipeline.objectives import load_config
from pipeline.objectives.dino.objective import DINOv2
from pipeline.run.finetune import find_source, source_state_dict
from pipeline.train import checkpoint as ckpt
from tests.integration.runs import (
    TINY,
    WORKERS,
    assert_sets_judged_alike,
    assert_teacher_not_collapsed,
    metrics,
    run,
    run_and_signal,
    run_here,
    weights,
)

pytestmark = pytest.mark.dist
CONFIG = "configs/pretrain/dino_demo.yaml"
DINO = ["model.objective=dinov2", "dino.local_crops_number=2", "dino.local_crops_size=8",
        "dino.head_n_prototypes=64", "dino.head_hidden_dim=32", "dino.head_bottleneck_dim=16",
        "dino.teacher_temp_warmup_steps=4", "dino.freeze_last_layer_steps=2", "dino.knn_train_samples=64",
        "dino.pca_images=4", "train.layer_decay=0.9",
        # No clipping: the global norm is summed over ZeRO partitions in a layout-dependent order (DeepSpeed),
        # which moves a clipped update by ~1e-7 between 2 ranks and 1; the objective itself is exact.
        "train.grad_clip=0.0"]


def base(data, run_dir, zero, steps=12, *extra):
    return [*TINY, *DINO, f"data.path={data}", f"run.dir={run_dir}", f"deepspeed.zero_stage={zero}",
            f"train.steps={steps}", "train.ckpt_every=4", "train.eval_every=0", "train.keep_last=5", *extra]


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=atol), f"{k}: max |diff| {(a[k] - b[k]).abs().max().item()}"


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: max |diff| {(a[k] - b[k]).abs().max().item()}"


@pytest.mark.slow
def test_dino_preempted_on_2_ranks_resumes_on_1_and_ends_where_the_uninterrupted_run_ends(shards, label_free,
                                                                                          noisy_labels, tmp_path):
    # Pretrained on shards without labels, judged at every evaluation on a labelled set (eval.sets).
    fp32 = ["deepspeed.bf16=false", f"eval.sets.synth={noisy_labels}", "train.eval_every=4"]
    ref_dir = tmp_path / "ref"
    # The prototypes frozen past the preemption: the 1-rank resume (a universal load, which gives every
    # parameter group group 0's values) must put them back at lr 0 for steps 4 and 5.
    fp32 += ["dino.freeze_last_layer_steps=6"]
    ref = run("pretrain.py", CONFIG, base(label_free, ref_dir, 1, 12, *fp32), ranks=2)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]

    run_dir = tmp_path / "preempted"
    code, out = run_and_signal("pretrain.py", CONFIG, base(label_free, run_dir, 1, 12, *fp32), when="step 4/12")
    assert code == 75, out[-3000:]
    assert not (run_dir / "model.safetensors").exists()
    # Stopped before its export, it fine-tunes (a supervised ViT, class-token head) at twice the resolution
    # from its newest checkpoint's teacher backbone, not from DeepSpeed's module (the student).
    ft_dir = tmp_path / "finetune"
    ft = run_here("finetune.py", "configs/finetune/demo.yaml",
                  [*TINY, f"data.path={shards}", f"run.dir={ft_dir}", "train.steps=2", "train.eval_every=0"],
                  extra=["--from", str(run_dir), "--res", "32"])
    assert ft.returncode == 0, ft.stdout[-3000:] + ft.stderr[-3000:]
    stopped_at = ckpt.newest_complete_tag(run_dir)  # the preemption's own checkpoint (step 4 or 5)
    assert f"the teacher's backbone of its newest complete checkpoint, {stopped_at}" in ft.stdout
    tuned = weights(ft_dir)
    assert tuned["pos_embed"].shape == (1, 65, 32) and "head.weight" in tuned  # 8x8 grid + class token

    # Loader workers in the resumed run, none in the reference: the same crops.
    resumed = run_here("pretrain.py", CONFIG, base(label_free, run_dir, 1, 12, *fp32, WORKERS))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "layout changed (world size 2 -> 1)" in resumed.stdout
    # The exported teacher (an EMA over every step, its centres and schedules resumed) and the student.
    assert_close(weights(ref_dir), weights(run_dir))
    assert_close(ckpt.consolidate(ref_dir), ckpt.consolidate(run_dir))
    teacher, student = weights(run_dir), ckpt.consolidate(run_dir)
    assert {"cls_token", "pos_embed", "mask_token", "norm.weight"} <= teacher.keys()
    assert not any(k.startswith(("dino_head.", "backbone.")) for k in teacher)  # the backbone alone, timm's names
    # The teacher is an EMA, not a copy: it lags the student.
    assert not torch.equal(teacher["blocks.0.attn.qkv.weight"], student["backbone.blocks.0.attn.qkv.weight"])
    logged = [m["metrics"] for m in metrics(ref_dir) if "train/loss" in m["metrics"]]
    assert len(logged) == 6 and all(np.isfinite(m["train/loss"]) for m in logged)
    # Each logged window's terms (2 ranks, averaged) sum to its loss; the teacher's targets did not collapse.
    terms = ("dino_global_crops_loss", "dino_local_crops_loss", "ibot_loss", "koleo_loss")
    for m in logged:
        assert sum(m[f"train/{t}"] for t in terms) == pytest.approx(m["train/loss"], rel=1e-5), m
        assert_teacher_not_collapsed(m["train/dino_teacher_entropy"], 64)
    # eval.sets' k-NN of the teacher on the labelled set at every evaluation: the same figures on 1 rank
    # after the resume as on 2 uninterrupted (steps 8 and 12); the label-free shards give no k-NN of their own.
    evals, _ = assert_sets_judged_alike(run_dir, ref_dir, "eval/samples")
    assert "eval/knn_top1" not in evals[12]
    assert (run_dir / "pca" / "step00000012.png").is_file()
    # What a fine-tune reads from a checkpoint is, bit for bit, what the run exports at that step.
    assert_equal(DINOv2.weights_from_checkpoint(run_dir, ckpt.tag_for(12), load_config(run_dir / "config.yaml")),
                 teacher)


@pytest.mark.slow
def test_dino_at_zero3_with_gradient_checkpointing_trains_its_teacher_on_each_shard(shards, tmp_path):
    run_dir = tmp_path / "zero3"
    out = run("pretrain.py", CONFIG, base(shards, run_dir, 3, 8, "train.log_every=2", "train.eval_every=8",
                                          "model.grad_checkpointing=true", "dino.ibot_separate_head=true",
                                          "dino.freeze_last_layer_steps=4", "train.ckpt_every=2"),
              ranks=2)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # The prototypes at lr 0 for steps 0-3 (DeepSpeed's ZeRO-3 bf16 optimizer, weight decay on): the same
    # after steps 2 and 4, moved by step 6; the rest of the head moves throughout.
    at = {step: ckpt.consolidate(run_dir, ckpt.tag_for(step)) for step in (2, 4, 6)}
    for key in [f"{h}.last_layer.weight_{w}" for h in ("dino_head", "ibot_head") for w in "gv"]:
        assert torch.equal(at[2][key], at[4][key]) and not torch.equal(at[4][key], at[6][key]), key
    assert not torch.equal(at[2]["dino_head.mlp.0.weight"], at[4]["dino_head.mlp.0.weight"])
    losses = [m["metrics"]["train/loss"] for m in metrics(run_dir) if "train/loss" in m["metrics"]]
    assert len(losses) == 4 and all(np.isfinite(losses))
    teacher, student = weights(run_dir), ckpt.consolidate(run_dir)
    assert teacher["pos_embed"].shape == (1, 17, 32)  # gathered from the partitions: full shapes
    assert "ibot_head.last_layer.weight_v" in student
    # The EMA ran on the shards: the teacher moved between the checkpoints of steps 2 and 8 (each holds it
    # whole, gathered) but not onto the student.
    early = ckpt.read_client_state(run_dir, ckpt.tag_for(2))["objective"]["teacher"]
    key = "blocks.1.mlp.fc1.weight"
    early_key = next(k for k in early if k.endswith(key))
    assert early[early_key].shape == teacher[key].shape
    assert not torch.equal(teacher[key], early[early_key]) and not torch.equal(teacher[key], student[f"backbone.{key}"])
    # The teacher is float32 while the student trains in bf16: an EMA at momentum 0.992-1 kept in bf16 would
    # hold only bf16 values (and round most updates away).
    assert not torch.equal(teacher[key], teacher[key].bfloat16().float())
    assert (run_dir / "pca" / "step00000008.png").is_file()
    # Its last checkpoint holds the teacher whole (gathered from the shards before the save): without the
    # export, `--from RUN_DIR` reads from it, bit for bit, the backbone the run exported at that step.
    (run_dir / "model.safetensors").rename(tmp_path / "exported.safetensors")
    assert_equal(source_state_dict(find_source(str(run_dir))), teacher)
    # launch/export_weights.py writes it too (the teacher, not DeepSpeed's module: the student).
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "launch"))
    try:
        from export_weights import main as export_main
    finally:
        sys.path.pop(0)
    assert export_main([str(run_dir), "--out", str(tmp_path / "again.safetensors")]) == 0
    assert_equal(load_file(str(tmp_path / "again.safetensors")), teacher)
