"""The exact-resume guarantee on C channels (issue 62): each recipe on uint16 array shards, preempted on 2 ranks
and resumed on 1, ends where the uninterrupted 1-rank run ends. DINOv2 on 4 channels (its multi-crop on C-channel
tensors: crops, flips and blur drawn from each sample's seed, pipeline/data/multicrop.py; resumed with a loader
worker); supervised, MAE (masks and the pixel target of P x P x 1) and DINOv3 with Gram anchoring on 1 channel.
Each uninterrupted run is also the recipe's "trains a few steps" on that set (model.in_chans, finite losses); the
other channel count of each recipe trains in tests/unit/test_pixels_read.py."""

import math

import pytest

from pipeline.train import checkpoint as ckpt
from tests.integration.runs import TINY, WORKERS, metrics, run_and_signal, run_here, weights
from tests.integration.test_dino import DINO, assert_close
from tests.integration.test_dinov3 import gram_teacher
from tests.unit.test_pixels_read import DINOV3, MAE, array_set

pytestmark = [pytest.mark.dist, pytest.mark.slow]
STEPS = 6  # 36 train samples, 16 a step: the resumed steps (after 3) cross an epoch's end
RECIPES = {  # name -> (config, its overrides, the set's channels, the resumed run's extra overrides)
    "dinov2-4ch": ("configs/pretrain/dino_demo.yaml", [*DINO, "dino.pca_images=0"], 4, [WORKERS]),
    "supervised-1ch": ("configs/pretrain/demo.yaml", ["train.grad_clip=0.0"], 1, []),
    "mae-1ch": ("configs/pretrain/mae_demo.yaml", MAE, 1, []),
    # DINOv2's centring: DINOv3's Sinkhorn-Knopp normalises over one accumulation round of all ranks, which
    # depends on the layout (tests/integration/test_dinov3.py).
    "dinov3-1ch-gram": ("configs/pretrain/dinov3_demo.yaml", [*DINOV3, "dinov3.centering=centering"], 1, []),
}


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """channels -> a labelled uint16 array set of 48 images, written once for the module."""
    made = {}

    def get(channels: int):
        if channels not in made:
            made[channels] = array_set(tmp_path_factory.mktemp(f"ch{channels}"), channels, "uint16", n=48)
        return made[channels]

    return get


def base(data, run_dir, recipe, *extra):
    # No clipping (recipe lists): the global norm is summed over ZeRO partitions in a layout-dependent order.
    return [*TINY, *recipe, f"data.path={data}", "data.mean=null", "data.std=null", f"run.dir={run_dir}",
            "deepspeed.zero_stage=1", "deepspeed.bf16=false", f"train.steps={STEPS}", "train.ckpt_every=3",
            "train.eval_every=0", "train.keep_last=5", *extra]


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_recipe_on_c_channels_preempted_on_2_ranks_resumes_on_1_and_ends_where_the_uninterrupted_run_ends(
        sets, tmp_path, name):
    config, recipe, channels, resume_extra = RECIPES[name]
    shards = sets(channels)
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "preempted"
    ref = run_here("pretrain.py", config, base(shards, ref_dir, recipe))
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    # It trained on the set's channels: the model's, every loss finite.
    assert f"in_chans: {channels}" in (ref_dir / "config.yaml").read_text()
    assert weights(ref_dir)["patch_embed.proj.weight"].shape[1] == channels
    losses = [m["metrics"]["train/loss"] for m in metrics(ref_dir) if "train/loss" in m["metrics"]]
    assert len(losses) == STEPS // 2 and all(map(math.isfinite, losses)), losses

    code, out = run_and_signal("pretrain.py", config, base(shards, run_dir, recipe), when=f"step 2/{STEPS}",
                               launcher="deepspeed")
    assert code == 75, out[-3000:]
    assert ckpt.newest_complete_tag(run_dir) is not None and not (run_dir / "model.safetensors").exists()
    resumed = run_here("pretrain.py", config, base(shards, run_dir, recipe, *resume_extra))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "layout changed (world size 2 -> 1)" in resumed.stdout
    # The export (a DINO run's teacher, MAE's encoder and decoder), the whole model (the student and its heads) and
    # DINOv3's Gram teacher (the objective's state, copied at step 2: before the preemption's checkpoint): as
    # test_dino.py's, within float32 summation order (ZeRO-1 on 2 ranks reduces in another order than 1).
    assert_close(weights(ref_dir), weights(run_dir))
    assert_close(ckpt.consolidate(ref_dir), ckpt.consolidate(run_dir))
    if "gram" in name:
        assert_close(gram_teacher(ref_dir), gram_teacher(run_dir))
