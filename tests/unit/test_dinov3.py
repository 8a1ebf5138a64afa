"""The DINOv3 backbone (pipeline/model/dinov3.py, rope.py) against timm's own DINOv3 ViTs (timm.models.eva.Eva as
`vit_*_patch16_dinov3[_qkvb]` builds it): the same state dicts both ways, the same features at two resolutions,
the same RoPE augmentation for the same draw; its FLOPs against PyTorch's counter; its build under zero.Init."""

import re

import pytest
import timm
import torch

from pipeline.model.dinov3 import VARIANTS, DINOv3ViT, build_dinov3
from pipeline.model.rope import IDENTITY, RopeAugment, patch_coords, rope_periods
from pipeline.model.variants import dinov3_flops, variant_kwargs
from pipeline.model.vit import num_params

TINY = dict(embed_dim=128, depth=2, num_heads=2)  # 64-wide heads, as every released DINOv3 ViT but the 7B's
# timm's name -> our constructor arguments for the same model (global_pool and the head as the case sets).
TIMM = {
    "vit_small_patch16_dinov3": dict(qkv_bias=False),  # no qkv bias, GELU MLP
    "vit_small_plus_patch16_dinov3_qkvb": dict(qkv_bias=True, mlp_layer="swiglu", swiglu_align_to=8),
}


def randomised(state):
    """Every tensor random, of a size that keeps activations O(1): LayerScale's 1e-5 gammas would hide the
    blocks, and the zero q/v biases and storage tokens the tested parts."""
    return {k: torch.randn_like(v) / (v[0].numel() ** 0.5 if v.ndim > 1 and k.endswith("weight") else 1)
            for k, v in state.items()}


def timm_dinov3(name, **kwargs):
    """timm's own model at a tiny width, every tensor random."""
    model = timm.create_model(name, pretrained=False, **TINY, **kwargs)
    model.load_state_dict(randomised(model.state_dict()))
    return model.eval()


def ours_for(name, **kwargs):
    return DINOv3ViT(img_size=64, **TINY, **TIMM[name], **kwargs).eval()


@pytest.mark.parametrize("name,pool,classes", [("vit_small_patch16_dinov3", "token", 5),  # Meta's class-token head
                                                ("vit_small_plus_patch16_dinov3_qkvb", "avg", 0)])  # timm's default
def test_same_state_dict_and_features_as_timm_both_ways_at_two_resolutions(name, pool, classes):
    torch.manual_seed(0)
    theirs = timm_dinov3(name, num_classes=classes, global_pool=pool)
    ours = ours_for(name, num_classes=classes, global_pool=pool)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    ours.load_state_dict(theirs.state_dict())  # timm -> ours
    back = timm.create_model(name, pretrained=False, **TINY, num_classes=classes, global_pool=pool).eval()
    torch.manual_seed(1)
    mine = ours_for(name, num_classes=classes, global_pool=pool)
    mine.load_state_dict(randomised(mine.state_dict()))
    back.load_state_dict(mine.state_dict())  # ours -> timm
    with torch.no_grad():
        for res in ((64, 64), (48, 80)):  # the built 4x4 grid, and a non-square 3x5 one: RoPE, no table to resize
            x = torch.randn(2, 3, *res)
            for a, b in ((ours, theirs), (mine, back)):
                torch.testing.assert_close(a.forward_features(x), b.forward_features(x), atol=1e-5, rtol=0)
                torch.testing.assert_close(a(x), b(x), atol=1e-5, rtol=0)


def test_storage_tokens_and_rope_change_the_features():
    """What the comparison above would miss if they did nothing: each storage token and each patch's position
    changes what the class token sees."""
    torch.manual_seed(0)
    ours = ours_for("vit_small_patch16_dinov3", num_classes=0)
    ours.load_state_dict(timm_dinov3("vit_small_patch16_dinov3", num_classes=0).state_dict())
    x = torch.randn(1, 3, 48, 48)
    timm_reg3 = ours.reg_token[0, 3].tolist()
    with torch.no_grad():
        plain = ours.forward_tokens(x)
        ours.reg_token[:, 3] = torch.randn(128)  # not a constant: LayerNorm would take it away
        assert (ours.forward_tokens(x).cls_token - plain.cls_token).abs().max() > 1e-3
        ours.reg_token[:, 3] = plain.prenorm.new_tensor(timm_reg3)
        ours.rope.periods *= 2  # other positions for the same patches
        assert (ours.forward_tokens(x).cls_token - plain.cls_token).abs().max() > 1e-3
    assert plain.reg_tokens.shape == (1, 4, 128) and plain.patch_tokens.shape == (1, 9, 128)


