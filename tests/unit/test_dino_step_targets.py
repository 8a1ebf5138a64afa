"""Sinkhorn-Knopp over the step's global batch with gradient accumulation (pipeline/objectives/dino/targets.py):
`begin_step` on a step of two micro batches gives each the targets that one micro batch of all the step's
images gets, where normalising each micro batch apart (the round, as before) does not. In-process, a tiny
DINOv3 (Sinkhorn-Knopp is its default) on one thread; the 2 -> 1 rank resume: tests/integration/test_dinov3.py."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from benchmarks.dino_ops import tiny_step


def test_a_steps_micro_batches_get_the_targets_of_the_whole_global_batch():
    torch.set_num_threads(1)
    objective, engine, _ = tiny_step("dinov3", local_crops=0)
    assert objective.step_targets()
    view = objective.train_view(objective.model_kwargs()).sample
    rng = np.random.default_rng(1)
    samples = [view(Image.fromarray(rng.integers(0, 255, (72, 72, 3), dtype=np.uint8)), i) for i in range(6)]
    whole = tuple(torch.stack(part) for part in zip(*samples))
    halves = [tuple(p[:3] for p in whole), tuple(p[3:] for p in whole)]
    temp = objective.teacher_temp(objective.step)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a teacher whose outputs differ between images (at its init they barely do)
        for p in objective.teacher.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)

    def alone(images):  # the targets of one micro batch normalised over itself
        views = objective.masked_views(images)
        return objective.targets(*objective.teacher_outputs(engine, views), views, temp)

    t_dino, t_ibot = alone(whole)
    objective.begin_step(engine, halves)
    ahead = [objective._ahead[id(h[0])][1:] for h in halves]  # (views, DINO, iBOT targets)
    # DINO's rows are crop-major per micro batch: (crop, sample) of the whole is (crop, sample) of its half.
    got = torch.cat([a[0].view(2, 3, -1) for a in ahead], dim=1)
    torch.testing.assert_close(got, t_dino.view(2, 6, -1), rtol=0, atol=1e-5)
    # iBOT's rows (the masked patches, in another order per micro batch): each prototype's share of the step.
    assert t_ibot is not None and all(a[1] is not None for a in ahead)
    torch.testing.assert_close(sum(a[1].sum(0) for a in ahead), t_ibot.sum(0), rtol=0, atol=1e-5)
    # Each half normalised apart (each round of micro batches, before): other targets.
    apart = [alone(h) for h in halves]
    assert not torch.allclose(torch.cat([a[0].view(2, 3, -1) for a in apart], dim=1), t_dino.view(2, 6, -1),
                              atol=1e-4)
    assert not torch.allclose(sum(a[1].sum(0) for a in apart), t_ibot.sum(0), atol=1e-4)
    # loss() takes begin_step's targets for those micro batches, and forgets them
    for h in halves:
        assert torch.isfinite(objective.loss(engine, h, torch.zeros(3), None))
    assert objective._ahead == {}
