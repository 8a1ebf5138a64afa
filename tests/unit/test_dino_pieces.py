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

from pipeline.model.dino_head import DINOHead
from pipeline.objectives.dino.loss import DINOLoss, KoLeoLoss, iBOTPatchLoss

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


# ----------------------------------------------------------------------------- the official tests' cases,
# by formula: test_dino_official.py compares these pieces with Meta's classes but needs a checkout that CI
# lacks; each case it covers is also checked here, on tiny tensors, against the formula written out.


def _sinkhorn_by_scaling(logits: torch.Tensor, temp: float, n_total: int, iterations: int = 3) -> torch.Tensor:
    """SwAV's Sinkhorn-Knopp as a matrix scaling, written independently of the in-place form in dino.py:
    P = exp(logits / temp) / sum(P), rows = samples, columns = prototypes. Each iteration first scales
    every prototype (column) to a total mass of 1/K, then every sample (row) to 1/B; the assignment is
    B times the result, so each sample's row sums to 1."""
    p = torch.exp(logits.double() / temp)
    p = p / p.sum()
    b, k = n_total, p.shape[1]
    u, v = torch.ones(k, dtype=torch.float64), torch.ones(p.shape[0], dtype=torch.float64)  # column, row scales
    for _ in range(iterations):
        u = 1.0 / (k * (p * v[:, None]).sum(0))
        v = 1.0 / (b * (p * u[None, :]).sum(1))
    return (b * p * u[None, :] * v[:, None]).float()


def test_sinkhorn_knopp_targets_of_both_losses_are_three_scaling_iterations():
    g = torch.Generator().manual_seed(1)
    cls_t = torch.randn(6, 5, generator=g) * 0.5
    got = DINOLoss(5).sinkhorn_knopp_teacher(cls_t, 0.05)
    want = _sinkhorn_by_scaling(cls_t, 0.05, 6)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.sum(1), torch.ones(6))  # each sample's assignment sums to 1
    # the prototypes' shares move toward B/K each (what the balancing is for), from the plain softmax's
    plain = torch.softmax(cls_t / 0.05, dim=-1)
    assert (got.sum(0) - 6 / 5).abs().max() < (plain.sum(0) - 6 / 5).abs().max()
    # 2 iterations differ (the count is Meta's 3, not whatever converges)
    assert not torch.allclose(got, _sinkhorn_by_scaling(cls_t, 0.05, 6, iterations=2), atol=1e-4)

    # iBOT: the masked patches of all images are the samples, B their count (all-reduced over ranks)
    patch_t = torch.randn(9, 5, generator=g) * 0.5
    got = iBOTPatchLoss(5).sinkhorn_knopp_teacher(patch_t, 0.06, torch.tensor(9))
    torch.testing.assert_close(got, _sinkhorn_by_scaling(patch_t, 0.06, 9), atol=1e-6, rtol=1e-5)


