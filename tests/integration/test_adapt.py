"""A run started from a foundation model's weights (`launch/pretrain.py --init SOURCE`, docs/adapt.md) on CPU
(gloo): preempted on 2 ranks while its backbone is still frozen (adapt.freeze_backbone_steps) and resumed on 1,
it ends where the uninterrupted run ends, the student and the exported teacher within 1e-6, at ZeRO-1 and at
ZeRO-3 (gradient checkpointing on in both: TINY's). The freeze, the backbone's warm-up after it are a function
of the step: the resumed run takes both up where the preempted one stopped. adapt.anchor on (DINOv2's Gram loss
against the source, pipeline/objectives/dino/anchor.py): the source it holds is in no checkpoint, the resume
reads it again from the recorded file."""

import pytest
import torch
from safetensors.torch import load_file

from pipeline.train import checkpoint as ckpt
from tests.integration.runs import TINY, metrics, run, run_and_signal, run_here, weights
from tests.integration.test_dino import DINO, assert_close
from tests.unit.recipe_runs import foreign_file

pytestmark = pytest.mark.dist
CONFIG = "configs/pretrain/dino_demo.yaml"
# Steps 0-4 frozen, 5-6 the backbone's lr ramping, 7 at the schedule's: the preemption (after step 4, checkpoint
# at step 4 or 5) falls in the freeze, so the resumed run ends it and runs the whole warm-up.
ADAPT = ["adapt.freeze_backbone_steps=5", "adapt.backbone_warmup_steps=2", "adapt.anchor=1.0", "deepspeed.bf16=false"]


def base(data, source, run_dir, zero, *extra):
    return [*TINY, *DINO, *ADAPT, f"adapt.init={source}", f"data.path={data}", f"run.dir={run_dir}",
            f"deepspeed.zero_stage={zero}", "train.steps=8", "train.ckpt_every=4", "train.eval_every=0",
            "train.keep_last=5", *extra]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """timm's ViT at TINY's architecture, random weights, with the config.yaml that says its heads."""
    return foreign_file("timm_vit", tmp_path_factory.mktemp("adapt") / "source").path


@pytest.fixture(scope="module")
def reference(shards, source, tmp_path_factory):
    """The uninterrupted run (2 ranks, ZeRO-1), shared by both stages."""
    ref_dir = tmp_path_factory.mktemp("adapt") / "ref"
    ref = run("pretrain.py", CONFIG, base(shards, source, ref_dir, 1), ranks=2)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    assert f"--init {source}: " in ref.stdout and "fresh: backbone.mask_token, dino_head" in ref.stdout
    assert ref.stdout.count("adapt.anchor: the source (the EMA teacher of step 0)") == 1
    anchor = [m["metrics"]["train/gram_loss"] for m in metrics(ref_dir) if "train/gram_loss" in m["metrics"]]
    # Not 0 while the backbone is frozen: the student sees iBOT's masked crops, the source the crops.
    assert len(anchor) == 4 and all(0 < a < 1 for a in anchor), anchor
    return ref_dir


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 3])
def test_an_init_run_preempted_in_its_freeze_on_2_ranks_resumes_on_1_and_ends_where_the_uninterrupted_run_ends(
        shards, source, reference, tmp_path, zero):
    run_dir = tmp_path / "preempted"
    code, out = run_and_signal("pretrain.py", CONFIG, base(shards, source, run_dir, zero), when="step 4/8")
    assert code == 75, out[-3000:]
    stopped = ckpt.newest_complete_tag(run_dir)
    assert stopped in (ckpt.tag_for(4), ckpt.tag_for(5)), stopped
    # The backbone frozen up to the preemption: the student's backbone in its checkpoint is still the file's.
    early = ckpt.consolidate(run_dir, stopped)
    file = {f"backbone.{k}": v for k, v in load_file(str(source)).items() if not k.startswith("head.")}
    assert file.keys() <= early.keys() and all(torch.equal(early[k], v) for k, v in file.items())
    resumed = run_here("pretrain.py", CONFIG, base(shards, source, run_dir, zero))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "layout changed (world size 2 -> 1)" in resumed.stdout
    assert f"{stopped}): it wins; adapt.anchor's frozen source is read again from {source}" in resumed.stdout
    assert_close(weights(reference), weights(run_dir))  # the exported teacher
    student, ref_student = ckpt.consolidate(run_dir), ckpt.consolidate(reference)
    assert_close(ref_student, student)
    # The backbone joined after the preemption: it moved between the checkpoint and the end.
    key = "backbone.blocks.0.attn.qkv.weight"
    assert not torch.equal(early[key], student[key])
    # The anchor is stored in no checkpoint (it never trains): the resume read it again from the recorded file
    # (reload_source, bit for bit the step-0 teacher: tests/unit/test_adapt.py), and the run ended as the reference.
    assert "adapt.anchor: the frozen source read again from adapt.init" in resumed.stdout
    for tag in (stopped, ckpt.newest_complete_tag(run_dir)):
        objective = ckpt.read_client_state(run_dir, tag)["objective"]
        assert "teacher" in objective and not [k for k in objective if "anchor" in k or "gram" in k], objective.keys()
