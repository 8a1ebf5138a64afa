"""MAE pretraining end to end on CPU (gloo): preempted on 2 ranks, resumed on 1, it ends where the
uninterrupted run ends; ZeRO-3 with gradient checkpointing trains on label-free shards; a supervised run
on those shards stops with one line."""

import json
import shutil
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.data.sources import synthetic_image
from pipeline.model.mae import sincos_pos_embed_2d
from tests.integration.runs import (
    PYTHON,
    ROOT,
    TINY,
    assert_same_weights,
    metrics,
    run,
    run_and_signal,
    weights,
)

pytestmark = pytest.mark.dist
CONFIG = "configs/pretrain/mae_demo.yaml"
MAE = ["model.objective=mae", "mae.decoder_embed_dim=16", "mae.decoder_depth=1", "mae.decoder_num_heads=2",
       "mae.knn_train_samples=64", "mae.recon_images=4", "train.grad_clip=0.0"]


@pytest.fixture(scope="module")
def label_free(tmp_path_factory):
    """A folder of images without class folders, written as shards by make_shards."""
    root = tmp_path_factory.mktemp("unlabelled")
    images = root / "images"
    images.mkdir()
    for i in range(160):
        Image.fromarray(synthetic_image(i, i % 4, 4, (16, 16))).save(images / f"{i:04d}.png")
    out = root / "shards"
    subprocess.run([PYTHON, str(ROOT / "launch/make_shards.py"), "--source", f"folder:{images}", "--out", str(out),
                    "--max-samples-per-shard", "40", "--no-progress"], check=True, cwd=ROOT)
    assert json.loads((out / "dataset.json").read_text())["num_classes"] == 0
    return out


def base(data, run_dir, zero, steps=12, *extra):
    return [*TINY, *MAE, f"data.path={data}", f"run.dir={run_dir}", f"deepspeed.zero_stage={zero}",
            f"train.steps={steps}", "train.ckpt_every=4", "train.eval_every=0", "train.keep_last=5", *extra]


def test_mae_preempted_on_2_ranks_resumes_on_1_and_ends_where_the_uninterrupted_run_ends(shards, tmp_path):
    fp32 = ["deepspeed.bf16=false"]
    ref_dir = tmp_path / "ref"
    ref = run("pretrain.py", CONFIG, base(shards, ref_dir, 1, 12, *fp32), ranks=2)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]

    run_dir = tmp_path / "preempted"
    code, out = run_and_signal("pretrain.py", CONFIG, base(shards, run_dir, 1, 12, *fp32), when="step 4/12")
    assert code == 75, out[-3000:]
    assert not (run_dir / "model.safetensors").exists()
    resumed = run("pretrain.py", CONFIG, base(shards, run_dir, 1, 12, *fp32), ranks=1)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "layout changed (world size 2 -> 1)" in resumed.stdout
    # Same masks (from each sample's global position), same samples, same updates: the same weights.
    assert_same_weights(weights(ref_dir), weights(run_dir))
    exported = weights(run_dir)  # Meta's layout, the fixed tables included (exact float32)
    assert {"decoder_pred.weight", "mask_token", "pos_embed", "decoder_pos_embed"} <= exported.keys()
    assert torch.equal(exported["pos_embed"], sincos_pos_embed_2d(32, 4))
    # The evaluation: reconstruction loss, a k-NN top-1 (the synthetic shards have labels), the image.
    final = [m["metrics"] for m in metrics(run_dir) if "eval/recon_loss" in m["metrics"]][-1]
    ref_final = [m["metrics"] for m in metrics(ref_dir) if "eval/recon_loss" in m["metrics"]][-1]
    assert final["eval/recon_loss"] == ref_final["eval/recon_loss"] and "eval/knn_top1" in final
    assert (run_dir / "reconstructions" / "step00000012.png").is_file()

    # Its encoder fine-tunes (as a supervised ViT, the decoder left out) at twice the resolution.
    ft_dir = tmp_path / "finetune"
    ft = run("finetune.py", "configs/finetune/demo.yaml",
             [*TINY, f"data.path={shards}", f"run.dir={ft_dir}", "train.steps=2", "train.eval_every=0"],
             ranks=1, extra=["--from", str(run_dir), "--res", "32"])
    assert ft.returncode == 0, ft.stdout[-3000:] + ft.stderr[-3000:]
    assert "ours (an MAE run's MaskedAutoencoderViT)" in ft.stdout and "left out: the decoder" in ft.stdout
    assert weights(ft_dir)["pos_embed"].shape == (1, 65, 32)  # 8x8 grid + class token

    # And a linear probe trains only its head on the frozen encoder.
    probe_dir = tmp_path / "probe"
    probe = run("finetune.py", "configs/finetune/demo.yaml",
                [*TINY, f"data.path={shards}", f"run.dir={probe_dir}", "train.steps=2", "train.eval_every=0",
                 "deepspeed.bf16=false"],  # frozen weights stay as loaded (bf16 would round them)
                ranks=1, extra=["--from", str(run_dir), "--res", "16", "--probe"])
    assert probe.returncode == 0, probe.stdout[-3000:] + probe.stderr[-3000:]
    assert "linear probe:" in probe.stdout
    probed = weights(probe_dir)
    assert_same_weights({k: v for k, v in probed.items() if k.startswith("blocks.")},
                        {k: v for k, v in exported.items() if k.startswith("blocks.")})  # the encoder did not move
    assert "head.1.weight" in probed
    # The probe's BatchNorm statistics are exported with it (2 steps of momentum 0.1 moved them off 0).
    assert int(probed["head.0.num_batches_tracked"]) > 0 and probed["head.0.running_mean"].abs().sum() > 0


def test_mae_at_zero3_with_gradient_checkpointing_trains_on_label_free_shards(label_free, tmp_path):
    run_dir = tmp_path / "zero3"
    out = run("pretrain.py", CONFIG, base(label_free, run_dir, 3, 16, "train.log_every=4",
                                          "model.grad_checkpointing=true"), ranks=2)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    losses = [m["metrics"]["train/loss"] for m in metrics(run_dir) if "train/loss" in m["metrics"]]
    assert len(losses) == 4 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    final = [m["metrics"] for m in metrics(run_dir) if "eval/recon_loss" in m["metrics"]][-1]
    assert "eval/knn_top1" not in final  # no labels: no k-NN
    w = weights(run_dir)  # consolidated from ZeRO-3 partitions: full shapes
    assert w["decoder_pred.weight"].shape == (4 * 4 * 3, 16) and w["pos_embed"].shape == (1, 17, 32)
    assert (run_dir / "reconstructions" / "step00000016.png").is_file()


def test_supervised_run_on_label_free_shards_stops_with_one_line(label_free, tmp_path):
    out = run("pretrain.py", "configs/pretrain/demo.yaml",
              [*TINY, f"data.path={label_free}", f"run.dir={tmp_path / 'sup'}", "train.steps=2"], ranks=1)
    assert out.returncode == 1
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no labels" in errors[0] and "model.objective=mae" in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    shutil.rmtree(tmp_path / "sup", ignore_errors=True)
