"""DINOv3 against Meta's: a file in Meta's release layout (dinov3/models/vision_transformer.py's names) fine-tunes
and gives the reference's features, and the Gram loss and the Sinkhorn-Knopp targets are Meta's.

Always: the file is written from a table of Meta's keys and shapes (META_TOP, META_BLOCK) out of a timm
`vit_*_patch16_dinov3` model's random tensors, so timm's features are the reference. With a checkout of
facebookresearch/dinov3 (not vendored here; Meta's DINOv3 License):

    DINOV3_OFFICIAL_REPO=/path/to/dinov3 .venv/bin/python -m pytest tests/unit/test_dinov3_official.py

the table is checked against the official model's state dict, a file made by the official code from random
weights fine-tunes with the official model's features, and GramLoss, DINOLoss's and iBOTPatchLoss's
Sinkhorn-Knopp are compared with the official classes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from pipeline.model.layouts import LayoutError, recognise
from pipeline.objectives.dino.loss import DINOLoss, iBOTPatchLoss
from pipeline.objectives.dinov3.gram_loss import GramLoss
from tests.unit.test_dino_official import one_rank_group
from tests.unit.test_dinov3 import TINY
from tests.unit.test_dinov3_weights import fine_tune, timm_file

REPO = os.environ.get("DINOV3_OFFICIAL_REPO")
official_only = pytest.mark.skipif(
    not REPO or not (Path(REPO) / "dinov3" / "loss" / "gram_loss.py").is_file(),
    reason="set DINOV3_OFFICIAL_REPO to a checkout of facebookresearch/dinov3")

D, R, P = TINY["embed_dim"], 4, 16  # width, storage tokens, patch: the hub's ViT-S/16 and S+/16 at width 128
HEADS = TINY["num_heads"]
# Meta's DinoVisionTransformer.state_dict() for the hub's dinov3_vits16 / dinov3_vits16plus (mask_k_bias, LayerScale,
# 4 storage tokens), outside the blocks and per block: the key -> its shape. H: the MLP's hidden width.
META_TOP = {"cls_token": (1, 1, D), "storage_tokens": (1, R, D), "mask_token": (1, D),
            "patch_embed.proj.weight": (D, 3, P, P), "patch_embed.proj.bias": (D,),
            "rope_embed.periods": (D // HEADS // 4,), "norm.weight": (D,), "norm.bias": (D,)}
META_BLOCK = {"norm1.weight": (D,), "norm1.bias": (D,), "attn.qkv.weight": (3 * D, D), "attn.qkv.bias": (3 * D,),
              "attn.qkv.bias_mask": (3 * D,), "attn.proj.weight": (D, D), "attn.proj.bias": (D,), "ls1.gamma": (D,),
              "norm2.weight": (D,), "norm2.bias": (D,), "ls2.gamma": (D,)}
META_MLP = {"mlp": {"mlp.fc1.weight": ("H", D), "mlp.fc1.bias": ("H",), "mlp.fc2.weight": (D, "H"), "mlp.fc2.bias": (D,)},
            "swiglu": {"mlp.w1.weight": ("H", D), "mlp.w1.bias": ("H",), "mlp.w2.weight": ("H", D), "mlp.w2.bias": ("H",),
                       "mlp.w3.weight": (D, "H"), "mlp.w3.bias": (D,)}}
# Where each of timm's (our) names is in Meta's layout.
TO_META = {"reg_token": "storage_tokens", "gamma_1": "ls1.gamma", "gamma_2": "ls2.gamma", "mlp.fc1_g.": "mlp.w1.",
           "mlp.fc1_x.": "mlp.w2.", "mlp.fc2.": "mlp.w3."}


def meta_table(mlp: str, hidden: int, depth: int) -> dict[str, tuple]:
    table = dict(META_TOP)
    for i in range(depth):
        for key, shape in {**META_BLOCK, **META_MLP[mlp]}.items():
            table[f"blocks.{i}.{key}"] = tuple(hidden if s == "H" else s for s in shape)
    return table


def to_meta(state: dict[str, torch.Tensor], swiglu: bool) -> dict[str, torch.Tensor]:
    """timm's DINOv3 state dict in Meta's release layout: the renames of TO_META, one qkv.bias with a zero key
    third and its bias_mask, the RoPE periods (base 100), iBOT's mask token and a local_cls_norm, as the
    7B's file has them (random: fine-tuning leaves both out)."""
    out = {}
    for key, value in state.items():
        if key.endswith(".attn.q_bias"):
            prefix = key[: -len("q_bias")]
            out[prefix + "qkv.bias"] = torch.cat([value, torch.zeros_like(value), state[prefix + "v_bias"]])
            out[prefix + "qkv.bias_mask"] = torch.cat([torch.ones(D), torch.zeros(D), torch.ones(D)])
            continue
        if key.endswith(".attn.v_bias") or key.startswith("head."):
            continue
        for ours, meta in TO_META.items():
            if swiglu or not ours.startswith("mlp."):
                key = key.replace(ours, meta)
        out[key] = value
    head = D // HEADS
    out["rope_embed.periods"] = 100.0 ** (2 * torch.arange(head // 4, dtype=torch.float32) / (head // 2))
    out["mask_token"] = torch.randn(1, D)
    out["local_cls_norm.weight"], out["local_cls_norm.bias"] = torch.rand(D), torch.randn(D)
    return out


@pytest.mark.parametrize("name", ["vit_small_patch16_dinov3_qkvb", "vit_small_plus_patch16_dinov3_qkvb"])
def test_a_file_in_metas_layout_from_its_table_fine_tunes_with_the_references_features(tmp_path, capsys, name):
    torch.manual_seed(0)
    swiglu = "plus" in name
    theirs, state = timm_file(tmp_path / "timm.pth", name)
    meta = to_meta(state, swiglu)
    hidden = state["blocks.0.mlp.fc1_g.weight" if swiglu else "blocks.0.mlp.fc1.weight"].shape[0]
    table = meta_table("swiglu" if swiglu else "mlp", hidden, TINY["depth"])
    assert {k: tuple(v.shape) for k, v in meta.items() if not k.startswith("local_cls_norm")} == table
    torch.save(meta, tmp_path / "dinov3_pretrain.pth")
    kwargs, model = fine_tune(tmp_path / "dinov3_pretrain.pth", (48, 64))
    out = capsys.readouterr().out
    assert "Meta's DINOv3 backbone, patch 16, width 128, depth 2, 2 heads" in out
    assert "left out: mask_token (iBOT's), local_cls_norm (training only)" in out
    assert (kwargs["num_heads"], kwargs["mlp_layer"], kwargs["reg_tokens"]) == (HEADS, "swiglu" if swiglu else "mlp", R)
    x = torch.randn(2, 3, 48, 64)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(x), theirs.forward_features(x), atol=1e-5, rtol=0)


def test_what_metas_layout_holds_that_dinov3vit_cannot_is_refused_with_the_reason(tmp_path):
    torch.manual_seed(0)
    _, state = timm_file(tmp_path / "timm.pth", "vit_small_patch16_dinov3_qkvb")
    meta = to_meta(state, swiglu=False)
    for change, said in (
        (lambda s: s.update({"blocks.0.attn.qkv.bias_mask": torch.ones(3 * D)}), "is not mask_k_bias's"),
        (lambda s: s.update({"cls_norm.weight": torch.ones(D), "cls_norm.bias": torch.zeros(D)}), "cls_norm"),
        (lambda s: s.update({"rope_embed.periods": s["rope_embed.periods"] * 3}), "not RoPE base 100"),
        (lambda s: s.pop("blocks.1.ls2.gamma"), "blocks.1.* and blocks.0.* have different keys"),
    ):
        broken = dict(meta)
        change(broken)
        with pytest.raises(LayoutError, match=f"Meta's DINOv3 backbone .*{said}"):
            recognise(broken, "x.pth")
    # Without a mask, a key bias of zero is what mask_k_bias gives; any other is refused.
    unmasked = {k: v for k, v in meta.items() if not k.endswith("bias_mask")}
    assert recognise(unmasked).layout == "Meta's DINOv3 backbone"
    unmasked["blocks.0.attn.qkv.bias"] = unmasked["blocks.0.attn.qkv.bias"] + 1
    with pytest.raises(LayoutError, match="has a key bias"):
        recognise(unmasked)


# ----------------------------------------------------------------------------- against Meta's code


@pytest.fixture(scope="module")
def official():
    sys.path.insert(0, REPO)
    try:
        import dinov3.loss
        import dinov3.models.vision_transformer

        yield dinov3
    finally:
        sys.path.remove(REPO)
        for name in [n for n in sys.modules if n == "dinov3" or n.startswith("dinov3.")]:
            del sys.modules[name]


def official_model(official, ffn: str):
    vit = official.models.vision_transformer.DinoVisionTransformer(
        patch_size=P, embed_dim=D, depth=TINY["depth"], num_heads=HEADS, ffn_ratio=6 if ffn == "swiglu" else 4,
        qkv_bias=True, layerscale_init=1e-5, norm_layer="layernormbf16", ffn_layer=ffn, n_storage_tokens=R,
        mask_k_bias=True, untie_global_and_local_cls_norm=True, pos_embed_rope_dtype="fp32")
    vit.init_weights()
    with torch.no_grad():  # away from the init's zeros and ones, so that a misplaced tensor shows
        for p in vit.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return vit.eval()


@official_only
@pytest.mark.parametrize("ffn", ["mlp", "swiglu"])
def test_a_file_made_by_the_official_code_fine_tunes_with_the_official_features(official, tmp_path, ffn):
    torch.manual_seed(0)
    vit = official_model(official, ffn)
    state = vit.state_dict()
    hidden = state["blocks.0.mlp.w1.weight" if ffn == "swiglu" else "blocks.0.mlp.fc1.weight"].shape[0]
    expected = meta_table(ffn, hidden, TINY["depth"])
    assert {k: tuple(v.shape) for k, v in state.items() if not k.startswith("local_cls_norm")} == expected
    torch.save(state, tmp_path / "official.pth")
    _, model = fine_tune(tmp_path / "official.pth", (64, 48))
    x = torch.randn(2, 3, 64, 48)
    with torch.no_grad():
        ref = vit.forward_features(x)
        ours = model.forward_tokens(x)
    torch.testing.assert_close(ours.cls_token, ref["x_norm_clstoken"], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.reg_tokens, ref["x_storage_tokens"], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.patch_tokens, ref["x_norm_patchtokens"], atol=1e-5, rtol=0)


@official_only
@pytest.mark.parametrize("kwargs", [dict(remove_neg=False), dict(remove_neg=True), dict(apply_norm=False, remove_neg=False),
                                    dict(remove_neg=False, remove_only_teacher_neg=True)])
@pytest.mark.parametrize("img_level", [True, False])
def test_gram_loss_and_its_gradient_are_metas(official, kwargs, img_level):
    torch.manual_seed(0)
    s = torch.randn(3, 10, 16, requires_grad=True)
    t = torch.randn(3, 10, 16)
    theirs = official.loss.GramLoss(**kwargs)(s, t, img_level=img_level)
    (grad_theirs,) = torch.autograd.grad(theirs, s)
    mine = GramLoss(**kwargs)(s, t, img_level=img_level)
    (grad_mine,) = torch.autograd.grad(mine, s)
    torch.testing.assert_close(mine, theirs, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(grad_mine, grad_theirs, atol=1e-8, rtol=1e-5)


@official_only
def test_sinkhorn_knopp_targets_are_metas(official):
    torch.manual_seed(0)
    teacher = torch.randn(12, 40) * 0.5
    theirs = official.loss.DINOLoss(40).sinkhorn_knopp_teacher(teacher, teacher_temp=0.05)
    torch.testing.assert_close(DINOLoss(40).sinkhorn_knopp_teacher(teacher, teacher_temp=0.05), theirs, atol=1e-6, rtol=0)
    patches = torch.randn(30, 40) * 0.5
    with one_rank_group():  # Meta's iBOT Sinkhorn-Knopp all-reduces without asking
        # The module uncompiled (iBOTPatchLoss compiles it, which needs a C compiler here for nothing).
        theirs = official.loss.ibot_patch_loss.SinkhornKnoppTeacher()(patches, 0.05, torch.tensor(30))
        mine = iBOTPatchLoss(40).sinkhorn_knopp_teacher(patches, 0.05, torch.tensor(30))
    torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)