def test_rope_periods_and_coordinates_are_dinov3s():
    periods = rope_periods(64, temperature=100.0)
    torch.testing.assert_close(periods, 100.0 ** (torch.arange(16) / 16))  # base^(2k / (d/2)), k < d/4
    coords = patch_coords((2, 4))
    assert coords[:4, 0].tolist() == [-0.5] * 4 and coords[:4, 1].tolist() == [-0.75, -0.25, 0.25, 0.75]
    assert patch_coords((2, 4), "max")[0].tolist() == [-0.75, -0.75]  # both axes over max(H, W) = 4


def test_rope_angles_stay_float32_when_the_model_is_cast_to_bf16():
    """DeepSpeed's bf16 casts every buffer; periods rounded to bf16 would move the angles of the far patches."""
    model = DINOv3ViT(img_size=32, embed_dim=64, depth=1, num_heads=1, num_classes=0)
    sin, cos = model.rope((5, 7))
    model.to(torch.bfloat16)
    assert model.rope.periods.dtype == torch.bfloat16
    sin16, cos16 = model.rope((5, 7))
    assert sin16.dtype == torch.float32 and torch.equal(sin16, sin) and torch.equal(cos16, cos)


@pytest.mark.parametrize("blocks", [1, 2])
def test_training_rope_augmentation_is_timms_for_the_same_draw(blocks):
    """timm draws one box per forward from torch's global RNG; RopeAugment.draw consumes a generator in the same
    order, so the same seed gives timm's box, and with it timm's training-mode features."""
    torch.manual_seed(0)
    aug = dict(rope_shift_coords=0.5, rope_jitter_coords=1.5, rope_rescale_coords=2.0)
    theirs = timm_dinov3("vit_small_patch16_dinov3", num_classes=0, **aug).train()
    ours = ours_for("vit_small_patch16_dinov3", num_classes=0, **aug).train()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 3, 48, 64)
    torch.manual_seed(7)
    expected = theirs.forward_features(x)
    box = RopeAugment(0.5, 1.5, 2.0).draw(torch.Generator().manual_seed(7))
    boxes = box.expand(2, 5) if blocks == 1 else box.expand(2, 2, 5)  # shared, or given per block
    torch.testing.assert_close(ours.forward_features(x, rope_aug=boxes), expected, atol=1e-5, rtol=0)
    with torch.no_grad():
        assert (ours.eval().forward_features(x, rope_aug=boxes) - expected).abs().max() > 1e-2  # eval: none


def test_each_sample_has_its_own_box_and_each_block_its_own():
    torch.manual_seed(0)
    ours = ours_for("vit_small_patch16_dinov3", num_classes=0, rope_rescale_coords=2.0)
    ours.load_state_dict(timm_dinov3("vit_small_patch16_dinov3", num_classes=0).state_dict())
    ours.train()
    draw = ours.rope_augment()
    boxes = torch.stack([draw(seed) for seed in (11, 12)])  # (B, depth, 5), as the loader would stack them
    assert boxes.shape == (2, 2, 5) and boxes[0, 0, 4] != boxes[0, 1, 4]  # a rescale per block
    x = torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        both = ours.forward_features(x, rope_aug=boxes)
        for i in range(2):  # sample i in the batch is sample i alone with its box: nothing shared across samples
            torch.testing.assert_close(both[i:i + 1], ours.forward_features(x[i:i + 1], rope_aug=boxes[i:i + 1]),
                                       atol=1e-5, rtol=0)
        shared = ours.forward_features(x, rope_aug=boxes[:, 0])
    assert (both - shared).abs().max() > 1e-3  # the second block's own box was used


