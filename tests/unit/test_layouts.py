"""Weights from others, recognised by what they are: each layout `--from` takes, in a file this test writes
in that layout without the official code, fine-tuned through `prepare_finetune` (what launch/finetune.py
runs) into the expected architecture, with the file's tensors loaded.

Meta's layouts are kept here as data: every key's shape, in the sizes' names, read once from
facebookresearch/mae's MaskedAutoencoderViT and facebookresearch/dinov2's DinoVisionTransformer and
DINOHead; tests/unit/test_mae_official.py and test_dinov2_official.py check these tables against the
official code where a checkout is given. timm's layout comes from timm itself, ours from our models.
"""

from __future__ import annotations

import argparse
import re

import pytest
import timm
import torch

from pipeline.config import load_config
from pipeline.model import layouts
from pipeline.model.layouts import LayoutError, recognise
from pipeline.model.mae import build_mae
from pipeline.model.vit import VisionTransformer, build_vit, model_kwargs_from_config
from pipeline.model.weights import WeightsError, save_weights
from pipeline.run.finetune import prepare_finetune

# --- the layouts of Meta's code, as data ---

# timm's Block as MAE builds it (qkv_bias=True), in its encoder and decoder alike: width D, MLP hidden H.
BLOCK = {"norm1.weight": "D", "norm1.bias": "D", "attn.qkv.weight": "3D D", "attn.qkv.bias": "3D",
         "attn.proj.weight": "D D", "attn.proj.bias": "D", "norm2.weight": "D", "norm2.bias": "D",
         "mlp.fc1.weight": "H D", "mlp.fc1.bias": "H", "mlp.fc2.weight": "D H", "mlp.fc2.bias": "D"}

# models_mae.py, MaskedAutoencoderViT(...).state_dict(). T = 1 + patches (the sin-cos tables have the class
# token's row); Dd, Hd, Ld the decoder's width, MLP hidden and depth; Q = P * P * C pixels per patch. A block
# group is (the block's keys, the depth's name, the block's sizes by the names the block uses).
MAE = {
    "cls_token": "1 1 D", "pos_embed": "1 T D", "mask_token": "1 1 Dd", "decoder_pos_embed": "1 T Dd",
    "patch_embed.proj.weight": "D C P P", "patch_embed.proj.bias": "D",
    "blocks.{i}.": (BLOCK, "L", {}),
    "norm.weight": "D", "norm.bias": "D",
    "decoder_embed.weight": "Dd D", "decoder_embed.bias": "Dd",
    "decoder_blocks.{i}.": (BLOCK, "Ld", {"D": "Dd", "H": "Hd"}),
    "decoder_norm.weight": "Dd", "decoder_norm.bias": "Dd", "decoder_pred.weight": "Q Dd", "decoder_pred.bias": "Q",
}
MAE_ENCODER = {k: v for k, v in MAE.items() if not k.startswith("decoder") and k != "mask_token"}

# dinov2/layers/block.py's NestedTensorBlock with LayerScale (the released models' init_values=1.0): the same
# block with ls1/ls2; the MLP as Mlp's fc1/fc2 or SwiGLUFFNFused's w12/w3, S = (int(2H / 3) + 7) // 8 * 8.
DINOV2_BLOCK = {**BLOCK, "ls1.gamma": "D", "ls2.gamma": "D"}
DINOV2_SWIGLU_BLOCK = {**{k: v for k, v in DINOV2_BLOCK.items() if not k.startswith("mlp.")},
                       "mlp.w12.weight": "2S D", "mlp.w12.bias": "2S", "mlp.w3.weight": "D S", "mlp.w3.bias": "D"}
# dinov2/models/vision_transformer.py, DinoVisionTransformer(...).state_dict(): pos_embed keeps the class
# token's row (T = 1 + patches) with registers too; mask_token is (1, D); head is an Identity.
DINOV2 = {"cls_token": "1 1 D", "pos_embed": "1 T D", "mask_token": "1 D", "patch_embed.proj.weight": "D C P P",
          "patch_embed.proj.bias": "D", "blocks.{i}.": (DINOV2_BLOCK, "L", {}), "norm.weight": "D", "norm.bias": "D"}