def test_ibot_gathered_form_ignores_padding_and_weights_each_patch():
    g = torch.Generator().manual_seed(2)
    b, k = 3, 7  # 3 images of 5 patches
    masks = torch.tensor([[1, 1, 0, 0, 0], [0, 1, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)  # image 3: none
    m = int(masks.sum())
    s, t = torch.randn(m, k, generator=g) * 3, torch.softmax(torch.randn(m, k, generator=g), -1)
    ce = (t * F.log_softmax(s / 0.1, dim=-1)).sum(-1)  # per masked patch, in mask order
    loss = iBOTPatchLoss(k)
    # default weights: 1 / (the image's masked patches), then the sum over patches / the number of images
    want = -(ce[:2].sum() / 2 + ce[2:].sum() / 3) / b
    torch.testing.assert_close(loss.forward_masked(s, t, masks), want)
    # Meta pads the gathered tokens to a fixed length: rows past n_masked_patches change nothing
    pad_s = torch.cat([s, torch.full((4, k), 1e3)])
    pad_t = torch.cat([t, torch.full((4, k), 1.0)])
    torch.testing.assert_close(loss.forward_masked(pad_s, pad_t, masks, n_masked_patches=m), want)
    # masks_weight, given (Meta's collate computes it once per batch), replaces the per-image weights
    w = torch.rand(m, generator=g)
    torch.testing.assert_close(loss.forward_masked(pad_s, pad_t, masks, n_masked_patches=m, masks_weight=w),
                               -(ce * w).sum() / b)


def _head_by_formula(head: DINOHead, x: torch.Tensor, nlayers: int, use_bn: bool) -> torch.Tensor:
    """Meta's DINOHead written out: nlayers Linears (GELU between, BatchNorm before each GELU with use_bn),
    L2-normalised, then prototypes W = g * v / ||v|| row-wise, bias-free."""
    linears = [m for m in head.mlp.modules() if isinstance(m, torch.nn.Linear)]
    norms = [m for m in head.mlp.modules() if isinstance(m, torch.nn.BatchNorm1d)]
    assert len(linears) == nlayers and len(norms) == (nlayers - 1 if use_bn else 0)
    h = x
    for i, lin in enumerate(linears):
        h = F.linear(h, lin.weight, lin.bias)
        if i < nlayers - 1:
            if use_bn:
                bn = norms[i]
                mean, var = (h.mean(0), h.var(0, unbiased=False)) if head.training else (bn.running_mean, bn.running_var)
                h = (h - mean) / torch.sqrt(var + bn.eps) * bn.weight + bn.bias
            h = F.gelu(h)
    z = h / h.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    g, v = head.last_layer.weight_g, head.last_layer.weight_v
    return z @ (g * v / v.norm(dim=1, keepdim=True)).t()


@pytest.mark.parametrize("kwargs", [dict(), dict(nlayers=1), dict(nlayers=4, use_bn=True, mlp_bias=False)])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_head_output_and_gradients_are_the_formulas(kwargs, train):
    torch.manual_seed(0)
    head = DINOHead(12, 10, hidden_dim=16, bottleneck_dim=8, **kwargs).train(train)
    with torch.no_grad():  # g away from 1 and BN statistics away from identity, so a misplaced one shows
        head.last_layer.weight_g.normal_()
        for m in head.modules():
            if isinstance(m, torch.nn.BatchNorm1d):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2)
                m.weight.normal_()
                m.bias.normal_()
    x = torch.randn(6, 12)
    out = head(x)
    want = _head_by_formula(head, x, kwargs.get("nlayers", 3), kwargs.get("use_bn", False))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert all((lin.bias is None) == (kwargs.get("mlp_bias") is False)
               for lin in head.mlp.modules() if isinstance(lin, torch.nn.Linear))
    # gradients: g and v of the weight-normalised prototypes, and every MLP weight
    params = dict(head.named_parameters())
    grads = torch.autograd.grad(out.square().sum(), list(params.values()))
    want_grads = torch.autograd.grad(want.square().sum(), list(params.values()))
    for name, a, b in zip(params, grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=name)  # float32: grads up to ~100 here
    # v's gradient is orthogonal to v in each row (its scale does not matter): the reparametrisation's own
    gv = grads[list(params).index("last_layer.weight_v")]
    assert (gv * head.last_layer.weight_v).sum(1).abs().max() < 1e-5


def test_koleo_with_duplicate_points_is_the_eps_formula_and_finite():
    torch.manual_seed(0)
    x = torch.randn(8, 6)
    x[3] = x[5] * 2  # the same direction: distance 0 after normalising
    x[6] = x[1]  # and an exact copy
    a = x.clone().requires_grad_()
    loss = KoLeoLoss()(a)
    loss.backward()
    # by hand: nearest neighbour by largest cosine among the others; distance ||u_i - u_j + eps|| (torch's
    # PairwiseDistance adds eps to the difference), then -mean(log(d + eps))
    b = x.clone().requires_grad_()
    u = b / b.norm(dim=1, keepdim=True).clamp_min(1e-8)
    cos = (u @ u.t()).detach() - 3 * torch.eye(8)
    nn_idx = cos.argmax(1)
    d = ((u - u[nn_idx] + 1e-8) ** 2).sum(1).sqrt()
    want = -torch.log(d + 1e-8).mean()
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-6)
    want.backward()
    assert nn_idx[3] == 5 and nn_idx[5] == 3 and nn_idx[6] == 1 and nn_idx[1] == 6
    assert d[[1, 3, 5, 6]].max() < 1e-6  # the duplicates' terms are the eps floor: large but finite
    assert torch.isfinite(a.grad).all()
    torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)