def test_rope_augment_is_a_function_of_the_seed_and_draws_only_what_is_configured():
    draw = RopeAugment(rescale=2.0, blocks=3)
    a, b = draw(5), draw(5)
    assert a.shape == (3, 5) and torch.equal(a, b) and not torch.equal(a, draw(6))
    assert (a[:, :4] == torch.tensor(IDENTITY[:4])).all()  # no shift, no jitter
    assert ((a[:, 4] >= 0.5) & (a[:, 4] <= 2.0)).all() and len(set(a[:, 4].tolist())) == 3
    shifted = RopeAugment(shift=0.1)(5)
    assert (shifted[0, :2].abs() <= 0.1).all() and shifted[0, 2:].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="rope_jitter_coords must be a finite number >= 1.0"):
        RopeAugment(jitter=0.5)


def test_training_with_augmentation_needs_the_draws_and_refuses_wrong_ones():
    model = DINOv3ViT(img_size=32, embed_dim=64, depth=2, num_heads=1, num_classes=0, rope_rescale_coords=2.0)
    x = torch.randn(2, 3, 32, 32)
    with pytest.raises(ValueError, match=r"no rope_aug was given: in training the boxes are drawn per sample"):
        model(x)
    with pytest.raises(ValueError, match=r"rope_aug is \(2, 3, 5\), expected \(2, 5\) or \(2, 2, 5\)"):
        model(x, rope_aug=torch.ones(2, 3, 5))
    model.eval()(x)  # eval: no augmentation, no draws needed
    plain = DINOv3ViT(img_size=32, embed_dim=64, depth=2, num_heads=1, num_classes=0)
    with pytest.raises(ValueError, match="rope_aug given to a model without RoPE augmentation"):
        plain(x, rope_aug=torch.ones(2, 5))


def test_variants_are_timms_shapes_and_meta_sizes():
    theirs = {"dinov3_vits16": "vit_small_patch16_dinov3_qkvb", "dinov3_vits16plus": "vit_small_plus_patch16_dinov3_qkvb",
              "dinov3_vitb16": "vit_base_patch16_dinov3_qkvb", "dinov3_vitl16": "vit_large_patch16_dinov3_qkvb",
              "dinov3_vith16plus": "vit_huge_plus_patch16_dinov3_qkvb", "dinov3_vit7b16": "vit_7b_patch16_dinov3"}
    millions = {"dinov3_vits16": 21.6, "dinov3_vits16plus": 28.7, "dinov3_vitb16": 85.7, "dinov3_vitl16": 303.1,
                "dinov3_vith16plus": 840.6, "dinov3_vit7b16": 6716.0}  # Meta's README: 21M, 29M, 86M, 300M, 840M, 6716M
    assert set(theirs) == set(VARIANTS)
    for ours_name, timm_name in theirs.items():
        with torch.device("meta"):
            ours = build_dinov3(ours_name, num_classes=0, qkv_bias=timm_name.endswith("qkvb"))
            timm_model = timm.create_model(timm_name, pretrained=False, num_classes=0)
        assert {k: v.shape for k, v in ours.state_dict().items()} == \
            {k: v.shape for k, v in timm_model.state_dict().items()}, ours_name
        assert num_params(ours) / 1e6 == pytest.approx(millions[ours_name], abs=0.05), ours_name


@pytest.mark.parametrize("mlp", [dict(), dict(mlp_layer="swiglu", mlp_ratio=2.7, swiglu_align_to=8)])
def test_flops_match_pytorchs_counter(mlp):
    """dinov3_flops against FlopCounterMode (matmuls, the patch conv, SDPA) at a non-square size; SwiGLU's
    width rounded up to the alignment (int(96 x 2.7) = 259 -> 264)."""
    from torch.utils.flop_counter import FlopCounterMode

    kwargs = variant_kwargs("dinov3_vits16", img_size=(48, 64), embed_dim=96, depth=2, num_heads=2, num_classes=7, **mlp)
    model = DINOv3ViT(**kwargs).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randn(1, 3, 48, 64))
    assert dinov3_flops(kwargs) == pytest.approx(counter.get_total_flops(), rel=1e-6)


