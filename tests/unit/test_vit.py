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


# --- DINOv2's backbone options (LayerScale, registers, no_embed_class, SwiGLU, dynamic size) ---

def timm_dinov2_twin(timm_name, **kwargs):
    """timm's own DINOv2 model, random weights, small depth (timm.create_model with its registered args)."""
    import timm

    return timm.create_model(timm_name, pretrained=False, **kwargs)


@pytest.mark.parametrize("ours_name,timm_name,overrides", [
    ("vit_s14_reg4", "vit_small_patch14_reg4_dinov2", dict(depth=2)),
    ("vit_s14", "vit_small_patch14_dinov2", dict(depth=2)),
    # g/14's SwiGLU block at a small width: timm's SwiGLUPacked with its mlp_ratio.
    ("vit_g14", "vit_giant_patch14_dinov2", dict(depth=1, embed_dim=96, num_heads=2)),
])
def test_dinov2_variants_equal_timm_at_224_and_98(ours_name, timm_name, overrides):
    torch.manual_seed(0)
    theirs = timm_dinov2_twin(timm_name, img_size=224, num_classes=5, dynamic_img_size=True, **overrides).eval()
    ours = build_vit(ours_name, img_size=224, num_classes=5, **overrides).eval()
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    assert {k: v.shape for k, v in ours_sd.items()} == {k: v.shape for k, v in theirs_sd.items()}
    # LayerScale starts where timm's does (1e-5); load timm's random weights with gammas made O(1) so the
    # comparison exercises them, and with a non-trivial class/register/position table.
    theirs_sd = {k: (torch.randn_like(v) if k.endswith("gamma") or "token" in k or k == "pos_embed" else v)
                 for k, v in theirs_sd.items()}
    theirs.load_state_dict(theirs_sd)
    ours.load_state_dict(theirs_sd)
    with torch.no_grad():
        # The built size, and a DINOv2 local crop (98 px: Meta's ViT-L/14 recipe; 96 is no multiple of 14, which
        # Meta's and timm's patch embeddings both refuse) through the interpolated position table.
        for res in (224, 98):
            x = torch.randn(2, 3, res, res)
            # Same operations in the same order; only SDPA's kernel choice may differ: 1e-5 as above.
            torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)
            torch.testing.assert_close(ours.forward_features(x), theirs.forward_features(x), atol=1e-5, rtol=0)


def test_num_params_counts_zero3_placeholders_at_their_full_size():
    model = build_vit("vit_ti16", img_size=32, patch_size=8, depth=1, num_classes=2)
    full = sum(p.numel() for p in model.parameters())
    for p in model.parameters():  # what deepspeed.zero.Init leaves: a 1-D slice, DeepSpeed's attributes beside it
        p.ds_id, p.ds_shape = 0, p.shape
        p.data = p.data.reshape(-1)[:1]
    assert num_params(model) == full


def test_default_vit_has_none_of_the_dinov2_parameters():
    model = build_vit("vit_ti16", img_size=32, patch_size=8, depth=1, num_classes=2)
    names = set(model.state_dict())
    assert not {n for n in names if "ls1" in n or "ls2" in n or "reg_token" in n or "mask_token" in n}
    assert model.pos_embed.shape[1] == 1 + 16


def test_dinov2_variant_shapes_and_counts():
    with torch.device("meta"):
        for name, millions in [("vit_s14", 22), ("vit_b14", 86), ("vit_l14", 304), ("vit_g14", 1136)]:
            model = build_vit(name, img_size=518, num_classes=0)
            # DINOv2's Table 17/18 sizes: 21, 86, 300, 1100 M; timm's vit_*_patch14_dinov2 param counts.
            assert abs(num_params(model) / 1e6 - millions) / millions < 0.03, (name, num_params(model))
        reg = build_vit("vit_b14_reg4", img_size=518, num_classes=0)
    assert reg.reg_token.shape == (1, 4, 768) and reg.pos_embed.shape == (1, 37 * 37, 768)
    assert reg.blocks[0].ls1.gamma.shape == (768,)
    assert {"reg_token", "cls_token", "pos_embed"} <= reg.no_weight_decay()


def test_layer_scale_init_and_registers_init():
    torch.manual_seed(0)
    model = build_vit("vit_s14_reg4", img_size=28, depth=2, num_classes=0)
    assert torch.all(model.blocks[1].ls2.gamma == 1e-5)
    assert 0 < model.reg_token.std().item() < 1e-5


