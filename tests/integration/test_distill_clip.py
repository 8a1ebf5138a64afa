"""train.grad_clip with several students clips each student's gradient by its own norm (pipeline/train/ds_step.py:
`clip_apart`), so that a student trained beside another ends exactly where it ends alone, clipping on, at every
ZeRO stage, bf16 and fp32. Before, DeepSpeed's one norm over all students clipped each by its siblings' too.
1-rank runs in pytest's process (runs.run_here): the subject is the optimizer's step, not the process."""

import pytest
import torch

from pipeline.train import ds_step
from tests.integration import test_distill
from tests.integration.runs import TINY, run_here, weights

pytestmark = pytest.mark.slow
CONFIG = test_distill.CONFIG
teacher = test_distill.teacher  # its fixture: a teacher file in Meta's DINOv2 layout
NARROW = "{name: narrow, model: {embed_dim: 16, num_heads: 1}}"


def distil(data, run_dir, teacher, students: str, *extra: str):
    done = run_here("pretrain.py", CONFIG, [
        *TINY, "model.objective=distill", f"distill.teacher={teacher}", f"distill.students=[{students}]",
        f"data.path={data}", f"run.dir={run_dir}", "train.steps=4", "train.ckpt_every=0", "train.eval_every=0",
        "train.grad_clip=0.02", *extra])  # far below the students' norms: every step clips
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


# Each of DeepSpeed's optimizer wrappers: ZeRO-0 fp32 (the engine clips), ZeRO-0 bf16 (FP16_UnfusedOptimizer),
# ZeRO-1/2 (DeepSpeedZeroOptimizer), ZeRO-1 bf16 accumulating in fp32 (BF16_Optimizer), ZeRO-3; the ZeRO ones
# with the read-free step (train.check_finite off, the default) and ZeRO-3 with DeepSpeed's own (on).
FP32_ACCUM = "deepspeed.extra={data_types: {grad_accum_dtype: fp32}}"


@pytest.mark.parametrize("zero,bf16,extra,wrapper", [
    (0, "false", (), "AdamW"), (0, "true", (), "FP16_UnfusedOptimizer"), (1, "true", (), "DeepSpeedZeroOptimizer"),
    (1, "true", (FP32_ACCUM,), "BF16_Optimizer"),
    (3, "false", ("train.check_finite=true",), "DeepSpeedZeroOptimizer_Stage3")])
def test_each_student_is_clipped_by_its_own_norm_and_ends_as_alone(shards, teacher, tmp_path, monkeypatch, zero, bf16,
                                                                   extra, wrapper):
    layout = (f"deepspeed.zero_stage={zero}", f"deepspeed.bf16={bf16}", *extra)
    wrappers, real = [], ds_step.clip_apart
    monkeypatch.setattr(ds_step, "clip_apart", lambda engine, sets: (wrappers.append(type(engine.optimizer).__name__),
                                                                     real(engine, sets)))
    distil(shards, tmp_path / "both", teacher, "{name: tiny}, " + NARROW, *layout)
    assert wrappers == [wrapper]  # the path this case is for, installed once (the run alone: one student, none)
    distil(shards, tmp_path / "alone", teacher, NARROW, *layout)
    both, alone = weights(tmp_path / "both" / "students" / "narrow"), weights(tmp_path / "alone")
    assert both.keys() == alone.keys()
    for k in both:
        assert torch.equal(both[k], alone[k]), k  # bit for bit: its norm, its clip, its step