DINOV2_REG = {**DINOV2, "register_tokens": "1 R D"}
# block_chunks > 0 (the training configs): blocks.CHUNK.I., I counting across the chunks.
DINOV2_CHUNKED_SWIGLU = {**{k: v for k, v in DINOV2.items() if k != "blocks.{i}."},
                         "blocks.{c}.{i}.": (DINOV2_SWIGLU_BLOCK, "L", {})}
# dinov2/layers/dino_head.py, DINOHead(in_dim=D, out_dim=K, hidden_dim=Hh, bottleneck_dim=B, nlayers=3).
DINO_HEAD = {"mlp.0.weight": "Hh D", "mlp.0.bias": "Hh", "mlp.2.weight": "Hh Hh", "mlp.2.bias": "Hh",
             "mlp.4.weight": "B Hh", "mlp.4.bias": "B", "last_layer.weight_g": "K 1", "last_layer.weight_v": "K B"}


def sizes(img: int, P: int, D: int, L: int, C: int = 3, Dd: int = 0, Ld: int = 0, R: int = 0, per_chunk: int = 1,
          K: int = 8, Hh: int = 24, B: int = 8) -> dict[str, int]:
    """Every size a table names, the derived ones computed as the official code does."""
    H = 4 * D
    return dict(img=img, P=P, C=C, D=D, L=L, T=1 + (img // P) ** 2, H=H, S=(int(H * 2 / 3) + 7) // 8 * 8,
                Dd=Dd, Hd=4 * Dd, Ld=Ld, Q=P * P * C, R=R, per_chunk=per_chunk, K=K, Hh=Hh, B=B)


def shapes(table: dict, size: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """The table's keys and shapes at `size` ('3D D' at D=32 is (96, 32)), its block groups expanded."""
    def shape(spec: str, names: dict[str, int]) -> tuple[int, ...]:
        out = []
        for token in spec.split():
            factor, name = re.fullmatch(r"(\d*)([A-Za-z]*)", token).groups()
            out.append((int(factor) if factor else 1) * (names[name] if name else 1))
        return tuple(out)

    out = {}
    for key, spec in table.items():
        if isinstance(spec, tuple):
            block, depth, rename = spec
            names = {**size, **{k: size[v] for k, v in rename.items()}}
            for i in range(size[depth]):
                prefix = key.format(i=i, c=i // size["per_chunk"])
                out.update({prefix + k: shape(s, names) for k, s in block.items()})
        else:
            out[key] = shape(spec, size)
    return out


def random_tensors(table: dict, size: dict[str, int]) -> dict[str, torch.Tensor]:
    return {k: torch.randn(s) for k, s in shapes(table, size).items()}


def fine_tune(path, img_size, extra=()) -> tuple[dict, VisionTransformer]:
    """`--from path` as launch/finetune.py prepares it: (the model's constructor arguments, the loaded model)."""
    cfg = load_config(None, [f"model.img_size={img_size}", "model.num_classes=3", f"finetune.source={path}", *extra])
    cfg, prepare = prepare_finetune(cfg, None)
    kwargs = model_kwargs_from_config(cfg.model)
    model = VisionTransformer(**kwargs)
    prepare(model)
    return kwargs, model


def assert_loaded(model: VisionTransformer, expected: dict[str, torch.Tensor]) -> None:
    """Every parameter but the fresh zero head is the file's tensor, bit for bit, and nothing else is loaded."""
    loaded = {k: v for k, v in model.state_dict().items() if not k.startswith("head.")}
    assert set(loaded) == set(expected)
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), name
    assert model.head.weight.abs().sum() == 0


def arch(kwargs: dict) -> tuple:
    return (kwargs["patch_size"], kwargs["embed_dim"], kwargs["depth"], kwargs["num_heads"])


# --- Meta's MAE pretraining checkpoint ---

TINY = ["model.variant=vit_ti16", "model.patch_size=4", "model.embed_dim=32", "model.depth=2", "model.num_heads=2"]
MAE_CASES = {  # (sizes, the fine-tune config's architecture, what it gives: patch, width, depth, heads)
    "tiny": (sizes(img=16, P=4, D=32, L=2, Dd=16, Ld=1), TINY, (4, 32, 2, 2)),
    # ViT-B's widths (encoder 768, decoder 512), one block each to keep it quick; the heads from vit_b16.
    "vit_b16": (sizes(img=32, P=16, D=768, L=1, Dd=512, Ld=1), ["model.variant=vit_b16", "model.depth=1"],
                (16, 768, 1, 12)),
}


@pytest.mark.parametrize("case", list(MAE_CASES))
def test_meta_mae_pretraining_checkpoint_fine_tunes_its_encoder(tmp_path, capsys, case):
    size, config, expected = MAE_CASES[case]
    torch.manual_seed(0)
    state = random_tensors(MAE, size)
    path = tmp_path / "checkpoint-399.pth"
    # As main_pretrain.py's misc.save_model writes it: the model beside the optimizer, epoch, scaler and args.
    torch.save({"model": state, "optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": [
        {"lr": 1.5e-4, "betas": (0.9, 0.95), "params": [0]}]}, "epoch": 399,
        "scaler": {"scale": 65536.0, "growth_factor": 2.0, "_growth_tracker": 17},
        "args": argparse.Namespace(model="mae_vit_base_patch16", mask_ratio=0.75, norm_pix_loss=True, blr=1.5e-4)},
        path)
    kwargs, model = fine_tune(path, size["img"], config)
    assert arch(kwargs) == expected  # the heads from the config: the file cannot say
    assert (f"Meta's MAE pretraining checkpoint, patch {size['P']}, width {size['D']}, depth {size['L']}; left out: "
            f"the decoder (depth 1, width {size['Dd']}) and its mask_token; {expected[3]} heads (from the config: the "
            f"file does not say)") in capsys.readouterr().out
    assert_loaded(model, {k: v for k, v in state.items() if k in shapes(MAE_ENCODER, size)})


def test_meta_mae_checkpoint_is_not_taken_for_dinov2_and_its_architecture_is_checked(tmp_path):
    size = MAE_CASES["tiny"][0]
    path = tmp_path / "mae.pth"
    torch.save({"model": random_tensors(MAE, size)}, path)
    assert recognise(torch.load(path)["model"]).layout == "Meta's MAE pretraining checkpoint"
    # A config of another width is refused in one line before any model is built (it once read as vit_b14).
    with pytest.raises(WeightsError, match=r"mae.pth \(Meta's MAE pretraining checkpoint\): the file's encoder is "
                                          r"patch 4, width 32, depth 2; the config's model is patch 16, width 768"):
        fine_tune(path, 16, ["model.variant=vit_b16"])


def test_meta_mae_released_encoder_is_timm_layout(tmp_path):
    """Meta's released mae_pretrain_vit_*.pth hold the encoder only, {'model': ...}: timm's layout."""
    size = MAE_CASES["tiny"][0]
    state = random_tensors(MAE_ENCODER, size)
    torch.save({"model": state}, tmp_path / "mae_pretrain_vit_tiny.pth")
    kwargs, model = fine_tune(tmp_path / "mae_pretrain_vit_tiny.pth", 16, TINY)
    assert arch(kwargs) == (4, 32, 2, 2)
    assert_loaded(model, state)


# --- Meta's DINOv2 backbones ---

DINOV2_SIZE = sizes(img=28, P=14, D=128, L=2, R=4)  # 128 wide: Meta's 64-wide heads make 2


def as_ours_without_registers(key: str) -> str:
    return re.sub(r"^blocks\.\d+\.(\d+)\.", r"blocks.\1.", key.removeprefix("backbone.")).replace(
        ".mlp.w12.", ".mlp.fc1.").replace(".mlp.w3.", ".mlp.fc2.")


@pytest.mark.parametrize("case", ["plain", "registers", "chunked_swiglu_teacher"])
def test_meta_dinov2_backbone_fine_tunes_with_the_files_architecture(tmp_path, capsys, case):
    torch.manual_seed(0)
    if case == "chunked_swiglu_teacher":  # a training run's teacher_checkpoint.pth: chunked blocks, heads beside
        size = dict(DINOV2_SIZE, per_chunk=1)  # block_chunks=2 at depth 2
        state = {"backbone." + k: v for k, v in random_tensors(DINOV2_CHUNKED_SWIGLU, size).items()}
        state.update({"dino_head." + k: v for k, v in random_tensors(DINO_HEAD, size).items()})
        saved = {"teacher": state}
    else:
        state = random_tensors(DINOV2_REG if case == "registers" else DINOV2, DINOV2_SIZE)
        saved = state  # torch.save(model.state_dict()), as the hub files are
    torch.save(saved, tmp_path / "dinov2.pth")
    kwargs, model = fine_tune(tmp_path / "dinov2.pth", 28)  # no model.* keys: the file decides
    assert arch(kwargs) == (14, 128, 2, 2)
    assert kwargs["init_values"] and kwargs["reg_tokens"] == (4 if case == "registers" else 0)
    assert kwargs["mlp_layer"] == ("swiglu" if case == "chunked_swiglu_teacher" else "mlp")
    out = capsys.readouterr().out
    assert "Meta's DINOv2 backbone, patch 14, width 128, depth 2, 2 heads" in out
    expected = {as_ours_without_registers(k): v for k, v in state.items()
                if not k.startswith("dino_head.") and not k.endswith("mask_token")}
    if case == "registers":  # Meta adds pos_embed's first row to the class token; timm's layout folds it in
        row = expected["pos_embed"][:, :1]
        expected.update(reg_token=expected.pop("register_tokens"), cls_token=expected["cls_token"] + row,
                        pos_embed=expected["pos_embed"][:, 1:])
    if case == "chunked_swiglu_teacher":
        assert "left out: mask_token and the teacher's dino_head" in out
    assert_loaded(model, expected)


# --- timm's VisionTransformer, from timm itself ---

@pytest.mark.parametrize("case", ["registers_layerscale", "fc_norm"])
def test_timm_vit_fine_tunes_with_the_configs_architecture(tmp_path, case):
    torch.manual_seed(0)
    common = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=5)
    if case == "registers_layerscale":  # as timm's vit_*_patch14_reg4_dinov2
        theirs = timm.models.vision_transformer.VisionTransformer(**common, reg_tokens=4, no_embed_class=True,
                                                                  init_values=1e-5)
        config = ["model.init_values=1e-5", "model.reg_tokens=4", "model.no_embed_class=true"]
    else:  # global_pool='avg' with fc_norm, as Meta's fine-tuned MAE files
        theirs = timm.models.vision_transformer.VisionTransformer(**common, global_pool="avg", fc_norm=True)
        config = ["model.global_pool=avg"]
    state = {k: v.detach().clone().normal_() for k, v in theirs.state_dict().items()}
    save_weights(state, tmp_path / "timm.safetensors")
    assert recognise(state).layout == "timm's VisionTransformer"
    kwargs, model = fine_tune(tmp_path / "timm.safetensors", 32, [
        "model.variant=vit_ti16", "model.patch_size=8", "model.embed_dim=48", "model.depth=2", "model.num_heads=3",
        *config])
    assert arch(kwargs) == (8, 48, 2, 3)
    assert_loaded(model, {k: v for k, v in state.items() if not k.startswith("head.")})


