"""pipeline.model.mae against the official code itself (facebookresearch/mae's models_mae.py), given the
same weights, images and noise. Needs a checkout of that repository (it is not vendored here):

    MAE_OFFICIAL_REPO=/path/to/mae .venv/bin/python -m pytest tests/unit/test_mae_official.py

Skipped without it. Two shims let the 2021 code run on current libraries, changing nothing it computes:
timm's Block no longer takes `qk_scale` (the official passes None, the default scale), and numpy dropped
the `np.float` alias (float64) its pos_embed.py uses. The official forward draws its own noise with
torch.rand; the test hands it ours.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.model.mae import build_mae

REPO = os.environ.get("MAE_OFFICIAL_REPO")
pytestmark = pytest.mark.skipif(not REPO or not (Path(REPO) / "models_mae.py").is_file(),
                                reason="set MAE_OFFICIAL_REPO to a checkout of facebookresearch/mae")


@pytest.fixture(scope="module")
def models_mae(monkeypatch_module):
    import timm.models.vision_transformer as tv

    class Block(tv.Block):  # the official passes qk_scale=None: timm's default scale, an argument no more
        def __init__(self, *args, qk_scale=None, **kwargs):
            super().__init__(*args, **kwargs)

    monkeypatch_module.setattr(tv, "Block", Block)
    monkeypatch_module.setattr(np, "float", float, raising=False)
    monkeypatch_module.syspath_prepend(REPO)
    spec = importlib.util.spec_from_file_location("models_mae_official", Path(REPO) / "models_mae.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("util", None)
    sys.modules.pop("util.pos_embed", None)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.parametrize("name,variant,depth", [("mae_vit_base_patch16", "vit_b16", 12),
                                                ("mae_vit_large_patch16", "vit_l16", 2)])
def test_same_weights_images_and_noise_give_the_official_loss_prediction_and_mask(models_mae, name, variant, depth):
    torch.manual_seed(0)
    official = models_mae.__dict__[name](norm_pix_loss=True).eval()
    official.blocks = official.blocks[:depth]  # L/16 cut to 2 blocks: the same code path, less CPU
    ours = build_mae(variant, depth=depth).eval()
    state = official.state_dict()
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in ours.state_dict().items()}
    torch.testing.assert_close(ours.pos_embed, state["pos_embed"], atol=0, rtol=0)  # the tables, bit for bit
    torch.testing.assert_close(ours.decoder_pos_embed, state["decoder_pos_embed"], atol=0, rtol=0)
    ours.load_state_dict(state)  # Meta's layout loads unchanged
    imgs, noise = torch.randn(2, 3, 224, 224), torch.rand(2, 196)
    real_rand = torch.rand
    torch.rand = lambda *a, **k: noise.clone()  # the official random_masking draws torch.rand(N, L)
    try:
        with torch.no_grad():
            loss_o, pred_o, mask_o = official(imgs, mask_ratio=0.75)
    finally:
        torch.rand = real_rand
    with torch.no_grad():
        loss, pred, mask = ours(imgs, mask_ratio=0.75, noise=noise)
    assert torch.equal(mask, mask_o)
    torch.testing.assert_close(pred, pred_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, loss_o, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", ["tiny", "vit_b16"])
def test_the_layout_table_is_the_officials_and_its_checkpoint_fine_tunes_to_its_encoder(models_mae, tmp_path, case):
    """tests/unit/test_layouts.py's MAE table is the official state_dict's keys and shapes; a checkpoint saved as
    main_pretrain.py saves it fine-tunes through --from into an encoder whose features are the official's."""
    import argparse
    from functools import partial

    from torch import nn

    from tests.unit.test_layouts import MAE, MAE_CASES, fine_tune, shapes

    size, config, (_, _, _, heads) = MAE_CASES[case]
    torch.manual_seed(0)
    official = models_mae.MaskedAutoencoderViT(
        img_size=size["img"], patch_size=size["P"], embed_dim=size["D"], depth=size["L"], num_heads=heads,
        decoder_embed_dim=size["Dd"], decoder_depth=size["Ld"], decoder_num_heads=2,
        norm_layer=partial(nn.LayerNorm, eps=1e-6)).eval()  # the eps of the official mae_vit_* models
    state = official.state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == shapes(MAE, size)
    torch.save({"model": state, "epoch": 0, "args": argparse.Namespace(model="mae")}, tmp_path / "checkpoint-0.pth")
    _, ours = fine_tune(tmp_path / "checkpoint-0.pth", size["img"], config)
    ours.eval()
    x = torch.randn(2, 3, size["img"], size["img"])
    patches = (size["img"] // size["P"]) ** 2
    real_rand = torch.rand
    torch.rand = lambda *a, **k: torch.arange(patches, dtype=torch.float32).expand(2, -1)  # keep all, in order
    try:
        with torch.no_grad():
            latent, _, _ = official.forward_encoder(x, mask_ratio=0.0)
    finally:
        torch.rand = real_rand
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_features(x), latent, atol=1e-5, rtol=1e-5)