def test_forward_tokens_splits_cls_registers_patches():
    torch.manual_seed(0)
    model = build_vit("vit_s14_reg4", img_size=56, depth=1, num_classes=0).eval()
    x = torch.randn(2, 3, 42, 56)  # 3x4 patches, another size than built
    with torch.no_grad():
        out = model.forward_tokens(x)
        full = model.forward_features(x)
    assert out.cls_token.shape == (2, 384) and out.reg_tokens.shape == (2, 4, 384)
    assert out.patch_tokens.shape == (2, 12, 384) and out.prenorm.shape == (2, 17, 384)
    torch.testing.assert_close(torch.cat([out.cls_token[:, None], out.reg_tokens, out.patch_tokens], 1), full)


def test_masks_replace_patch_embeddings_by_the_mask_token():
    torch.manual_seed(0)
    model = build_vit("vit_s14", img_size=28, depth=1, num_classes=0, mask_token=True).eval()
    assert model.mask_token.shape == (1, 384) and model.mask_token.abs().sum() == 0  # Meta's zero init
    with torch.no_grad():
        model.mask_token.normal_()
    x = torch.randn(2, 3, 28, 28)
    masks = torch.tensor([[True, False, False, True], [False] * 4])
    tokens = model.prepare_tokens(x, masks)
    plain = model.prepare_tokens(x)
    pos = model.pos_embed[0, 1:]
    torch.testing.assert_close(tokens[0, 1 + 0], model.mask_token[0] + pos[0])
    torch.testing.assert_close(tokens[0, 1 + 3], model.mask_token[0] + pos[3])
    torch.testing.assert_close(tokens[0, 2:4], plain[0, 2:4])
    torch.testing.assert_close(tokens[1], plain[1])  # an all-False row changes nothing
    no_mask = build_vit("vit_s14", img_size=28, depth=1, num_classes=0)
    assert "mask_token" not in no_mask.state_dict()
    with pytest.raises(ValueError, match="mask_token=True"):
        no_mask.prepare_tokens(x, masks)


def test_dynamic_size_refuses_sizes_off_the_patch_grid():
    model = build_vit("vit_s14", img_size=28, depth=1, num_classes=0)
    with pytest.raises(ValueError, match="patch size 14"):
        model(torch.randn(1, 3, 30, 28))


@pytest.mark.parametrize("name", ["vit_s14_reg4", "vit_g14"])
def test_model_flops_counts_registers_and_swiglu(name):
    """model_flops against PyTorch's FlopCounterMode on a small model (matmuls, the patch conv, SDPA)."""
    from torch.utils.flop_counter import FlopCounterMode

    kwargs = variant_kwargs(name, img_size=56, depth=2, embed_dim=96, num_heads=2, num_classes=10)
    model = build_vit(name, **{k: v for k, v in kwargs.items() if k != "patch_size"}).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randn(1, 3, 56, 56))
    assert model_flops(kwargs) == pytest.approx(counter.get_total_flops(), rel=1e-6)


# Builds a DINOv2 variant as the trainer does (ZeRO-3: inside deepspeed.zero.Init) and saves the gathered
# weights and the decayed names. One subprocess per stage: zero.Init patches torch.
ZERO_BUILD = """
import json, sys
import deepspeed, torch
from pipeline.objectives import load_config
from pipeline.derived import deepspeed_config
from pipeline.dist import init_distributed
from pipeline.model.vit import model_kwargs_from_config
from pipeline.train.optim import no_weight_decay
from pipeline.run.trainer import build_model
init_distributed()
cfg = load_config(None, sys.argv[3:] + ["deepspeed.zero_stage=" + sys.argv[1]])
model = build_model(cfg, model_kwargs_from_config(cfg.model, 4), deepspeed_config(cfg, 1))
partitioned = any(hasattr(p, "ds_shape") for p in model.parameters())
with deepspeed.zero.GatheredParameters(list(model.parameters())):
    torch.save({n: p.detach().float().clone() for n, p in model.named_parameters()}, sys.argv[2])
print(json.dumps({"partitioned": partitioned,
                  "decayed": sorted(n for n, p in model.named_parameters() if not no_weight_decay(model, n, p))}))
"""


