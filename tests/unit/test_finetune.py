"""Loading a source into the fine-tune model: pos-embed resize, exact trunk, timm files, errors."""

import pickle

import pytest
import timm
import torch

from pipeline.config import ConfigError, save_config
from pipeline.model.pos_embed import resize_pos_embed
from pipeline.model.vit import VisionTransformer, build_vit, model_kwargs_from_config
from pipeline.model.weights import WeightsError, save_weights
from pipeline.objectives import load_config
from pipeline.run.finetune import prepare_finetune

ARCH = ["model.variant=vit_ti16", "model.patch_size=4", "model.embed_dim=32", "model.depth=2", "model.num_heads=2"]


def pretrain_run(tmp_path, img_size=16, num_classes=4, representation_size=None):
    """A run directory as the trainer leaves it: config.yaml + model.safetensors."""
    run_dir = tmp_path / "pretrain"
    run_dir.mkdir()
    overrides = [*ARCH, f"model.img_size={img_size}", f"model.num_classes={num_classes}"]
    if representation_size:
        overrides.append(f"model.representation_size={representation_size}")
    cfg = load_config(None, overrides)
    save_config(cfg, run_dir / "config.yaml")
    torch.manual_seed(1)
    model = VisionTransformer(**model_kwargs_from_config(cfg.model))
    save_weights(model.state_dict(), run_dir / "model.safetensors")
    return run_dir, model


def finetuned(source, res, num_classes=3, extra=()):
    # The fine-tune config does not repeat the architecture: it comes from the source.
    cfg = load_config(None, [f"model.img_size={res}", f"model.num_classes={num_classes}",
                             f"finetune.source={source}", *extra])
    cfg, prepare = prepare_finetune(cfg, None)
    torch.manual_seed(2)
    model = VisionTransformer(**model_kwargs_from_config(cfg.model))
    prepare(model)
    return model.eval()


def test_pos_embed_is_resized_from_the_source_grid(tmp_path):
    run_dir, source = pretrain_run(tmp_path, img_size=16, representation_size=24)
    model = finetuned(run_dir, [32, 48])  # 4x4 grid -> 8x12, non-square
    assert torch.equal(model.pos_embed, resize_pos_embed(source.pos_embed.detach(), (8, 12), 1, (4, 4)))
    assert torch.equal(model.cls_token, source.cls_token)
    assert model.head.weight.shape == (3, 32) and model.head.weight.abs().sum() == 0  # fresh zero head
    assert isinstance(model.pre_logits, torch.nn.Identity)  # the tanh pre-logits layer is dropped


def test_head_init_model_starts_the_head_as_a_run_from_scratch_does(tmp_path):
    run_dir, source = pretrain_run(tmp_path, img_size=16)
    model = finetuned(run_dir, 16, extra=["finetune.head_init=model"])  # built after torch.manual_seed(2)
    torch.manual_seed(2)  # the same seed and build, no source: what a run from scratch starts from
    scratch = VisionTransformer(**model_kwargs_from_config(load_config(None, [*ARCH, "model.img_size=16",
                                                                              "model.num_classes=3"]).model))
    assert model.head.weight.abs().sum() > 0
    assert torch.equal(model.head.weight, scratch.head.weight) and torch.equal(model.head.bias, scratch.head.bias)
    assert torch.equal(model.cls_token, source.cls_token)  # the trunk is the source's all the same


def test_head_init_model_with_a_probe_is_refused(tmp_path):
    run_dir, _ = pretrain_run(tmp_path, img_size=16)
    cfg = load_config(None, ["model.img_size=16", "model.num_classes=3", f"finetune.source={run_dir}",
                             "finetune.probe=true", "finetune.head_init=model"])
    with pytest.raises(ConfigError, match="finetune.head_init=model with finetune.probe"):
        prepare_finetune(cfg, None)


def test_same_resolution_gives_the_source_features_exactly(tmp_path):
    run_dir, source = pretrain_run(tmp_path, img_size=16)
    model = finetuned(run_dir, 16)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(model.forward_features(x)[:, 0], source.eval().forward_features(x)[:, 0])


