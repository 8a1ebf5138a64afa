"""Feature distillation end to end on CPU (gloo): a teacher in Meta's DINOv2 layout (patch 8: its 2x2 grid resized
to the students' 4x4) distilled into two ViT students on one teacher forward (TINY's and a narrower one at half
the lr: distill.students[1].lr_scale), preempted on 2 ranks and resumed on 1, at ZeRO-1 and at ZeRO-3 (the
student and the teacher partitioned; gradient checkpointing on in both: TINY's), ends where the uninterrupted
2-rank ZeRO-1 run ends: each student's export and the whole trained model (its projections too) within 1e-6. The checkpoints
hold the teacher's digest and none of its weights; continuing the run against another teacher is refused in one
line."""

from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.train import checkpoint as ckpt
from tests.integration.runs import TINY, run, run_and_signal, run_here, weights
from tests.integration.test_dino import assert_close
from tests.unit.test_layouts import DINOV2, random_tensors, sizes

pytestmark = pytest.mark.dist
CONFIG = "configs/pretrain/distill_demo.yaml"


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("teacher") / "dinov2_vits8_pretrain.pth"
    torch.save(random_tensors(DINOV2, sizes(img=16, P=8, D=48, L=2)), path)
    return path


def base(data, run_dir, teacher, *extra):
    # No clipping: the global norm is summed over ZeRO partitions in a layout-dependent order (test_dino.py).
    return [*TINY, "model.objective=distill", f"distill.teacher={teacher}", "distill.knn_train_samples=64",
            "deepspeed.bf16=false", "train.grad_clip=0.0", f"data.path={data}", f"run.dir={run_dir}",
            "deepspeed.zero_stage=1", "train.steps=8", "train.ckpt_every=4", "train.eval_every=0", STUDENTS,
            f"eval.sets.syn={data}", "eval.memory_samples=64", *extra]  # each student judged, the teacher at step 0


# Two ViT students on one teacher forward (one engine): TINY's and a narrower one.
STUDENTS = "distill.students=[{name: tiny}, {name: narrow, model: {embed_dim: 16, num_heads: 1}, lr_scale: 0.5}]"


