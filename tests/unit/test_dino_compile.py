"""The multi-crop step as one graph: the DINOv2 and DINOv3 micro-batch loss (teacher forward on the global crops,
student forward on the global and local crops, the heads, iBOT's fixed-size gather, centring or Sinkhorn-Knopp,
KoLeo) traces through torch._dynamo with no graph break, so `torch.compile` sees it whole (docs/performance.md).
A data-dependent shape (`patch_tokens[masks]`) or a host read (`.item()`) in the step would each break it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.objectives import OBJECTIVES, load_config

pytestmark = pytest.mark.slow  # tracing the whole step: about 10 s a recipe


class PlainEngine:
    """What the objective's loss uses of a DeepSpeed engine: the module, its device, a call."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.device = module, torch.device("cpu")
        self.optimizer = torch.optim.AdamW(module.parameters())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def tiny_step(recipe: str) -> tuple[Any, PlainEngine, tuple[torch.Tensor, ...]]:
    variant, size, local = ("vit_s14", 56, 28) if recipe == "dinov2" else ("dinov3_vits16", 64, 32)
    s = "dino" if recipe == "dinov2" else "dinov3"  # the recipe's config section
    cfg = load_config(None, [f"model.objective={recipe}", f"model.variant={variant}", f"model.img_size={size}",
                             "model.embed_dim=64", "model.depth=2", "model.num_heads=2", "model.drop_path_rate=0.0",
                             f"{s}.local_crops_number=2", f"{s}.local_crops_size={local}",
                             f"{s}.head_n_prototypes=256", f"{s}.head_hidden_dim=64",
                             f"{s}.head_bottleneck_dim=32", "train.steps=100"]
                      + ([f"{s}.ibot_head_n_prototypes=256", f"{s}.ibot_head_bottleneck_dim=32"]
                         if recipe == "dinov3" else []))
    torch.manual_seed(0)
    objective = OBJECTIVES[recipe](cfg, SimpleNamespace(num_classes=0))
    kwargs = objective.model_kwargs()
    engine = PlainEngine(objective.build_all(kwargs))
    view = objective.train_view(kwargs).sample
    rng = np.random.default_rng(0)
    samples = [view(Image.fromarray(rng.integers(0, 255, (size + 8, size + 8, 3), dtype=np.uint8)), i)
               for i in range(2)]
    objective.before_step(engine, 0)
    return objective, engine, tuple(torch.stack(part) for part in zip(*samples))


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