def test_from_a_timm_state_dict_file(tmp_path):
    theirs = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=5).eval()
    path = tmp_path / "vit_timm.pth"
    torch.save(theirs.state_dict(), path)
    cfg_arch = ["model.variant=vit_ti16", "model.patch_size=8", "model.embed_dim=48", "model.depth=2",
                "model.num_heads=3"]
    model = finetuned(path, 32, extra=cfg_arch)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(x)[:, 0], theirs.forward_features(x)[:, 0], atol=1e-6,
                                   rtol=0)


def test_wrong_shapes_name_the_parameter(tmp_path):
    source = build_vit("vit_ti16", img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=3)
    state = source.state_dict()
    state["blocks.1.mlp.fc1.weight"] = torch.zeros(100, 32)
    save_weights(state, tmp_path / "bad.safetensors")
    with pytest.raises(WeightsError, match=r"'blocks.1.mlp.fc1.weight' has shape \(100, 32\).*expects \(128, 32\)"):
        finetuned(tmp_path / "bad.safetensors", 16, extra=ARCH)


def test_missing_parameters_are_named(tmp_path):
    source = build_vit("vit_ti16", img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=3,
                       qkv_bias=False)
    save_weights(source.state_dict(), tmp_path / "no_qkv_bias.safetensors")
    with pytest.raises(WeightsError, match="missing parameters blocks.0.attn.qkv.bias, blocks.1.attn.qkv.bias"):
        finetuned(tmp_path / "no_qkv_bias.safetensors", 16, extra=ARCH)


@pytest.mark.parametrize("depth,width", [(1, 32), (3, 32), (2, 64)])
def test_a_file_whose_encoder_the_config_contradicts_is_refused_before_anything_is_built(tmp_path, depth, width):
    # A deeper file used to fine-tune its first blocks with a warning for the rest; now neither way passes.
    source = build_vit("vit_ti16", img_size=16, patch_size=4, embed_dim=width, depth=depth, num_heads=2, num_classes=3)
    save_weights(source.state_dict(), tmp_path / "other.safetensors")
    with pytest.raises(WeightsError, match=rf"other.safetensors \(timm's VisionTransformer\): the file's encoder is "
                                          rf"patch 4, width {width}, depth {depth}; the config's model is patch 4, "
                                          rf"width 32, depth 2"):
        finetuned(tmp_path / "other.safetensors", 16, extra=ARCH)


class Payload:
    marker = ""

    def __reduce__(self):  # unpickling this calls exec(...): a file appears if the code ran
        return (exec, (f"open({self.marker!r}, 'w').write('x')",))


def test_a_pickle_with_code_is_refused_and_not_run(tmp_path):
    path, marker = tmp_path / "model.pth", tmp_path / "pwned"
    Payload.marker = str(marker)
    with open(path, "wb") as f:
        pickle.dump({"pos_embed": torch.zeros(1), "payload": Payload()}, f, protocol=2)
    with pytest.raises(WeightsError, match="would run code"):
        finetuned(path, 16, extra=ARCH)
    assert not marker.exists()


def test_from_a_meta_dinov2_file_reads_the_architecture_and_converts(tmp_path):
    from tests.unit.test_weights import meta_dinov2_file

    torch.manual_seed(0)
    source = build_vit("vit_s14_reg4", img_size=42, depth=2, num_classes=0).eval()
    with torch.no_grad():
        for n, p in source.named_parameters():
            if "gamma" in n or "token" in n or "pos_embed" in n:
                p.normal_()
    meta_dinov2_file(source, tmp_path / "dinov2_vits14_reg4_pretrain.pth")
    # No model.* keys: width, depth, heads, patch, LayerScale, registers and the 3x3 grid come from the file.
    cfg = load_config(None, ["model.img_size=42", "model.num_classes=3",
                             f"finetune.source={tmp_path / 'dinov2_vits14_reg4_pretrain.pth'}"])
    cfg, prepare = prepare_finetune(cfg, None)
    assert (cfg.model.variant, cfg.model.depth, cfg.model.reg_tokens, cfg.model.no_embed_class) == \
        ("vit_s14_reg4", 2, 4, True)
    assert cfg.finetune.source_img_size == 42
    model = VisionTransformer(**model_kwargs_from_config(cfg.model))
    prepare(model)
    model.eval()
    x = torch.randn(2, 3, 42, 42)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(x), source.forward_features(x), atol=1e-5, rtol=1e-5)
        assert model(x).abs().sum() == 0  # the zero head
    # At another resolution the patch-only table is resized (no class row to keep apart).
    cfg = load_config(None, ["model.img_size=56", "model.num_classes=3",
                             f"finetune.source={tmp_path / 'dinov2_vits14_reg4_pretrain.pth'}"])
    cfg, prepare = prepare_finetune(cfg, None)
    model = VisionTransformer(**model_kwargs_from_config(cfg.model))
    prepare(model)
    assert torch.equal(model.pos_embed, resize_pos_embed(source.pos_embed.detach(), (4, 4), 0, (3, 3)))


