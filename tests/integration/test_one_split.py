"""A pretraining pile of one split (a folder of images, `--val-fraction 0`: train alone), judged by eval.sets: the
objective's own evaluation, which reads val, is skipped with one line, and eval.sets goes on, for MAE and DINOv3."""

import pytest
from PIL import Image

from pipeline.data.shards import folder_source, write_dataset
from pipeline.data.sources import synthetic_image
from tests.integration.runs import TINY, metrics, run_here
from tests.integration.test_dinov3 import DINOV3
from tests.integration.test_mae import MAE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def train_only(tmp_path_factory):
    """64 label-free images of `shards`' kind in one flat folder, written as a train split alone."""
    root = tmp_path_factory.mktemp("pile")
    (root / "images").mkdir()
    for i in range(64):
        Image.fromarray(synthetic_image(i, i % 4, 4, (16, 16))).save(root / "images" / f"{i:04d}.png")
    write_dataset(folder_source(str(root / "images"), val_fraction=0), root / "shards", max_samples_per_shard=32,
                  progress=False, log=lambda s: None)
    return root / "shards"


@pytest.mark.parametrize("config, recipe", [("configs/pretrain/mae_demo.yaml", MAE),
                                            ("configs/pretrain/dinov3_demo.yaml", DINOV3)], ids=["mae", "dinov3"])
def test_a_train_only_pile_is_judged_by_eval_sets_alone(config, recipe, train_only, shards, tmp_path):
    run_dir = tmp_path / "run"
    out = run_here("pretrain.py", config, [*TINY, *recipe, f"data.path={train_only}", f"eval.sets.synth={shards}",
                                           f"run.dir={run_dir}", "train.steps=2", "train.eval_every=0",
                                           "deepspeed.bf16=false"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (f"eval: {train_only} has no split 'val' (it has: train): the objective's own evaluation is skipped, "
            f"eval.sets (synth) judge the run") in out.stdout
    judged = [m for m in metrics(run_dir) if "eval/synth/knn_top1" in m["metrics"]]
    assert [m["step"] for m in judged] == [2]
    assert not any(k in judged[0]["metrics"] for k in ("eval/recon_loss", "eval/effective_rank"))
