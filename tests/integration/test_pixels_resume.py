"""The exact-resume guarantee on C channels (issue 62): DINOv2 on 4-channel uint16 shards (its multi-crop on
C-channel tensors: crops, flips and blur drawn from each sample's seed, pipeline/data/multicrop.py), preempted
on 2 ranks and resumed on 1 with a loader worker, ends where the uninterrupted 1-rank run ends. DINOv2 is the
recipe with the most C-channel code of its own; the supervised and MAE recipes share the array reader and
ArrayCrop with it (tests/unit/test_pixels_read.py)."""

import pytest

from pipeline.train import checkpoint as ckpt
from tests.integration.runs import TINY, WORKERS, run, run_and_signal, weights
from tests.integration.test_dino import DINO, assert_close
from tests.unit.test_pixels_read import array_set

pytestmark = [pytest.mark.dist, pytest.mark.slow]
CONFIG = "configs/pretrain/dino_demo.yaml"


def base(data, run_dir, *extra):
    return [*TINY, *DINO, f"data.path={data}", "data.mean=null", "data.std=null", f"run.dir={run_dir}",
            "deepspeed.zero_stage=1", "deepspeed.bf16=false", "train.steps=8", "train.ckpt_every=4",
            "train.eval_every=0", "train.keep_last=5", "dino.pca_images=0", *extra]


def test_dino_on_four_channels_preempted_on_2_ranks_resumes_on_1_and_ends_where_the_uninterrupted_run_ends(
        tmp_path):
    shards = array_set(tmp_path, 4, "uint16", n=48)
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "preempted"
    ref = run("pretrain.py", CONFIG, base(shards, ref_dir), ranks=1)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    code, out = run_and_signal("pretrain.py", CONFIG, base(shards, run_dir), when="step 2/8")
    assert code == 75, out[-3000:]
    assert ckpt.newest_complete_tag(run_dir) is not None and not (run_dir / "model.safetensors").exists()
    resumed = run("pretrain.py", CONFIG, base(shards, run_dir, WORKERS), ranks=1)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "layout changed (world size 2 -> 1)" in resumed.stdout
    # The teacher (exported) and the student: as test_dino.py's, within float32 summation order (ZeRO-1 on 2
    # ranks reduces in another order than 1).
    assert weights(ref_dir)["patch_embed.proj.weight"].shape[1] == 4
    assert_close(weights(ref_dir), weights(run_dir))
    assert_close(ckpt.consolidate(ref_dir), ckpt.consolidate(run_dir))
