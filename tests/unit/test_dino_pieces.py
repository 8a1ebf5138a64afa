"""pipeline.objectives.dino on 2 ranks equals 1 rank: the centre updates and the Sinkhorn-Knopp targets
all-reduce (synchronously), so 2 gloo processes holding half the batch each give the centres and targets
of one process holding all of it, and the mean of their losses its loss. Also: the pieces without any
process group, against the formulas written out here (the official comparison is test_dino_official.py).
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from pipeline.objectives.dino import DINOHead, DINOLoss, KoLeoLoss, iBOTPatchLoss

B, N, K = 8, 6, 16  # global batch (even: each rank gets half), patches per image, prototypes
STEPS = 3


def _data(step):
    g = torch.Generator().manual_seed(100 + step)
    # Teacher outputs of the scale a head gives (|x| <= the prototypes' norm): exp(x / 0.05) stays finite.
    cls_t = torch.randn(B, K, generator=g) * 0.5
    cls_s = torch.randn(B, K, generator=g) * 3
    patch_t = torch.randn(B, N, K, generator=g) * 0.5
    patch_s = torch.randn(B, N, K, generator=g) * 3
    masks = torch.rand(B, N, generator=g) < 0.5
    masks[:, 0] = True  # every image has a masked patch, so each rank's share is well defined
    return cls_t, cls_s, patch_t, patch_s, masks


def _run(rank, world):
    """STEPS steps of both losses with both teacher normalisations on this rank's share of the batch."""
    sl = slice(rank * B // world, (rank + 1) * B // world)
    dino, ibot = DINOLoss(K), iBOTPatchLoss(K)
    out = {}
    for step in range(STEPS):
        cls_t, cls_s, patch_t, patch_s, masks = (t[sl] for t in _data(step))
        t_center = dino.softmax_center_teacher(cls_t, 0.05)
        t_sk = dino.sinkhorn_knopp_teacher(cls_t, 0.05)
        dino.update_center(cls_t)
        pt_center = ibot.softmax_center_teacher(patch_t[masks].unsqueeze(0), 0.05).squeeze(0)
        pt_sk = ibot.sinkhorn_knopp_teacher(patch_t[masks], 0.05, torch.tensor(int(masks.sum())))
        ibot.update_center(patch_t)
        out[step] = dict(
            t_center=t_center, t_sk=t_sk, pt_center=pt_center, pt_sk=pt_sk,
            dino_center=dino.center.clone(), ibot_center=ibot.center.clone(),
            dino_loss=dino([cls_s], [t_sk]), ibot_loss=ibot.forward_masked(patch_s[masks], pt_sk, masks))
    return out


def _worker(rank, world, port, path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.save(_run(rank, world), f"{path}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_with_half_the_batch_equal_one_rank_with_all(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, str(tmp_path / "out")), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"out.{r}") for r in range(2)]
    single = _run(0, 1)
    for step in range(STEPS):
        for key in ("t_center", "t_sk", "pt_center", "pt_sk"):  # targets: the ranks' rows, in order
            torch.testing.assert_close(torch.cat([r[step][key] for r in ranks]), single[step][key],
                                       atol=1e-6, rtol=1e-5, msg=f"step {step} {key}")
        for key in ("dino_center", "ibot_center"):  # centres: the same on every rank and as on one
            for r in ranks:
                torch.testing.assert_close(r[step][key], single[step][key], atol=1e-6, rtol=1e-5,
                                           msg=f"step {step} {key}")
        # Equal halves: the mean of the ranks' losses is the loss over all (what DDP's mean gradient sees).
        # iBOT's loss is per image then averaged, so this holds whatever each rank's number of masked patches.
        for key in ("dino_loss", "ibot_loss"):
            torch.testing.assert_close(sum(r[step][key] for r in ranks) / 2, single[step][key],
                                       atol=1e-5, rtol=1e-5, msg=f"step {step} {key}")
    # Sinkhorn-Knopp's targets are assignments: each sample's row sums to 1 (its last step normalises them).
    torch.testing.assert_close(torch.cat([r[0]["t_sk"] for r in ranks]).sum(1), torch.ones(B))


def test_without_a_process_group_the_formulas_hold():
    torch.manual_seed(0)
    cls_t, cls_s, patch_t, patch_s, masks = _data(0)
    dino = DINOLoss(K, student_temp=0.2, center_momentum=0.9)
    dino.update_center(cls_t)
    torch.testing.assert_close(dino.center, 0.1 * cls_t.mean(0, keepdim=True))
    t = dino.softmax_center_teacher(cls_t, 0.04)
    torch.testing.assert_close(t, F.softmax((cls_t - 0.1 * cls_t.mean(0)) / 0.04, dim=-1))
    expected = -(t * F.log_softmax(cls_s / 0.2, dim=-1)).sum(-1).mean() * 2 * 2  # 2 students x 2 teachers
    torch.testing.assert_close(dino([cls_s, cls_s], [t, t]), expected)

    ibot = iBOTPatchLoss(K, center_momentum=0.5)
    ibot.update_center(patch_t)
    torch.testing.assert_close(ibot.center, 0.5 * patch_t.mean((0, 1)).view(1, 1, K))
    tp = F.softmax(patch_t / 0.1, dim=-1)
    per_patch = (tp * F.log_softmax(patch_s / 0.1, dim=-1)).sum(-1)
    per_image = (per_patch * masks).sum(-1) / masks.sum(-1)
    torch.testing.assert_close(ibot(patch_s, tp, masks), -per_image.mean())
    torch.testing.assert_close(ibot.forward_masked(patch_s[masks], tp[masks], masks), -per_image.mean())

    x = torch.randn(10, 5)
    u = F.normalize(x, dim=-1)
    d = torch.cdist(u, u) + torch.eye(10) * 10
    torch.testing.assert_close(KoLeoLoss()(x), -torch.log(d.min(1).values + 1e-8).mean(), atol=1e-5, rtol=0)


def test_head_keys_and_normalised_prototypes():
    head = DINOHead(12, 30, hidden_dim=20, bottleneck_dim=8)
    assert list(head.state_dict()) == ["mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias",
                                       "mlp.4.weight", "mlp.4.bias", "last_layer.weight_g", "last_layer.weight_v"]
    assert head.last_layer.weight_g.shape == (30, 1) and head.last_layer.weight_v.shape == (30, 8)
    with torch.no_grad():
        head.last_layer.weight_v.mul_(7)  # v's scale does not matter, g's does
        torch.testing.assert_close(head.last_layer.weight.norm(dim=1), torch.ones(30))
        head.last_layer.weight_g.fill_(2)
        assert head(torch.randn(3, 12)).abs().max() <= 2 + 1e-5  # unit bottleneck, prototypes of norm 2