@pytest.mark.slow
def test_dinov2_variant_builds_under_zero3_init_with_the_seed_weights(tmp_path):
    import json
    import subprocess
    import sys

    from tests.integration.runs import ROOT, env, free_port

    tiny = ["model.variant=vit_s14_reg4", "model.img_size=28", "model.embed_dim=32", "model.depth=2",
            "model.num_heads=2", "model.num_classes=4", "deepspeed.bf16=false"]
    results, weights = {}, {}
    for stage in (0, 3):
        one_rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT)}
        out = subprocess.run([sys.executable, "-c", ZERO_BUILD, str(stage), str(tmp_path / f"{stage}.pt"), *tiny],
                             cwd=ROOT, env={**env(), **one_rank}, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        results[stage] = json.loads(out.stdout.strip().splitlines()[-1])
        weights[stage] = torch.load(tmp_path / f"{stage}.pt")
    assert results[3]["partitioned"] and not results[0]["partitioned"]
    assert weights[3].keys() == weights[0].keys()
    for name in weights[0]:
        torch.testing.assert_close(weights[3][name], weights[0][name], atol=0, rtol=0, msg=name)
    assert torch.all(weights[3]["blocks.1.ls2.gamma"] == 1e-5)  # LayerScale filled under zero.Init too
    assert weights[3]["reg_token"].abs().sum() > 0
    for stage in (0, 3):
        assert not any("gamma" in n or n in ("reg_token", "cls_token", "pos_embed") for n in results[stage]["decayed"])


def test_layer_decay_numbers_registers_and_mask_token_with_the_stem_and_gammas_with_their_block():
    from pipeline.train.optim import layer_id

    model = build_vit("vit_s14_reg4", img_size=28, depth=2, num_classes=3, mask_token=True)
    ids = {n: layer_id(n, model.group_matcher(), 2) for n, _ in model.named_parameters()}
    assert ids["reg_token"] == ids["mask_token"] == ids["cls_token"] == ids["pos_embed"] == 0
    assert ids["blocks.1.ls2.gamma"] == 2 and ids["norm.weight"] == ids["head.weight"] == 3


def conv_stem_vit(**overrides):
    kwargs = dict(img_size=28, patch_size=4, in_chans=1, embed_dim=64, depth=2, num_heads=2, num_classes=10,
                  stem="conv")
    return build_vit("vit_ti16", **{**kwargs, **overrides}), {**variant_kwargs("vit_ti16", **kwargs), **overrides}


def test_conv_stem_makes_the_patch_grid_and_is_counted_by_model_flops():
    """stem='conv' (Xiao et al.): the same 7x7 tokens from convolutions, its parameters in the stem's layer group,
    its multiply-adds in model_flops (against FlopCounterMode), and a sample's tokens independent of its batch."""
    from torch.utils.flop_counter import FlopCounterMode

    from pipeline.train.optim import layer_id

    model, kwargs = conv_stem_vit()
    model.eval()
    x = torch.randn(3, 1, 28, 28)
    assert model.patch_embed(x).shape == (3, 49, 64)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(x[:1])
    assert model_flops(kwargs) == pytest.approx(counter.get_total_flops(), rel=1e-6)
    assert model_flops(kwargs) > model_flops({**kwargs, "stem": "patch"})
    names = [n for n, _ in model.named_parameters() if n.startswith("patch_embed.")]
    assert len(names) == 11 and {layer_id(n, model.group_matcher(), 2) for n in names} == {0}  # 3 convs, 3 norms, 1x1 (w, b)
    with torch.no_grad():  # LayerNorm2d, not BatchNorm: the batch does not enter a sample's output
        torch.testing.assert_close(model(x)[:1], model(x[:1]), rtol=1e-5, atol=1e-6)


def test_conv_stem_is_refused_where_it_cannot_be(tmp_path):
    with pytest.raises(ValueError, match="power of 2"):
        conv_stem_vit(patch_size=7)
    with pytest.raises(ValueError, match="stem must be one of patch, conv"):
        conv_stem_vit(stem="convs")
    from pipeline.objectives import load_config
    from pipeline.typed_yaml import ConfigError

    with pytest.raises(ConfigError, match="model.stem.*'patch' with model.objective 'mae'"):
        load_config(None, ["model.objective=mae", "model.stem=conv"])
    from pipeline.model.vit import model_kwargs_from_config

    cfg = load_config(None, ["model.variant=dinov3_vits16", "model.stem=conv"])
    with pytest.raises(ConfigError, match="model.stem=conv with model.variant=dinov3_vits16"):
        model_kwargs_from_config(cfg.model, 10)


def test_a_conv_stem_file_is_recognised_and_a_patch_config_told_to_set_the_stem():
    """Our export of a conv-stem ViT is read back as ours (patch 4 from its two stride-2 convolutions), and a
    config that builds the patchify stem is told which key to set."""
    from pipeline.model.layouts import recognise

    model, kwargs = conv_stem_vit()
    found = recognise(model.state_dict(), "run", ours=True)
    assert found.arch == dict(patch_size=4, embed_dim=64, depth=2, stem="conv")
    assert found.mismatch(kwargs) is None
    assert "set model.stem=conv" in found.mismatch({**kwargs, "stem": "patch"})
    assert sorted(found.state) == sorted(model.state_dict())
