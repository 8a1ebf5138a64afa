"""DINOv3's Gram loss (pipeline/objectives/dinov3/gram_loss.py) against the paper's formula written out, and its
gradient where negatives are removed. Meta's own GramLoss and Sinkhorn-Knopp: tests/unit/test_dinov3_official.py
(with a checkout); the Sinkhorn-Knopp targets against their formula: tests/unit/test_dino_pieces.py."""

from __future__ import annotations

import pytest
import torch

from pipeline.objectives.dinov3.gram_loss import GramLoss


def gram_formula(s, t, img_level, norm=True, remove=None):
    """The paper's Gram loss written out in float64: per image (or over all patches) the matrices of all
    pairwise similarities, then the mean squared difference over every entry."""
    s, t = s.double(), t.double()
    if norm:
        s, t = s / s.norm(dim=-1, keepdim=True), t / t.norm(dim=-1, keepdim=True)
    pairs = [(s[b], t[b]) for b in range(len(s))] if img_level else [(s.reshape(-1, s.shape[-1]), t.reshape(-1, t.shape[-1]))]
    total, count = 0.0, 0
    for a, b in pairs:
        for i in range(len(a)):
            for j in range(len(a)):
                x, y = float(a[i] @ a[j]), float(b[i] @ b[j])
                if remove == "both":
                    x, y = max(x, 0.0), max(y, 0.0)
                elif remove == "teacher":
                    y = max(y, 0.0)
                total += (x - y) ** 2
                count += 1
    return total / count


@pytest.mark.parametrize("img_level", [True, False])
@pytest.mark.parametrize("norm,remove", [(True, None), (False, None), (True, "both"), (True, "teacher")])
def test_gram_loss_is_the_mse_between_gram_matrices(img_level, norm, remove):
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, 5, 8, generator=g), torch.randn(3, 5, 8, generator=g)
    loss = GramLoss(apply_norm=norm, remove_neg=remove == "both", remove_only_teacher_neg=remove == "teacher")
    assert float(loss(s, t, img_level=img_level)) == pytest.approx(gram_formula(s, t, img_level, norm, remove), rel=1e-5)


def test_removed_negatives_get_no_gradient_and_the_options_are_exclusive():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(1, 6, 4, generator=g, requires_grad=True)
    t = torch.randn(1, 6, 4, generator=g)
    GramLoss(apply_norm=False, remove_neg=True)(s, t).backward()
    # A patch whose similarities with every other patch are negative only moves through its own (positive) one.
    sim = (s @ s.transpose(1, 2)).detach()[0]
    kept = (sim >= 0).float()
    target = (t @ t.transpose(1, 2))[0].clamp_min(0)
    expected = 2 * (((sim * kept - target) * kept) @ s.detach()[0] + ((sim * kept - target) * kept).T @ s.detach()[0])
    torch.testing.assert_close(s.grad[0], expected / 36, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="exclusive"):
        GramLoss(remove_neg=True, remove_only_teacher_neg=True)

