"""The ViT step's GPU options, proven on the CPU: `model.patch_embed_impl: matmul` (the patch projection as one
matmul on the unfolded patches) equals the timm-exact convolution within float rounding, for every backbone
class and under ZeRO-3; `train.compile_mode` reaches torch.compile (docs/performance.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pipeline.config import ConfigError, load_config
from pipeline.model.dinov3 import DINOv3ViT
from pipeline.model.mae import MaskedAutoencoderViT
from pipeline.model.vit import VisionTransformer, model_kwargs_from_config
from pipeline.run.step import compile_kwargs

TINY = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2)


def _pair(cls: type[torch.nn.Module], **kwargs) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    conv = cls(**TINY, **kwargs)
    matmul = cls(**TINY, **kwargs, patch_embed_impl="matmul")
    assert matmul.state_dict().keys() == conv.state_dict().keys()  # the same names: files load either way
    matmul.load_state_dict(conv.state_dict())
    return conv, matmul


@pytest.mark.parametrize("cls,kwargs", [(VisionTransformer, {"num_classes": 5}),
                                        (DINOv3ViT, {"num_classes": 5, "reg_tokens": 2}),
                                        (MaskedAutoencoderViT, {"decoder_embed_dim": 32, "decoder_depth": 1,
                                                                "decoder_num_heads": 2})])
def test_matmul_patch_embedding_equals_the_convolution_forward_and_backward(cls, kwargs):
    conv, matmul = _pair(cls, **kwargs)
    x = torch.randn(3, 3, 32, 32)
    a, b = conv.patch_embed(x), matmul.patch_embed(x)
    assert b.is_contiguous()  # (B, N, D) straight from the matmul: no copy on the way out
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    (a.square().sum()).backward()
    (b.square().sum()).backward()
    for name in ("weight", "bias"):
        torch.testing.assert_close(getattr(matmul.patch_embed.proj, name).grad,
                                   getattr(conv.patch_embed.proj, name).grad, rtol=1e-4, atol=1e-4)
    if cls is not MaskedAutoencoderViT:
        torch.testing.assert_close(matmul.forward_features(x), conv.forward_features(x), rtol=1e-4, atol=1e-4)


def test_matmul_patch_embedding_in_bf16_is_within_bf16_rounding_and_takes_other_grids():
    conv, matmul = _pair(VisionTransformer, num_classes=5, dynamic_img_size=True)
    x = torch.randn(2, 3, 48, 40)  # another grid than the built one (dynamic_img_size: DINO's local crops)
    ref = conv.patch_embed(x)
    with torch.autocast("cpu", torch.bfloat16):
        got = matmul.patch_embed(x)
    assert got.shape == ref.shape == (2, 30, 64)
    assert (got.float() - ref).abs().max() <= 2 ** -6 * ref.abs().max()  # bf16's 8-bit mantissa, a sum of 192


def test_patch_embed_impl_is_a_config_key_outside_the_architecture():
    cfg = load_config(None, ["model.variant=vit_ti16", "model.patch_embed_impl=matmul", "model.num_classes=3"])
    kwargs = model_kwargs_from_config(cfg.model)
    assert kwargs["patch_embed_impl"] == "matmul" and "patch_embed_impl" not in VisionTransformer.ARCH_KEYS
    default = model_kwargs_from_config(load_config(None, ["model.variant=vit_ti16", "model.num_classes=3"]).model)
    assert "patch_embed_impl" not in default  # recorded only where it is not the default: no run changes
    with pytest.raises(ConfigError, match="patch_embed_impl"):
        load_config(None, ["model.patch_embed_impl=im2col"])


def test_compile_mode_reaches_torch_compile():
    assert compile_kwargs("default") == {}
    assert compile_kwargs("max-autotune-no-cudagraphs") == {"mode": "max-autotune-no-cudagraphs"}
    with pytest.raises(ConfigError, match="compile_mode"):
        load_config(None, ["train.compile_mode=fastest"])


ZERO3 = """
import json, sys, torch
from benchmarks.common import BenchSpec
from benchmarks.engine import build_engine
spec = BenchSpec("vit_ti16", res=32, batch=2, dtype="fp32", num_classes=5)
torch.manual_seed(0)
x = torch.randn(2, 3, 32, 32)
out = {}
for impl in ("conv", "matmul"):
    engine = build_engine(spec, 3, ["model.embed_dim=64", "model.depth=2", "model.num_heads=2",
                                    f"model.patch_embed_impl={impl}"])
    assert engine.zero_optimization_stage() == 3
    out[impl] = engine(x).detach().tolist()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_matmul_patch_embedding_under_zero3_gathers_its_weight():
    """ZeRO-3 gathers a module's parameters when that module runs: the matmul runs in the projection's own
    forward, so the partitioned weight is whole there (one rank, gloo, a process of its own)."""
    from tests.integration.runs import ROOT, free_port

    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", ZERO3], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])
    torch.testing.assert_close(torch.tensor(out["matmul"]), torch.tensor(out["conv"]), rtol=1e-5, atol=1e-5)