# --- ours ---

def test_our_mae_runs_export_fine_tunes_its_encoder(tmp_path, capsys):
    torch.manual_seed(0)
    mae = build_mae("vit_ti16", img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, decoder_embed_dim=16,
                    decoder_depth=1, decoder_num_heads=2)
    save_weights(mae.state_dict(), tmp_path / "model.safetensors", metadata={"variant": "vit_ti16", "step": "12"})
    kwargs, model = fine_tune(tmp_path / "model.safetensors", 16, TINY)
    assert arch(kwargs) == (4, 32, 2, 2)
    assert "ours (an MAE run's MaskedAutoencoderViT), patch 4, width 32, depth 2" in capsys.readouterr().out
    assert_loaded(model, {k: v for k, v in mae.state_dict().items() if not k.startswith(("decoder", "mask_token"))})


def test_our_dinov2_backbone_is_told_from_metas_by_its_metadata(tmp_path):
    """A DINOv2 run's backbone without registers has exactly the keys of Meta's (timm's names, iBOT's
    mask_token (1, D)); its heads are the config's (3 here), where Meta's layout would give D/64 = 1."""
    torch.manual_seed(0)
    ours = VisionTransformer(img_size=32, patch_size=16, embed_dim=96, depth=2, num_heads=3, num_classes=0,
                             init_values=1e-5, mask_token=True)
    state = ours.state_dict()
    config = ["model.variant=vit_ti16", "model.embed_dim=96", "model.depth=2", "model.num_heads=3",
              "model.init_values=1e-5"]
    save_weights(state, tmp_path / "model.safetensors", metadata={"variant": "vit_ti16", "step": "6"})
    kwargs, model = fine_tune(tmp_path / "model.safetensors", 32, config)
    assert arch(kwargs) == (16, 96, 2, 3)
    assert_loaded(model, {k: v for k, v in state.items() if k != "mask_token"})
    save_weights(state, tmp_path / "copied.safetensors")  # the metadata lost: then it is Meta's layout
    assert arch(fine_tune(tmp_path / "copied.safetensors", 32)[0]) == (16, 96, 2, 1)


