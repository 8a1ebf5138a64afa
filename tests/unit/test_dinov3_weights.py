"""DINOv3 weights in timm's names (what timm's `vit_*_patch16_dinov3[_qkvb]` save), recognised by their keys
(pipeline/model/layouts.py) and fine-tuned through `prepare_finetune`, what launch/finetune.py --from runs:
the architecture from the file, the file's tensors loaded bit for bit, no position table to resize."""

import pytest
import timm
import torch

from pipeline.config import ConfigError, load_config, save_config
from pipeline.model.dinov3 import DINOv3ViT
from pipeline.model.dinov3 import build_backbone as build_model
from pipeline.model.layouts import LayoutError, recognise
from pipeline.model.variants import model_kwargs_from_config
from pipeline.model.weights import save_weights
from pipeline.run.finetune import prepare_finetune
from tests.unit.test_dinov3 import TINY, randomised


def timm_file(path, name="vit_small_patch16_dinov3", **kwargs):
    """timm's own model at a tiny width, random tensors, saved as timm users save it: (the model, its state)."""
    model = timm.create_model(name, pretrained=False, **TINY, **kwargs)
    state = randomised(model.state_dict())
    model.load_state_dict(state)
    if path.suffix == ".safetensors":
        save_weights(state, path)
    else:
        torch.save(state, path)
    return model.eval(), state


def fine_tune(path, img_size, extra=()):
    """`--from path` as launch/finetune.py prepares it: (the model's constructor arguments, the loaded model)."""
    size = img_size if isinstance(img_size, int) else list(img_size)
    cfg = load_config(None, [f"model.img_size={size}", "model.num_classes=3", f"finetune.source={path}", *extra])
    cfg, prepare = prepare_finetune(cfg, None)
    kwargs = model_kwargs_from_config(cfg.model)
    model = build_model(kwargs)
    prepare(model)
    return kwargs, model.eval()


@pytest.mark.parametrize("name,file,classes", [
    ("vit_small_patch16_dinov3", "dinov3.safetensors", 0),
    ("vit_small_plus_patch16_dinov3_qkvb", "dinov3_vits16plus.pth", 7),  # a head of its own: replaced
])
def test_a_timm_dinov3_file_fine_tunes_with_its_architecture_and_tensors(tmp_path, capsys, name, file, classes):
    torch.manual_seed(0)
    theirs, state = timm_file(tmp_path / file, name, num_classes=classes, global_pool="token")
    # No model.* keys: the file decides; a non-square size the file was never at (RoPE: nothing to resize).
    kwargs, model = fine_tune(tmp_path / file, (48, 80))
    swiglu = "plus" in name
    assert isinstance(model, DINOv3ViT)
    assert (kwargs["patch_size"], kwargs["embed_dim"], kwargs["depth"], kwargs["num_heads"], kwargs["reg_tokens"],
            kwargs["qkv_bias"], kwargs["mlp_layer"]) == (16, 128, 2, 2, 4, swiglu, "swiglu" if swiglu else "mlp")
    out = capsys.readouterr().out
    assert (f"timm's DINOv3 ViT, patch 16, width 128, depth 2, 2 heads, {kwargs['mlp_layer']} MLP, LayerScale on, "
            f"4 registers\n") in out
    assert "RoPE: no position table to resize, the 3x5 grid's positions are computed as it runs" in out
    loaded = {k: v for k, v in model.state_dict().items() if not k.startswith("head.")}
    assert loaded.keys() == {k for k in state if not k.startswith("head.")}
    for k, v in loaded.items():
        assert torch.equal(v, state[k]), k
    assert model.head.weight.shape == (3, 128) and model.head.weight.abs().sum() == 0
    x = torch.randn(2, 3, 48, 80)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(x), theirs.forward_features(x), atol=1e-5, rtol=0)


