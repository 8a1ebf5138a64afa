"""The multi-crop step's per-crop passes fused (issue 58): one head call over every crop's class tokens (and the
masked patches when the DINO head is the patch head), one log-softmax and one product for the DINO terms, one
batched KoLeo. Against the step before it (benchmarks/dino_ops.py: `per_crop`, checked bit-equal to the
objective at commit 7326259 when it was written): the same loss and gradients in fp32 (loss within 1e-6
relative; each gradient within 2e-6 of its largest entry: a matmul over more rows, and the sums in another
order; measured at most 5e-7) and fewer aten ops dispatched per micro step (the figures in
docs/performance.md come from `python launch/bench.py dino-ops`). In-process, tiny models: about 1 s a case."""

from __future__ import annotations

import pytest
import torch

from benchmarks.dino_ops import count, micro_step, per_crop, tiny_step
from pipeline.objectives.dino.loss import DINOLoss, KoLeoLoss


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: about 1 s a case on one thread, 40-90 s on two threads of a loaded 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("recipe,overrides", [
    ("dinov2", []),  # its defaults: one head for the class tokens and the masked patches, centring
    ("dinov3", []),  # its defaults: a separate iBOT head, Sinkhorn-Knopp
    ("dinov2", ["ibot_separate_head=true", "centering=sinkhorn_knopp"]),
])
def test_the_fused_step_equals_the_per_crop_step_with_fewer_ops(recipe, overrides):
    objective, engine, crops = tiny_step(recipe, local_crops=8, overrides=overrides)
    loss, grads = micro_step(objective, engine, crops)
    fused = sum(count(objective, engine, crops).ops.values())
    with per_crop(objective, engine) as old_engine:
        old_loss, old_grads = micro_step(objective, old_engine, crops)
        before = sum(count(objective, old_engine, crops).ops.values())
    torch.testing.assert_close(loss, old_loss, rtol=1e-6, atol=0)
    assert grads.keys() == old_grads.keys()
    for name, grad in grads.items():
        scale = old_grads[name].abs().max().item()
        torch.testing.assert_close(grad, old_grads[name], rtol=0, atol=2e-6 * scale, msg=name)
    # 8 local crops: the per-crop step's head calls, log-softmaxes and pair products grow with the crops
    # (DINOv2 1378 -> 942, DINOv3 1730 -> 1414 when written); the fused step's count does not.
    assert fused < before * 0.9, (fused, before)
    objective2, engine2, crops2 = tiny_step(recipe, local_crops=2, overrides=overrides)
    assert sum(count(objective2, engine2, crops2).ops.values()) == fused


def test_the_batched_pieces_equal_the_per_crop_calls():
    """The loss pieces alone, where the counts above cannot tell which term moved: `crops_losses` against
    `forward`'s lists, the batched KoLeo against a call per set."""
    g = torch.Generator().manual_seed(0)
    loss, batch, k, local = DINOLoss(32, student_temp=0.1), 4, 32, 3
    student = torch.randn((2 + local) * batch, k, generator=g)
    teacher = torch.softmax(torch.randn(2, batch, k, generator=g), -1)
    global_loss, local_loss = loss.crops_losses(student, teacher)
    torch.testing.assert_close(global_loss, loss([student[:2 * batch]], [teacher.flatten(0, 1)]) * 2)
    torch.testing.assert_close(local_loss, loss(list(student[2 * batch:].chunk(local)), list(teacher)))
    x = torch.randn(2, 6, 8, generator=g)
    koleo = KoLeoLoss()
    torch.testing.assert_close(koleo(x), torch.stack([koleo(x[0]), koleo(x[1])]))
