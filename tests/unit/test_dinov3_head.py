"""The dinov3 recipe's DINO and iBOT heads are Meta's DINOv3 head (dinov3/layers/dino_head.py): the MLP and the
L2-normalised bottleneck of DINOv2's, then a plain bias-free Linear of prototypes drawn truncated-normal(0.02),
decayed as every matrix is. Always against the formula; with a checkout of facebookresearch/dinov3 (Meta's
DINOv3 License, not vendored) against Meta's class:

    DINOV3_OFFICIAL_REPO=/path/to/dinov3 .venv/bin/python -m pytest tests/unit/test_dinov3_head.py
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.model.dino_head import DINOHead, DINOv3Head
from pipeline.objectives import OBJECTIVES, load_config
from pipeline.train.optim import param_groups

REPO = os.environ.get("DINOV3_OFFICIAL_REPO")
META_HEAD = Path(REPO or ".") / "dinov3" / "layers" / "dino_head.py"
META_KEYS = ["mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias", "mlp.4.weight", "mlp.4.bias",
             "last_layer.weight"]  # Meta's DINOHead(12, 30, hidden_dim=20, bottleneck_dim=8).state_dict()


def dinov3_student():
    cfg = load_config(None, ["model.objective=dinov3", "model.variant=dinov3_vits16", "model.img_size=16",
                             "model.patch_size=4", "model.embed_dim=32", "model.depth=2", "model.num_heads=2",
                             "dinov3.local_crops_size=8", "dinov3.head_n_prototypes=64", "dinov3.head_hidden_dim=32",
                             "dinov3.head_bottleneck_dim=16", "dinov3.ibot_head_n_prototypes=48",
                             "dinov3.ibot_head_bottleneck_dim=16", "train.weight_decay=0.04"])
    objective = OBJECTIVES["dinov3"](cfg, type("Info", (), {"num_classes": 0})())
    return objective.build_all(objective.model_kwargs()), cfg


def test_keys_init_and_output_are_metas_by_formula():
    torch.manual_seed(0)
    head = DINOv3Head(12, 30, hidden_dim=20, bottleneck_dim=8)
    assert list(head.state_dict()) == META_KEYS
    assert type(head.last_layer) is torch.nn.Linear and head.last_layer.bias is None
    x = torch.randn(5, 12)
    bottleneck = F.normalize(head.mlp(x), dim=-1)
    torch.testing.assert_close(head(x), bottleneck @ head.last_layer.weight.T)  # no weight normalisation
    big = DINOv3Head(12, 4096, hidden_dim=20, bottleneck_dim=64).last_layer.weight
    assert big.std().item() == pytest.approx(0.02, rel=0.05)  # trunc-normal(0.02), as Meta's init_weights
    # DINOv2's prototypes start at norm 1 (weight-normalised); DINOv3's at about 0.02 x sqrt(64) = 0.16.
    assert big.norm(dim=1).mean().item() == pytest.approx(0.16, rel=0.05)
    assert DINOHead(12, 30, hidden_dim=20, bottleneck_dim=8).last_layer.weight.norm(dim=1).allclose(torch.ones(30))


def test_the_dinov3_recipes_heads_are_metas_and_their_prototypes_are_decayed_and_frozen_first():
    model, cfg = dinov3_student()
    for head in (model.dino_head, model.ibot_head):
        assert isinstance(head, DINOv3Head) and list(head.state_dict()) == META_KEYS
    by_param = {id(p): g for g in param_groups(model, cfg.train, depth=2) for p in g["params"]}
    for name, p in model.named_parameters():
        if name.startswith(("dino_head.", "ibot_head.")):
            g = by_param[id(p)]
            # Meta's get_params_groups_with_decay: decay off for biases, norms, gammas; dino_head_wd_multiplier 1.
            assert (g["weight_decay"] > 0) == (not name.endswith("bias")), name
            assert (g.get("role") == "last_layer") == (".last_layer." in name), name  # lr 0 while frozen


@pytest.mark.skipif(not REPO or not META_HEAD.is_file(),
                    reason="set DINOV3_OFFICIAL_REPO to a checkout of facebookresearch/dinov3")
def test_a_head_from_metas_training_code_loads_unchanged_and_gives_the_same_output():
    spec = importlib.util.spec_from_file_location("meta_dinov3_dino_head", META_HEAD)  # torch only: no package
    meta = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(meta)
    torch.manual_seed(0)
    theirs = meta.DINOHead(12, 30, hidden_dim=20, bottleneck_dim=8)
    theirs.init_weights()  # as SSLMetaArch does
    assert list(theirs.state_dict()) == META_KEYS
    ours = DINOv3Head(12, 30, hidden_dim=20, bottleneck_dim=8)
    ours.load_state_dict(theirs.state_dict())  # strict: the same keys and shapes
    x = torch.randn(5, 12)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=0, rtol=0)
    assert theirs.last_layer.weight.std().item() == pytest.approx(0.02, rel=0.3)  # the init this head copies
