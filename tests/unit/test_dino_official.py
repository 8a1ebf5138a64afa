"""pipeline.objectives.dino's DINOHead, DINOLoss, iBOTPatchLoss and KoLeoLoss against the official classes
(facebookresearch/dinov2's dinov2/layers/dino_head.py and dinov2/loss/*.py), given the same weights and
inputs. Needs a checkout of that repository (it is not vendored here):

    DINOV2_OFFICIAL_REPO=/path/to/dinov2 .venv/bin/python -m pytest tests/unit/test_dino_official.py

Skipped without it. Checked: the official head's state dict loads into ours by the same keys (and back)
and gives the same outputs; both losses give the same teacher targets (centring and Sinkhorn-Knopp), the
same losses and the same centres over several steps; KoLeo the same value. Meta's centre update is
applied lazily at the next softmax; ours at once (see pipeline/objectives/dino/loss/__init__.py), so the centres are compared after the
official `apply_center_update`. Meta's iBOT Sinkhorn-Knopp all-reduces unconditionally, so that case runs
under a one-process gloo group (ours then all-reduces too, over one rank).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipeline.model.dino_head import DINOHead
from pipeline.objectives.dino.loss import DINOLoss, KoLeoLoss, iBOTPatchLoss

REPO = os.environ.get("DINOV2_OFFICIAL_REPO")
pytestmark = pytest.mark.skipif(
    not REPO or not (Path(REPO) / "dinov2" / "loss" / "dino_clstoken_loss.py").is_file(),
    reason="set DINOV2_OFFICIAL_REPO to a checkout of facebookresearch/dinov2")

# Same operations in the same order in float32; the margin covers matmul blocking differences only.
ATOL = 1e-6


@pytest.fixture(scope="module")
def official():
    sys.path.insert(0, REPO)
    try:
        import dinov2.layers
        import dinov2.loss

        yield dinov2
    finally:
        sys.path.remove(REPO)
        for name in [n for n in sys.modules if n == "dinov2" or n.startswith("dinov2.")]:
            del sys.modules[name]


@contextlib.contextmanager
def one_rank_group():
    """A one-process gloo group for the official code that all-reduces without asking."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kwargs", [dict(), dict(nlayers=1), dict(nlayers=4, use_bn=True, mlp_bias=False)])