def _probe() -> VisionTransformer:
    from pipeline.run.finetune import make_linear_probe

    model = VisionTransformer(**OURS_BASE)
    make_linear_probe(model)
    return model


def _mae():
    return build_mae("vit_ti16", img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, decoder_embed_dim=16,
                     decoder_depth=1, decoder_num_heads=2)


OURS_BASE = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=3)
DINO = dict(OURS_BASE, num_classes=0, init_values=1e-5, mask_token=True)
OUR_STATES = {  # what our runs export (model.safetensors) or consolidate from a checkpoint (parameters only)
    "supervised": lambda: VisionTransformer(**OURS_BASE).state_dict(),
    "pre_logits": lambda: VisionTransformer(**OURS_BASE, representation_size=24).state_dict(),
    "avg_pool_fine_tune": lambda: VisionTransformer(**OURS_BASE, global_pool="avg").state_dict(),
    "linear_probe": lambda: _probe().state_dict(),
    "dinov2_backbone": lambda: VisionTransformer(**DINO).state_dict(),
    "dinov2_reg4_swiglu_backbone": lambda: VisionTransformer(**DINO, reg_tokens=4, no_embed_class=True,
                                                             mlp_layer="swiglu").state_dict(),
    "mae_export": lambda: _mae().state_dict(),
    "mae_checkpoint_parameters": lambda: dict(_mae().named_parameters()),
}


