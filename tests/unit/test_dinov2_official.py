"""Meta's DINOv2 backbone files against the official code itself (facebookresearch/dinov2's
DinoVisionTransformer), with random weights saved as Meta saves them (torch.save(model.state_dict())).
Needs a checkout of that repository (it is not vendored here):

    DINOV2_OFFICIAL_REPO=/path/to/dinov2 .venv/bin/python -m pytest tests/unit/test_dinov2_official.py

Skipped without it. Without xFormers the official code falls back to plain PyTorch attention and MLPs
(it warns "xFormers is not available"); what it computes is the same. Checked: the file through our
`--from` path (launch/finetune.py's prepare_finetune) gives the official features, at the built size and,
for the register models (Meta's hub builds them with interpolate_antialias=True, interpolate_offset=0.0,
which is timm's and our resize), at another size; with masks (iBOT's mask_token); and the safetensors
that launch/export_weights.py writes from the file, loaded into timm's VisionTransformer, gives them too.
"""

from __future__ import annotations

import os
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from pipeline.model.layouts import convert_dinov2_state_dict
from pipeline.model.vit import VisionTransformer, model_kwargs_from_config
from pipeline.model.weights import load_weights
from pipeline.objectives import load_config
from pipeline.run.finetune import prepare_finetune

REPO = os.environ.get("DINOV2_OFFICIAL_REPO")
pytestmark = pytest.mark.skipif(
    not REPO or not (Path(REPO) / "dinov2" / "models" / "vision_transformer.py").is_file(),
    reason="set DINOV2_OFFICIAL_REPO to a checkout of facebookresearch/dinov2")

# Our SDPA against the official q @ k^T softmax: the same products summed in another order; with O(1)
# LayerScale and embeddings the features are O(1), and float32 leaves them within 1e-5 of each other.
ATOL = 1e-5


@pytest.fixture(scope="module")
def official():
    sys.path.insert(0, REPO)
    try:
        from dinov2.layers import MemEffAttention
        from dinov2.layers import NestedTensorBlock as Block
        from dinov2.models.vision_transformer import DinoVisionTransformer

        yield partial(DinoVisionTransformer, block_fn=partial(Block, attn_class=MemEffAttention))
    finally:
        sys.path.remove(REPO)
        for name in [n for n in sys.modules if n == "dinov2" or n.startswith("dinov2.")]:
            del sys.modules[name]


CASES = {
    # Meta's hub settings for the register models (hub/backbones.py: dinov2_vits14_reg).
    "reg4": dict(embed_dim=384, num_heads=6, depth=2, num_register_tokens=4, ffn_layer="mlp", block_chunks=0,
                 interpolate_antialias=True, interpolate_offset=0.0),
    # ViT-g's SwiGLU, narrow; chunked blocks as the training checkpoints have them.
    "swiglu": dict(embed_dim=128, num_heads=2, depth=3, num_register_tokens=0, ffn_layer="swiglufused",
                   block_chunks=3),
}


def meta_file(official, case, path):
    torch.manual_seed(0)
    model = official(img_size=42, patch_size=14, init_values=1e-5, **CASES[case]).eval()
    with torch.no_grad():  # O(1) LayerScale, tokens and positions: Meta's init has them near 0, hiding misplacement
        for name, p in model.named_parameters():
            if "gamma" in name or "token" in name or "pos_embed" in name:
                p.normal_()
    torch.save(model.state_dict(), path)
    return model


def official_tokens(model, x, masks=None):
    with torch.no_grad():
        out = model.forward_features(x, masks)
    return out["x_norm_clstoken"], out["x_norm_regtokens"], out["x_norm_patchtokens"]