def test_head_same_keys_weights_and_outputs(official, kwargs):
    torch.manual_seed(0)
    theirs = official.layers.DINOHead(24, 40, hidden_dim=32, bottleneck_dim=16, **kwargs).eval()
    with torch.no_grad():  # g away from 1 and BN statistics away from identity, so a misplaced one shows
        theirs.last_layer.weight_g.normal_()
        for m in theirs.modules():
            if isinstance(m, torch.nn.BatchNorm1d):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2)
    mine = DINOHead(24, 40, hidden_dim=32, bottleneck_dim=16, **kwargs).eval()
    theirs_sd = theirs.state_dict()
    assert {k: v.shape for k, v in mine.state_dict().items()} == {k: v.shape for k, v in theirs_sd.items()}
    mine.load_state_dict(theirs_sd)
    x = torch.randn(7, 24)
    with torch.no_grad():
        torch.testing.assert_close(mine(x), theirs(x), atol=ATOL, rtol=0)
    # And back: our state dict is one Meta's head loads.
    back = official.layers.DINOHead(24, 40, hidden_dim=32, bottleneck_dim=16, **kwargs).eval()
    back.load_state_dict(mine.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(back(x), theirs(x), atol=ATOL, rtol=0)


def test_head_gradients_match(official):
    """The weight-norm reparametrisation is differentiated the same way (g and v get the same grads)."""
    torch.manual_seed(0)
    theirs = official.layers.DINOHead(24, 40, hidden_dim=32, bottleneck_dim=16)
    mine = DINOHead(24, 40, hidden_dim=32, bottleneck_dim=16)
    mine.load_state_dict(theirs.state_dict())
    x = torch.randn(5, 24)
    theirs(x).square().sum().backward()
    mine(x).square().sum().backward()
    grads = dict(theirs.named_parameters())
    for name, p in mine.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("normalisation", ["centering", "sinkhorn_knopp"])
def test_dino_loss_targets_losses_and_centres(official, normalisation):
    torch.manual_seed(0)
    theirs, mine = official.loss.DINOLoss(32, center_momentum=0.8), DINOLoss(32, center_momentum=0.8)
    assert mine.state_dict().keys() == theirs.state_dict().keys()
    for _step in range(3):
        # Head outputs are bounded by the prototypes' norm (g, 1 at init): exp(x / temp) must not overflow.
        teacher = [torch.randn(6, 32) * 0.5 for _ in range(2)]
        students = [torch.randn(6, 32) * 3 for _ in range(4)]
        if normalisation == "centering":
            t_theirs = theirs.softmax_center_teacher(torch.cat(teacher), teacher_temp=0.05).chunk(2)
            t_mine = mine.softmax_center_teacher(torch.cat(teacher), teacher_temp=0.05).chunk(2)
            theirs.update_center(torch.cat(teacher))
            mine.update_center(torch.cat(teacher))
        else:
            t_theirs = theirs.sinkhorn_knopp_teacher(torch.cat(teacher), teacher_temp=0.05).chunk(2)
            t_mine = mine.sinkhorn_knopp_teacher(torch.cat(teacher), teacher_temp=0.05).chunk(2)
        for a, b in zip(t_mine, t_theirs):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
        torch.testing.assert_close(mine(students, t_mine), theirs(students, t_theirs), atol=1e-5, rtol=1e-6)
        theirs.apply_center_update()
        torch.testing.assert_close(mine.center, theirs.center, atol=ATOL, rtol=0)
    if normalisation == "centering":
        assert mine.center.abs().sum() > 0  # the centres did move, so the comparison meant something


def _masks(batch, n, generator):
    masks = torch.rand(batch, n, generator=generator) < 0.4
    masks[-1] = False  # an image without masked patches: Meta's clamp(min=1) case
    return masks


@pytest.mark.parametrize("normalisation", ["centering", "sinkhorn_knopp"])
def test_ibot_loss_targets_losses_and_centres(official, normalisation):
    g = torch.Generator().manual_seed(0)
    theirs, mine = official.loss.iBOTPatchLoss(20, center_momentum=0.7), iBOTPatchLoss(20, center_momentum=0.7)
    assert mine.state_dict().keys() == theirs.state_dict().keys()
    for _step in range(3):
        b, n, k = 4, 9, 20
        teacher = torch.randn(b, n, k, generator=g) * 0.5
        student = torch.randn(b, n, k, generator=g) * 3
        masks = _masks(b, n, g)
        m = int(masks.sum())
        if normalisation == "centering":
            # Meta's meta-arch hands the gathered tokens as (1, M, K), the centre's rank.
            t_theirs = theirs.softmax_center_teacher(teacher[masks].unsqueeze(0), teacher_temp=0.06).squeeze(0)
            t_mine = mine.softmax_center_teacher(teacher[masks].unsqueeze(0), teacher_temp=0.06).squeeze(0)
            theirs.update_center(teacher)
            mine.update_center(teacher)
        else:
            with one_rank_group():
                t_theirs = theirs.sinkhorn_knopp_teacher(teacher[masks], 0.06, torch.tensor(m))
                t_mine = mine.sinkhorn_knopp_teacher(teacher[masks], 0.06, torch.tensor(m))
        torch.testing.assert_close(t_mine, t_theirs, atol=ATOL, rtol=0)
        # Gathered form, padded as Meta pads (n_masked_patches cuts the padding off).
        pad_s = torch.cat([student[masks], torch.randn(3, k, generator=g)])
        pad_t = torch.cat([t_mine, torch.rand(3, k, generator=g)])
        torch.testing.assert_close(mine.forward_masked(pad_s, pad_t, masks, n_masked_patches=m),
                                   theirs.forward_masked(pad_s, pad_t, masks, n_masked_patches=m),
                                   atol=1e-5, rtol=1e-6)
        weights = torch.rand(m, generator=g)
        torch.testing.assert_close(mine.forward_masked(student[masks], t_mine, masks, masks_weight=weights),
                                   theirs.forward_masked(student[masks], t_mine, masks, masks_weight=weights),
                                   atol=1e-5, rtol=1e-6)
        # Dense form, on dense teacher targets.
        dense_t = torch.softmax(teacher / 0.06, dim=-1)
        torch.testing.assert_close(mine(student, dense_t, masks), theirs(student, dense_t, masks),
                                   atol=1e-5, rtol=1e-6)
        theirs.apply_center_update()
        torch.testing.assert_close(mine.center, theirs.center, atol=ATOL, rtol=0)
    if normalisation == "centering":
        assert mine.center.abs().sum() > 0


def test_koleo_same_value_and_gradient(official):
    torch.manual_seed(0)
    x = torch.randn(16, 12)
    x[3] = x[5] * 2  # an exact nearest neighbour (distance 0 after normalising): the eps path
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss_mine, loss_theirs = KoLeoLoss()(a), official.loss.KoLeoLoss()(b)
    torch.testing.assert_close(loss_mine, loss_theirs, atol=ATOL, rtol=0)
    loss_mine.backward()
    loss_theirs.backward()
    torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("extra", [[], ["model.reg_tokens=4", "model.init_values=1e-5", "model.mlp_layer=swiglu",
                                        "dino.ibot_separate_head=true"]])
def test_param_groups_match_metas_get_params_groups_with_decay(extra):
    """Every student parameter's lr multiplier (layer-wise decay 0.9 x the patch embedding's 0.2), weight
    decay (on or off) and last-layer flag as Meta's `dinov2/utils/param_groups.py` gives them: its
    function is run on each submodel of ours (backbone, dino_head, ibot_head, as `SSLMetaArch` calls it
    per submodel), under Meta's parameter names (`register_tokens` for our `reg_token`)."""
    from pipeline.objectives import OBJECTIVES, load_config
    from pipeline.train.optim import param_groups

    sys.path.insert(0, REPO)
    try:
        from dinov2.utils.param_groups import get_params_groups_with_decay
    finally:
        sys.path.remove(REPO)
    cfg = load_config(None, ["model.objective=dinov2", "model.variant=vit_ti16", "model.img_size=16",
                             "model.patch_size=4", "model.embed_dim=32", "model.depth=3", "model.num_heads=2",
                             "dino.local_crops_size=8", "dino.head_n_prototypes=64", "dino.head_hidden_dim=32",
                             "dino.head_bottleneck_dim=16", "dino.ibot_head_n_prototypes=48",
                             "train.layer_decay=0.9", "train.lr=1.0", "train.weight_decay=0.04", *extra])
    obj = OBJECTIVES["dinov2"](cfg, type("Info", (), {"num_classes": 0})())
    model = obj.build_all(obj.model_kwargs())
    mine = {id(p): g for g in param_groups(model, cfg.train, depth=3) for p in g["params"]}

    class MetaNamed(torch.nn.Module):
        """One submodel's parameters under Meta's names; `blocks` as long as the backbone's (Meta counts them)."""

        def __init__(self, sub: torch.nn.Module, blocks: int) -> None:
            super().__init__()
            self.named = [(n.replace("reg_token", "register_tokens"), p) for n, p in sub.named_parameters()]
            if blocks:
                self.blocks = [None] * blocks

        def named_parameters(self, *args, **kwargs):
            return iter(self.named)

    theirs = []
    for sub, blocks in ((model.backbone, 3), (model.dino_head, 0), (model.ibot_head, 0)):
        if sub is not None:
            theirs += get_params_groups_with_decay(MetaNamed(sub, blocks), lr_decay_rate=0.9, patch_embed_lr_mult=0.2)
    assert len(theirs) == sum(1 for _ in model.parameters())
    for d in theirs:
        g = mine[id(d["params"])]
        assert g["lr_scale"] == pytest.approx(d["lr_multiplier"]), d["name"]
        assert (g["weight_decay"] > 0) == (d["wd_multiplier"] == 1.0), d["name"]
        assert (g.get("role") == "last_layer") == d["is_last_layer"], d["name"]
