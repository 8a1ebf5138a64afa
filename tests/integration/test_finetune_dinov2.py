"""Fine-tuning one of Meta's DINOv2 backbone files end to end through launch/finetune.py --from FILE.pth.

The file is written in Meta's layout by hand (tests/unit/test_weights.py's meta_dinov2_file), so this runs
without the official repository; tests/unit/test_dinov2_official.py compares with the official code."""

import pytest
import torch

from pipeline.model.vit import build_vit
from tests.integration.runs import TINY, metrics, run_here, weights
from tests.unit.test_weights import meta_dinov2_file

pytestmark = pytest.mark.slow

# TINY without its architecture: the file decides it, and a disagreeing model.* key would be refused.
ARCH = ("model.variant=", "model.patch_size=", "model.embed_dim=", "model.depth=", "model.num_heads=")
DATA_AND_TRAIN = [o for o in TINY if not o.startswith(ARCH)]


def test_finetune_and_probe_a_meta_dinov2_file(tmp_path, shards):
    torch.manual_seed(0)
    source = build_vit("vit_s14_reg4", img_size=28, embed_dim=64, num_heads=1, depth=2, num_classes=0)
    meta = meta_dinov2_file(source, tmp_path / "dinov2_vits14_reg4_pretrain.pth")
    common = [*DATA_AND_TRAIN, f"data.path={shards}", "train.steps=2", "train.eval_every=0", "deepspeed.bf16=false"]
    ft_dir = tmp_path / "ft"
    ft = run_here("finetune.py", "configs/finetune/demo.yaml", [*common, f"run.dir={ft_dir}"],
                  extra=["--from", str(tmp_path / "dinov2_vits14_reg4_pretrain.pth"), "--res", "42"])
    assert ft.returncode == 0, ft.stdout[-3000:] + ft.stderr[-3000:]
    assert "Meta's DINOv2 backbone, patch 14, width 64, depth 2, 1 heads, mlp MLP, LayerScale on, 4 registers, " \
           "trained at 28 px" in ft.stdout
    assert "position embeddings 4 -> 3x3 grid tokens" in ft.stdout
    tuned = weights(ft_dir)
    assert tuned["pos_embed"].shape == (1, 9, 64) and tuned["reg_token"].shape == (1, 4, 64)
    assert "blocks.1.ls2.gamma" in tuned and "mask_token" not in tuned
    assert any("train/loss" in m["metrics"] for m in metrics(ft_dir))

    probe_dir = tmp_path / "probe"
    probe = run_here("finetune.py", "configs/finetune/demo.yaml", [*common, f"run.dir={probe_dir}"],
                     extra=["--from", str(tmp_path / "dinov2_vits14_reg4_pretrain.pth"), "--res", "28", "--probe"])
    assert probe.returncode == 0, probe.stdout[-3000:] + probe.stderr[-3000:]
    assert "linear probe:" in probe.stdout
    probed = weights(probe_dir)
    for name in ("blocks.0.attn.qkv.weight", "blocks.1.ls1.gamma", "reg_token"):  # the frozen encoder, as loaded
        assert torch.equal(probed[name], meta[name.replace("reg_token", "register_tokens")]), name