def test_a_file_that_is_neither_timm_nor_meta_is_named(tmp_path):
    path = tmp_path / "resnet.pth"
    torch.save({"conv1.weight": torch.zeros(8, 3, 7, 7), "fc.weight": torch.zeros(10, 8)}, path)
    with pytest.raises(WeightsError, match=r"resnet.pth: weights in no layout known here; looked for Meta's MAE .* "
                                           r"Meta's DINOv2 .* timm's VisionTransformer .*it holds 2 tensors, the first: "
                                           r"conv1.weight, fc.weight"):
        finetuned(path, 16, extra=ARCH)


@pytest.mark.parametrize("in_chans", [1, 4])
def test_an_rgb_timm_file_fine_tunes_into_c_channels_as_timms_adapt_input_conv(tmp_path, capsys, in_chans):
    """Issue 62: a 3-channel patch embedding into a model of 1 or 4 channels is timm's adapt_input_conv of it (the
    rest as it is), and the features are those of timm's model given the same adapted weights."""
    theirs = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=5).eval()
    path = tmp_path / "vit_timm.pth"
    torch.save(theirs.state_dict(), path)
    arch = ["model.variant=vit_ti16", "model.patch_size=8", "model.embed_dim=48", "model.depth=2", "model.num_heads=3"]
    model = finetuned(path, 32, extra=[*arch, f"model.in_chans={in_chans}"])
    adapted = timm.models.adapt_input_conv(in_chans, theirs.patch_embed.proj.weight.detach().clone())
    assert model.patch_embed.proj.weight.shape == (48, in_chans, 8, 8)
    assert torch.equal(model.patch_embed.proj.weight, adapted)
    assert torch.equal(model.blocks[1].mlp.fc2.weight, theirs.blocks[1].mlp.fc2.weight)
    assert f"patch projection RGB -> {in_chans} channels (timm's adapt_input_conv)" in capsys.readouterr().out
    c_theirs = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=5, in_chans=in_chans).eval()
    c_theirs.load_state_dict({**theirs.state_dict(), "patch_embed.proj.weight": adapted})
    x = torch.randn(2, in_chans, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(x), c_theirs.forward_features(x), atol=1e-6, rtol=0)


def test_other_channels_than_rgb_are_refused_unless_the_patch_projection_is_fresh(tmp_path):
    source = build_vit("vit_ti16", img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=3,
                       in_chans=4)
    save_weights(source.state_dict(), tmp_path / "four.safetensors")
    with pytest.raises(WeightsError, match=r"four.safetensors: its patch embedding takes 4 channels and the model 3: "
                                          r"only RGB \(3\) weights adapt .* set finetune.fresh_patch_embed=true"):
        finetuned(tmp_path / "four.safetensors", 16, extra=ARCH)
    model = finetuned(tmp_path / "four.safetensors", 16, extra=[*ARCH, "finetune.fresh_patch_embed=true"])
    torch.manual_seed(2)  # finetuned's build: the projection is the model's own draw, the rest the file's
    scratch = VisionTransformer(**model_kwargs_from_config(load_config(None, [*ARCH, "model.img_size=16",
                                                                              "model.num_classes=3"]).model))
    assert torch.equal(model.patch_embed.proj.weight, scratch.patch_embed.proj.weight)
    assert torch.equal(model.blocks[0].attn.qkv.weight, source.blocks[0].attn.qkv.weight)