def test_grad_checkpointing_recomputes_with_the_same_gradients():
    torch.manual_seed(0)
    model = DINOv3ViT(img_size=32, embed_dim=64, depth=2, num_heads=1, num_classes=3, rope_rescale_coords=2.0)
    x, y, boxes = torch.randn(2, 3, 32, 32), torch.tensor([0, 2]), torch.stack([model.rope_augment()(s) for s in (1, 2)])

    def grads():
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x, rope_aug=boxes), y).backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads()
    model.set_grad_checkpointing(True)
    calls = []
    hook = model.blocks[0].mlp.fc1.register_forward_hook(lambda *a: calls.append(1))
    again = grads()
    hook.remove()
    assert len(calls) == 2  # forward once, recomputed once in backward
    for a, b in zip(plain, again):
        torch.testing.assert_close(a, b)


def test_init_is_metas():
    torch.manual_seed(0)
    model = build_dinov3("dinov3_vits16", num_classes=10, depth=2, mask_token=True)
    assert torch.all(model.blocks[1].gamma_2 == 1e-5) and model.mask_token.abs().sum() == 0
    assert abs(model.reg_token.std().item() - 0.02) < 0.01 and abs(model.blocks[0].mlp.fc1.weight.std().item() - 0.02) < 0.001
    assert model.blocks[0].attn.q_bias.abs().sum() == 0 and "blocks.0.attn.k_bias" not in model.state_dict()
    assert model.no_weight_decay() == {"cls_token", "reg_token"}


# Builds a DINOv3 variant as the trainer does (ZeRO-3: inside deepspeed.zero.Init, through the supervised objective's
# build_model), saves the gathered weights and runs the engine forward.
ZERO_BUILD = """
import json, sys
import deepspeed, torch
from pipeline.config import load_config
from pipeline.derived import deepspeed_config
from pipeline.dist import init_distributed
from pipeline.model.variants import model_kwargs_from_config
from pipeline.objectives.supervised.objective import Supervised
from pipeline.run.step import build_engine, build_model
init_distributed()
cfg = load_config(None, sys.argv[2:] + ["deepspeed.zero_stage=3"])
ds_config = deepspeed_config(cfg, 1)
model = build_model(cfg, model_kwargs_from_config(cfg.model, 4), ds_config, Supervised(cfg, None))
partitioned = all(hasattr(p, "ds_shape") for p in model.parameters())
with deepspeed.zero.GatheredParameters(list(model.parameters())):
    torch.save({n: p.detach().float().clone() for n, p in model.named_parameters()}, sys.argv[1])
engine = build_engine(cfg, model, cfg.model.depth, ds_config)[0]
engine.eval()
with torch.no_grad():  # ZeRO-3 gathers each module's parameters as it runs: a 3x2 grid, not the built 2x2
    logits = engine(torch.randn(2, 3, 48, 32, generator=torch.Generator().manual_seed(0)))
print(json.dumps({"partitioned": partitioned, "class": type(model).__name__, "logits": logits.tolist()}))
"""