@pytest.mark.parametrize("case", list(CASES))
def test_from_meta_file_gives_the_official_features(official, case, tmp_path):
    meta = meta_file(official, case, tmp_path / "dinov2_pretrain.pth")
    cfg = load_config(None, ["model.img_size=42", "model.num_classes=3", f"finetune.source={tmp_path / 'dinov2_pretrain.pth'}"])
    cfg, prepare = prepare_finetune(cfg, None)
    ours = VisionTransformer(**model_kwargs_from_config(cfg.model))
    prepare(ours)
    ours.eval()
    sizes = [42, 70] if case == "reg4" else [42]  # the non-register hub models resize differently (docs/model.md)
    for size in sizes:
        x = torch.randn(2, 3, size, size)
        with torch.no_grad():
            got = ours.forward_tokens(x)
        for a, b in zip((got.cls_token, got.reg_tokens, got.patch_tokens), official_tokens(meta, x)):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_masks_replace_patches_as_the_official_does(official, tmp_path):
    meta = meta_file(official, "reg4", tmp_path / "meta.pth")
    state, arch = convert_dinov2_state_dict(load_weights(tmp_path / "meta.pth"), keep_mask_token=True)
    ours = VisionTransformer(**arch, num_classes=0, mask_token=True).eval()
    ours.load_state_dict(state)
    x = torch.randn(2, 3, 42, 42)
    masks = torch.tensor([[True, False, True, False, False, False, False, False, True], [False] * 9])
    with torch.no_grad():
        got = ours.forward_tokens(x, masks)
    for a, b in zip((got.cls_token, got.reg_tokens, got.patch_tokens), official_tokens(meta, x, masks)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_exported_safetensors_in_timm_give_the_official_features(official, case, tmp_path):
    import timm
    from safetensors.torch import load_file
    from torch import nn

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "launch"))
    try:
        from export_weights import main as export_main
    finally:
        sys.path.pop(0)
    meta = meta_file(official, case, tmp_path / "meta.pth")
    assert export_main([str(tmp_path / "meta.pth"), "--out", str(tmp_path / "timm.safetensors")]) == 0
    state = load_file(str(tmp_path / "timm.safetensors"))
    if case == "reg4":
        theirs = timm.create_model("vit_small_patch14_reg4_dinov2", pretrained=False, img_size=42, depth=2,
                                   num_classes=0)
    else:  # timm's vit_giant_patch14_dinov2 block at this width: SwiGLUPacked with Meta's rounded hidden size
        hidden = state["blocks.0.mlp.fc1.weight"].shape[0]
        theirs = timm.models.vision_transformer.VisionTransformer(
            img_size=42, patch_size=14, embed_dim=128, depth=3, num_heads=2, init_values=1e-5, num_classes=0,
            mlp_ratio=hidden / 128, mlp_layer=timm.layers.SwiGLUPacked, act_layer=nn.SiLU)
    theirs.load_state_dict(state)
    theirs.eval()
    x = torch.randn(2, 3, 42, 42)
    with torch.no_grad():
        got = theirs.forward_features(x)
    expected = torch.cat([t if t.ndim == 3 else t[:, None] for t in official_tokens(meta, x)], dim=1)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_the_layout_tables_are_the_officials(official):
    """tests/unit/test_layouts.py's DINOv2 tables are the official state_dicts' keys and shapes: plain, with
    registers, SwiGLU in chunked blocks, and the DINO head beside a training checkpoint's backbone."""
    from dinov2.layers.dino_head import DINOHead

    from tests.unit.test_layouts import (
        DINO_HEAD,
        DINOV2,
        DINOV2_CHUNKED_SWIGLU,
        DINOV2_REG,
        DINOV2_SIZE,
        shapes,
    )

    size = DINOV2_SIZE
    common = dict(img_size=size["img"], patch_size=size["P"], embed_dim=size["D"], depth=size["L"], num_heads=2,
                  init_values=1.0)
    for table, kwargs, chunk in [(DINOV2, dict(ffn_layer="mlp", block_chunks=0), 1),
                                 (DINOV2_REG, dict(ffn_layer="mlp", block_chunks=0, num_register_tokens=size["R"]), 1),
                                 (DINOV2_CHUNKED_SWIGLU, dict(ffn_layer="swiglufused", block_chunks=2), 1)]:
        model = official(**common, **kwargs)
        assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == shapes(table, dict(size, per_chunk=chunk))
    head = DINOHead(in_dim=size["D"], out_dim=size["K"], hidden_dim=size["Hh"], bottleneck_dim=size["B"], nlayers=3)
    assert {k: tuple(v.shape) for k, v in head.state_dict().items()} == shapes(DINO_HEAD, size)
