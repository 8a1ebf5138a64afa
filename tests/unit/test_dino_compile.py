"""The multi-crop step as one graph: the DINOv2 and DINOv3 micro-batch loss (teacher forward on the global crops,
student forward on the global and local crops, the heads, iBOT's fixed-size gather, centring or Sinkhorn-Knopp,
KoLeo) traces through torch._dynamo with no graph break, so `torch.compile` sees it whole (docs/performance.md).
A data-dependent shape (`patch_tokens[masks]`) or a host read (`.item()`) in the step would each break it."""

from __future__ import annotations

import pytest
import torch

from benchmarks.dino_ops import tiny_step

pytestmark = pytest.mark.slow  # tracing the whole step: about 10 s a recipe


@pytest.mark.parametrize("recipe", ["dinov2", "dinov3"])
def test_the_dino_micro_batch_loss_is_one_graph(recipe):
    objective, engine, crops = tiny_step(recipe)
    targets = torch.zeros(crops[0].shape[0])
    explained = torch._dynamo.explain(lambda c: objective.loss(engine, c, targets, None))(crops)
    reasons = [f"{b.reason} at {b.user_stack[-1].filename}:{b.user_stack[-1].lineno}" if b.user_stack else
               str(b.reason) for b in explained.break_reasons]
    assert explained.graph_break_count == 0 and explained.graph_count == 1, reasons
    assert torch.isfinite(objective.loss(engine, crops, targets, None))  # and the step itself runs eagerly


def test_a_host_read_is_a_graph_break_the_count_sees():
    """The count above can fail: a loss followed by an `.item()` breaks the graph (cheap: a tiny function)."""
    def with_a_read(x: torch.Tensor) -> torch.Tensor:
        loss = (x * x).mean()
        return loss * 2 if loss.item() > 0 else loss

    assert torch._dynamo.explain(with_a_read)(torch.randn(4)).graph_break_count >= 1