@pytest.mark.slow
def test_dinov3_variant_builds_under_zero3_init_with_the_seed_weights(tmp_path):
    """The build in a subprocess (zero.Init patches torch), against the same config's plain build here."""
    import json
    import subprocess
    import sys

    from pipeline.config import load_config
    from pipeline.derived import deepspeed_config
    from pipeline.model.variants import model_kwargs_from_config
    from pipeline.objectives.supervised.objective import Supervised
    from pipeline.run.step import build_model
    from tests.integration.runs import ROOT, env, free_port

    tiny = ["model.variant=dinov3_vits16", "model.img_size=32", "model.embed_dim=32", "model.depth=2",
            "model.num_heads=2", "model.num_classes=4", "deepspeed.bf16=false"]
    one_rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", ZERO_BUILD, str(tmp_path / "3.pt"), *tiny],
                         cwd=ROOT, env={**env(), **one_rank}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result, zero3 = json.loads(out.stdout.strip().splitlines()[-1]), torch.load(tmp_path / "3.pt")
    cfg = load_config(None, tiny)
    plain = build_model(cfg, model_kwargs_from_config(cfg.model, 4), deepspeed_config(cfg, 1), Supervised(cfg, None))
    assert result["partitioned"] and result["class"] == "DINOv3ViT"
    assert zero3.keys() == dict(plain.named_parameters()).keys()
    for name, param in plain.named_parameters():
        torch.testing.assert_close(zero3[name], param.detach(), atol=0, rtol=0, msg=name)
    assert torch.all(zero3["blocks.1.gamma_2"] == 1e-5)  # LayerScale filled under zero.Init too
    assert zero3["reg_token"].abs().sum() > 0 and zero3["blocks.0.attn.qkv.weight"].std() > 0.01
    with torch.no_grad():
        expected = plain.eval()(torch.randn(2, 3, 48, 32, generator=torch.Generator().manual_seed(0)))
    torch.testing.assert_close(torch.tensor(result["logits"]), expected)


def test_model_variant_names_a_dinov3_vit_for_the_supervised_and_dinov3_objectives_only(capsys):
    from pipeline.commands import check_variant
    from pipeline.config import ConfigError, load_config
    from pipeline.model.dinov3 import build_backbone as build_model
    from pipeline.model.variants import model_flops, model_kwargs_from_config

    cfg = load_config(None, ["model.variant=dinov3_vitb16", "model.depth=1", "model.img_size=32"])
    check_variant(cfg)
    kwargs = model_kwargs_from_config(cfg.model, 10)
    model = build_model(kwargs)
    assert type(model) is DINOv3ViT and model.head.out_features == 10 and model.blocks[0].attn.q_bias is not None
    assert model_flops(kwargs) == dinov3_flops(kwargs)
    check_variant(load_config(None, ["model.variant=dinov3_vitb16", "model.objective=dinov3"]))
    for wrong, said in ((["model.objective=mae"], "a DINOv3 ViT trains with the supervised or the dinov3 objective"),
                        (["model.variant=dinov3_vitq16"], "choose one of: .*dinov3_vits16")):
        with pytest.raises(SystemExit):
            check_variant(load_config(None, ["model.variant=dinov3_vitb16", *wrong]))
        assert re.search(said, capsys.readouterr().err)
    with pytest.raises(ConfigError, match="model.representation_size=8 with model.variant=dinov3_vitb16"):
        model_kwargs_from_config(load_config(None, ["model.variant=dinov3_vitb16", "model.representation_size=8"]).model, 3)


def test_a_supervised_dinov3_run_resumes_by_dinov3vits_architecture_keys(tmp_path):
    """The supervised objective names the class its arguments build (a resume compares that class's ARCH_KEYS:
    RoPE's periods, SwiGLU's alignment, which VisionTransformer's keys do not have) and exports its architecture."""
    from types import SimpleNamespace

    from pipeline.config import load_config
    from pipeline.objectives.supervised.objective import Supervised
    from pipeline.run.resume import check_same_model
    from pipeline.train.checkpoint import TrainerState

    cfg = load_config(None, ["model.variant=dinov3_vits16plus", "model.depth=1", "model.img_size=32"])
    objective = Supervised(cfg, SimpleNamespace(num_classes=3))
    kwargs = objective.model_kwargs()
    assert objective.model_class is DINOv3ViT and Supervised.model_class is not DINOv3ViT
    assert objective.exported_architecture(kwargs)["swiglu_align_to"] == 8
    for key, other in (("rope_temperature", 10000.0), ("swiglu_align_to", 64)):
        state = TrainerState(step=1, world_size=1, model={**kwargs, key: other}, config={})
        with pytest.raises(Exception, match=f"different model.*{key}: {other}"):
            check_same_model(state, objective.model_class, kwargs, tmp_path)
    check_same_model(TrainerState(step=1, world_size=1, model=dict(kwargs), config={}), objective.model_class, kwargs,
                     tmp_path)
