"""A DINOv3 ViT saved by timm's own class fine-tuned end to end: launch/finetune.py --from FILE at another
resolution (RoPE: nothing to resize) under ZeRO-3, then launch/export_weights.py on the run's checkpoint,
whose file loads into timm's class and gives timm's features."""

import subprocess

import pytest
import timm
import torch
from safetensors.torch import load_file

from pipeline.model.dinov3 import DINOv3ViT
from pipeline.model.variants import variant_kwargs
from pipeline.model.weights import save_weights
from tests.integration.runs import PYTHON, ROOT, TINY, env, metrics, run_here, weights

pytestmark = pytest.mark.slow

# TINY without its architecture: the file decides it, and a disagreeing model.* key would be refused.
ARCH = ("model.variant=", "model.patch_size=", "model.embed_dim=", "model.depth=", "model.num_heads=")
DATA_AND_TRAIN = [o for o in TINY if not o.startswith(ARCH)]


def test_finetune_a_timm_dinov3_file_and_export_it_back_to_timm(tmp_path, shards):
    torch.manual_seed(0)
    source = timm.create_model("vit_small_patch16_dinov3", pretrained=False, embed_dim=64, depth=2, num_heads=1,
                               num_classes=0)
    save_weights(source.state_dict(), tmp_path / "dinov3.safetensors")
    ft_dir = tmp_path / "ft"
    ft = run_here("finetune.py", "configs/finetune/demo.yaml",
                  [*DATA_AND_TRAIN, f"data.path={shards}", f"run.dir={ft_dir}", "train.steps=2", "train.eval_every=0",
                   "deepspeed.bf16=false", "deepspeed.zero_stage=3"], extra=["--from", str(tmp_path / "dinov3.safetensors"), "--res", "32"])
    assert ft.returncode == 0, ft.stdout[-3000:] + ft.stderr[-3000:]
    assert "timm's DINOv3 ViT, patch 16, width 64, depth 2, 1 heads, mlp MLP, LayerScale on, 4 registers" in ft.stdout
    assert "RoPE: no position table to resize, the 2x2 grid's positions are computed as it runs" in ft.stdout
    assert any("train/loss" in m["metrics"] for m in metrics(ft_dir))

    out = subprocess.run([PYTHON, "launch/export_weights.py", str(ft_dir), "--out", str(tmp_path / "w.safetensors")],
                         cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    exported = load_file(str(tmp_path / "w.safetensors"))
    assert exported.keys() == weights(ft_dir).keys()  # what the trainer exported at its end, from the checkpoint
    theirs = timm.create_model("vit_small_patch16_dinov3", pretrained=False, embed_dim=64, depth=2, num_heads=1,
                               num_classes=4, global_pool="token").eval()
    theirs.load_state_dict(exported)  # strict: every key of timm's class, no other
    ours = DINOv3ViT(**variant_kwargs("dinov3_vits16", embed_dim=64, depth=2, num_heads=1, num_classes=4,
                                      qkv_bias=False)).eval()
    ours.load_state_dict(exported)
    assert exported["head.weight"].abs().sum() > 0  # trained from its zero start
    x = torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        torch.testing.assert_close(theirs.forward_features(x), ours.forward_features(x), atol=1e-5, rtol=0)
        torch.testing.assert_close(theirs(x), ours(x), atol=1e-5, rtol=0)