@pytest.mark.slow
def test_distill_preempted_on_2_ranks_resumes_on_1_at_zero1_and_zero3_and_ends_where_the_uninterrupted_run_ends(
        shards, teacher, tmp_path):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "preempted"
    ref = run("pretrain.py", CONFIG, base(shards, ref_dir, teacher), ranks=2)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    # eval.sets: the teacher at step 0, each student at the end, under its name (the ZeRO-3 run: the teacher gathered)
    teacher_line = next(x for x in ref.stdout.splitlines() if "eval step 0 | teacher/syn k-NN top-1" in x)
    teacher_line = teacher_line.split("| ")[-1]  # "teacher/syn k-NN top-1 NN.NN%"
    assert "tiny/syn k-NN top-1" in ref.stdout and "narrow/syn k-NN top-1" in ref.stdout, ref.stdout[-3000:]
    # ZeRO-1: preempted on 2 ranks, resumed on 1; every student within 1e-6 of the uninterrupted run.
    zero1_dir = tmp_path / "zero1"
    code, out = run_and_signal("pretrain.py", CONFIG, base(shards, zero1_dir, teacher), when="step 4/8")
    assert code == 75, out[-3000:]
    resumed = run_here("pretrain.py", CONFIG, base(shards, zero1_dir, teacher))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "layout changed (world size 2 -> 1)" in resumed.stdout
    assert_close(ckpt.consolidate(ref_dir), ckpt.consolidate(zero1_dir))  # every student, projections too
    for name in ("tiny", "narrow"):
        assert_close(weights(ref_dir / "students" / name), weights(zero1_dir / "students" / name))
    zero3 = "deepspeed.zero_stage=3"
    code, out = run_and_signal("pretrain.py", CONFIG, base(shards, run_dir, teacher, zero3), when="step 4/8")
    assert code == 75, out[-3000:]
    first = [x for x in out.splitlines() if "eval step 0 | teacher/syn" in x]
    assert first and first[0].split("| ")[-1] == teacher_line, (first, teacher_line)  # ZeRO-3's gathered teacher
    resumed = run_here("pretrain.py", CONFIG, base(shards, run_dir, teacher, zero3))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "layout changed (world size 2 -> 1)" in resumed.stdout
    assert_close(weights(ref_dir), weights(run_dir))  # the exported student backbone
    assert_close(ckpt.consolidate(ref_dir), ckpt.consolidate(run_dir))  # the trained model, projections too
    for name in ("tiny", "narrow"):  # every student's export
        assert_close(weights(ref_dir / "students" / name), weights(run_dir / "students" / name))
    state = ckpt.read_client_state(run_dir, ckpt.newest_complete_tag(run_dir))["objective"]
    assert set(state) == {"teacher_digest", "teacher_source"}
    assert not any(k.startswith(("teacher", "module.teacher")) for k in ckpt.consolidate(run_dir))
    # Continued against another teacher: refused in one line before a step, exit 1.
    other = teacher.with_name("other.pth")
    torch.save({k: v + 1 for k, v in torch.load(teacher).items()}, other)
    refused = run_here("pretrain.py", CONFIG, base(shards, run_dir, other, zero3, "train.steps=12"))
    assert refused.returncode == 1, refused.stdout[-3000:] + refused.stderr[-3000:]
    line = [x for x in (refused.stdout + refused.stderr).splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "distilled from another teacher" in line[0], line
    assert "step 9/12" not in refused.stdout


# A ViT student beside a timm CNN (BatchNorm's running statistics: pipeline/train/step_norm.py).
WITH_CNN = "distill.students=[{name: tiny}, {name: cnn, timm: resnet10t, kwargs: {output_stride: 8}}]"


@pytest.mark.slow
def served_equals_embed(uri: str, model_uri: str, weights: Path, shards: Path) -> None:
    """The registered MLflow Model (pipeline/tracking/served.py), loaded as a serving stack loads it, gives the
    vectors launch/embed.py computes from the same weights for a val shard's images (test_served_model.py serves
    one over HTTP)."""
    import mlflow

    from pipeline.config import DataConfig
    from pipeline.data import dataset_info_of, tario
    from pipeline.data.transforms import BatchNormalizer, eval_transform
    from pipeline.eval.features import embedding
    from pipeline.model.variants import pair
    from pipeline.run.backbone import load_backbone

    backbone = load_backbone(weights)
    shard = dataset_info_of(DataConfig(path=str(shards))).split("val").shards[0]
    decoded = [tario.sample_image(r) for r in tario.iter_raw_samples(str(shards / shard))]
    size = pair(backbone.kwargs["img_size"])
    transform, normalize = eval_transform(backbone.data, size), BatchNormalizer(backbone.data.mean, backbone.data.std)
    batch = torch.stack([normalize(x := transform(img), out=torch.empty(x.shape[0], *size)) for img in decoded])
    with torch.no_grad():
        want = embedding(backbone.model.forward_features(batch), backbone.model)
    mlflow.set_tracking_uri(uri)
    try:
        got = mlflow.pyfunc.load_model(model_uri).predict(np.stack([np.asarray(img) for img in decoded]))
    finally:
        mlflow.set_tracking_uri(None)
    dim = backbone.model.embed_dim
    assert np.array_equal(got["cls"], want[:, :dim].numpy()) and np.array_equal(got["mean_patch"], want[:, dim:].numpy())


def test_a_cnn_students_batchnorm_statistics_are_layout_free_preempted_on_2_ranks_resumed_on_1(
        shards, teacher, tmp_path):
    """Each rank used to keep its own running statistics (num_batches_tracked counting forwards: 2 apart after
    this resume); now one update per step from the global batch: the resumed run's CNN, buffers included, ends
    where the uninterrupted 2-rank run's does, and every rank holds the same buffers."""
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "preempted"
    ref = run("pretrain.py", CONFIG, base(shards, ref_dir, teacher, WITH_CNN), ranks=2)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    code, out = run_and_signal("pretrain.py", CONFIG, base(shards, run_dir, teacher, WITH_CNN), when="step 4/8")
    assert code == 75, out[-3000:]
    # Resumed with MLflow on and tracking.register: each student is served as its own registered model too.
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    resumed = run_here("pretrain.py", CONFIG, [*base(shards, run_dir, teacher, WITH_CNN), "tracking.enabled=true",
                                               "tracking.register=distilled"], extra_env={"MLFLOW_TRACKING_URI": uri})
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "layout changed (world size 2 -> 1)" in resumed.stdout
    for name in ("distilled", "distilled-tiny", "distilled-cnn"):
        assert f"registered {name} version 1 (models:/{name}/1)" in resumed.stdout, resumed.stdout[-3000:]
    served_equals_embed(uri, "models:/distilled-cnn/1", run_dir / "students" / "cnn" / "model.safetensors", shards)
    ref_cnn, cnn = weights(ref_dir / "students" / "cnn"), weights(run_dir / "students" / "cnn")
    tracked = [k for k in cnn if k.endswith("num_batches_tracked")]
    assert tracked and all(int(cnn[k]) == int(ref_cnn[k]) == 8 for k in tracked)  # one per step: 8 steps
    assert_close(ref_cnn, cnn)  # weights and running statistics
    assert_close(weights(ref_dir / "students" / "tiny"), weights(run_dir / "students" / "tiny"))
