"""The model is the paper's ViT with timm's parameter names: equal state dicts, equal logits."""

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer as TimmViT

from pipeline.model.vit import VARIANTS, build_vit, model_flops, num_params, variant_kwargs

CASES = [
    # (variant, overrides): small depth keeps it fast, the block structure is what is compared
    ("vit_ti16", dict(img_size=224, num_classes=10)),
    ("vit_s16", dict(img_size=(224, 160), num_classes=7, depth=2)),  # non-square
    ("vit_b32", dict(img_size=96, num_classes=5, depth=2)),
    ("vit_h14", dict(img_size=56, num_classes=3, depth=1)),  # patch 14
]


def timm_twin(kwargs):
    return TimmViT(img_size=kwargs["img_size"], patch_size=kwargs["patch_size"], num_classes=kwargs["num_classes"],
                   embed_dim=kwargs["embed_dim"], depth=kwargs["depth"], num_heads=kwargs["num_heads"],
                   qkv_bias=True, class_token=True, global_pool="token")


@pytest.mark.parametrize("name,overrides", CASES)
def test_same_state_dict_and_logits_as_timm(name, overrides):
    torch.manual_seed(0)
    kwargs = variant_kwargs(name, **overrides)
    ours, theirs = build_vit(name, **overrides).eval(), timm_twin(kwargs).eval()
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    assert {k: v.shape for k, v in ours_sd.items()} == {k: v.shape for k, v in theirs_sd.items()}
    h, w = (kwargs["img_size"],) * 2 if isinstance(kwargs["img_size"], int) else kwargs["img_size"]
    x = torch.randn(2, 3, h, w)
    # ours -> timm
    theirs.load_state_dict(ours_sd)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), ours(x), atol=1e-5, rtol=0)
    # timm -> ours (fresh random timm weights)
    theirs = timm_twin(kwargs).eval()
    ours.load_state_dict(theirs.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name,paper_millions", [("vit_b16", 86), ("vit_l16", 307), ("vit_h14", 632)])
def test_parameter_counts_match_the_paper(name, paper_millions):
    with torch.device("meta"):  # no memory for H/14's 632M parameters
        model = build_vit(name, num_classes=1000)
    assert abs(num_params(model) / 1e6 - paper_millions) / paper_millions < 0.01


@pytest.mark.parametrize("name,res,gmacs", [("vit_b16", 224, 17.58), ("vit_l16", 224, 61.6), ("vit_b16", 384, 55.54)])
def test_flops_match_timm_published_gmacs(name, res, gmacs):
    flops = model_flops(variant_kwargs(name, num_classes=1000), res)
    assert abs(flops / 2 / 1e9 - gmacs) / gmacs < 0.005


def test_variants_cover_table1():
    assert {"vit_b16", "vit_b32", "vit_l16", "vit_l32", "vit_h14", "vit_ti16", "vit_s16"} <= set(VARIANTS)
    with pytest.raises(KeyError, match="vit_b16"):
        build_vit("vit_q16")


def test_grad_checkpointing_recomputes_with_same_gradients():
    torch.manual_seed(0)
    model = build_vit("vit_ti16", img_size=32, patch_size=8, depth=2, num_classes=4)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])

    def grads():
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads()
    model.set_grad_checkpointing(True)
    calls = []
    hook = model.blocks[0].mlp.fc1.register_forward_hook(lambda *a: calls.append(1))
    ckpt = grads()
    hook.remove()
    assert len(calls) == 2  # forward once, recomputed once in backward
    for a, b in zip(plain, ckpt):
        torch.testing.assert_close(a, b)


def test_reset_classifier_is_zero_and_drops_pre_logits():
    model = build_vit("vit_ti16", img_size=32, patch_size=8, depth=1, num_classes=10, representation_size=64)
    assert "pre_logits.fc.weight" in model.state_dict()
    model.reset_classifier(3)
    assert "pre_logits.fc.weight" not in model.state_dict()
    assert model.head.weight.shape == (3, 192) and model.head.weight.abs().sum() == 0
    assert model(torch.randn(1, 3, 32, 32)).abs().sum() == 0


def test_init_statistics():
    torch.manual_seed(0)
    model = build_vit("vit_s16", num_classes=10, depth=2)
    assert abs(model.pos_embed.std().item() - 0.02) < 0.002
    assert abs(model.blocks[0].mlp.fc1.weight.std().item() - 0.02) < 0.001
    assert model.blocks[0].mlp.fc1.bias.abs().sum() == 0


def test_wrong_input_size_is_a_clear_error():
    model = build_vit("vit_ti16", img_size=32, patch_size=8, depth=1, num_classes=2)
    with pytest.raises(ValueError, match="built for"):
        model(torch.randn(1, 3, 64, 64))