def test_the_export_of_the_fine_tune_loads_into_timms_class_with_timms_features(tmp_path):
    """What a fine-tune run exports is the model's state dict (Objective.exported_weights): timm's names, so timm's
    class takes it whole, head included, and gives our model's logits."""
    torch.manual_seed(0)
    timm_file(tmp_path / "dinov3.safetensors")
    _, model = fine_tune(tmp_path / "dinov3.safetensors", 64)
    with torch.no_grad():
        model.head.weight.normal_()  # as training would leave it
        model.head.bias.normal_()
    save_weights(model.state_dict(), tmp_path / "model.safetensors", metadata={"step": "2"})
    from safetensors.torch import load_file

    theirs = timm.create_model("vit_small_patch16_dinov3", pretrained=False, **TINY, num_classes=3,
                               global_pool="token").eval()
    theirs.load_state_dict(load_file(str(tmp_path / "model.safetensors")))  # strict: every key, no other
    with torch.no_grad():
        for res in (64, 96):
            x = torch.randn(2, 3, res, res)
            torch.testing.assert_close(theirs(x), model(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("change,why", [
    (lambda s: s.update(pos_embed=torch.zeros(1, 16, 128)), "timm's DINOv3 ViT .*: it has pos_embed"),
    (lambda s: s.pop("blocks.1.gamma_2"), r"timm's DINOv3 ViT .*: blocks.1.\* and blocks.0.\* have different keys"),
    (lambda s: [s.pop(f"blocks.{i}.gamma_2") for i in (0, 1)],
     r"timm's DINOv3 ViT .*: blocks.0.\* has gamma_1 without gamma_2"),
    (lambda s: s.update({"blocks.0.attn.qkv.bias": torch.zeros(384), "blocks.1.attn.qkv.bias": torch.zeros(384)}),
     r"timm's DINOv3 ViT .*: blocks.0.\* has attn.qkv.bias"),
])
def test_a_dinov3_state_less_a_key_or_plus_one_is_no_layout_and_says_why(tmp_path, change, why):
    torch.manual_seed(0)
    _, state = timm_file(tmp_path / "d.safetensors", num_classes=0)
    assert recognise(state).layout == "timm's DINOv3 ViT"
    change(state)
    with pytest.raises(LayoutError, match=why):
        recognise(state, "x.pth")


def test_our_dinov3_runs_weights_are_ours_and_the_runs_config_decides_the_heads(tmp_path, capsys):
    """A DINOv3 run's directory (config.yaml + model.safetensors): its config says 4 heads of 32 where a bare file
    would read as 2 of 64; a backbone's iBOT mask_token is recognised and left out."""
    torch.manual_seed(0)
    run_dir = tmp_path / "pretrain"
    run_dir.mkdir()
    cfg = load_config(None, ["model.variant=dinov3_vits16", "model.embed_dim=128", "model.depth=2",
                             "model.num_heads=4", "model.img_size=32", "model.num_classes=5"])
    save_config(cfg, run_dir / "config.yaml")
    source = DINOv3ViT(**model_kwargs_from_config(cfg.model), mask_token=True)
    state = randomised(source.state_dict())
    save_weights(state, run_dir / "model.safetensors", metadata={"step": "4"})
    assert recognise(state, ours=True).layout == "ours (DINOv3ViT's names)"
    kwargs, model = fine_tune(run_dir, 64)
    assert (kwargs["embed_dim"], kwargs["num_heads"]) == (128, 4)
    assert "ours (DINOv3ViT's names), patch 16, width 128, depth 2; left out: mask_token" in capsys.readouterr().out
    for k, v in model.state_dict().items():
        if not k.startswith("head."):
            assert torch.equal(v, state[k]), k


def test_an_architecture_key_contradicting_the_file_is_refused(tmp_path):
    torch.manual_seed(0)
    timm_file(tmp_path / "dinov3.safetensors", num_classes=0)
    cfg = load_config(None, ["model.img_size=32", "model.num_classes=3", "model.depth=3",
                             f"finetune.source={tmp_path / 'dinov3.safetensors'}"])
    with pytest.raises(ConfigError, match=r"model.depth=3 on the command line: a fine-tune takes its architecture "
                                          r"from --from .*dinov3.safetensors \(timm's DINOv3 ViT\), which has "
                                          r"model.depth=2"):
        prepare_finetune(cfg, None, cli_model_keys={"depth"})