@pytest.mark.parametrize("name", list(OUR_STATES))
def test_every_kind_of_our_weights_is_ours_and_gives_its_encoder(name):
    state = OUR_STATES[name]()
    found = recognise(state, ours=True)
    assert found.layout.startswith("ours")
    assert found.state.keys() == {k for k in state if not k.startswith(("decoder", "mask_token"))}
    assert (found.arch["patch_size"], found.arch["embed_dim"], found.arch["depth"]) == (4, 32, 2)


# --- refusals ---

def test_a_state_dict_in_two_layouts_is_refused(monkeypatch):
    timm_layout = layouts.LAYOUTS[2]
    monkeypatch.setattr(layouts, "LAYOUTS", (timm_layout, layouts.Layout("a look-alike", "the same keys",
                                                                          timm_layout.read)))
    state = build_vit("vit_ti16", img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2).state_dict()
    with pytest.raises(LayoutError, match=r"^x.pth: its keys match timm's VisionTransformer and a look-alike alike"):
        recognise(state, "x.pth")


@pytest.mark.parametrize("change,why", [
    (lambda s: s.pop("decoder_pred.bias"), "Meta's MAE pretraining checkpoint .*: no decoder_pred.bias"),
    (lambda s: s.update(extra=torch.zeros(1)), r"Meta's MAE pretraining checkpoint .*: 1 keys not in it \(extra\)"),
    (lambda s: s.pop("blocks.1.norm2.bias"), r"blocks.1.\* and blocks.0.\* have different keys"),
])
def test_a_layout_less_a_key_or_plus_one_is_none_and_says_why(change, why):
    state = random_tensors(MAE, MAE_CASES["tiny"][0])
    change(state)
    with pytest.raises(LayoutError, match=why):
        recognise(state, "x.pth")
