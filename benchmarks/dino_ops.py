"""The aten ops a DINOv2 or DINOv3 micro step dispatches (`python launch/bench.py dino-ops`): the objective's
loss (the teacher's forward, the student's, the heads, the losses) and its backward, counted on the CPU by a
`TorchDispatchMode`, for the step as it is and for the step before issue 58 fused its per-crop passes
(`per_crop`: kept here as the reference the fused step is counted and tested against, tests/unit/
test_dino_fused.py). A kernel launch on a GPU is about one dispatched op, so the count is what the CPU can say
of the step's launches; the sizes do not change it, so a tiny model with the recipe's crop count measures it.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.results import print_table
from pipeline.model.dino import gather_rows
from pipeline.objectives import OBJECTIVES, load_config
from pipeline.objectives.dino.masked import masked_weights


class PlainEngine:
    """What the objective's loss uses of a DeepSpeed engine: the module, its device, a call."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.device = module, torch.device("cpu")
        self.optimizer = torch.optim.AdamW(module.parameters())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def tiny_step(recipe: str, local_crops: int = 2, overrides: list[str] = ()) -> tuple[Any, PlainEngine,
                                                                                        tuple[torch.Tensor, ...]]:
    """A DINOv2 or DINOv3 objective on a 2-block, 64-wide backbone (heads of 256 prototypes), fp32 on the CPU,
    and a micro batch of 2 images as the loader hands it over (the recipe's own view)."""
    variant, size, local = ("vit_s14", 56, 28) if recipe == "dinov2" else ("dinov3_vits16", 64, 32)
    s = "dino" if recipe == "dinov2" else "dinov3"  # the recipe's config section
    cfg = load_config(None, [f"model.objective={recipe}", f"model.variant={variant}", f"model.img_size={size}",
                             "model.embed_dim=64", "model.depth=2", "model.num_heads=2", "model.drop_path_rate=0.0",
                             f"{s}.local_crops_number={local_crops}", f"{s}.local_crops_size={local}",
                             f"{s}.head_n_prototypes=256", f"{s}.head_hidden_dim=64",
                             f"{s}.head_bottleneck_dim=32", f"{s}.ibot_head_n_prototypes=256",
                             f"{s}.ibot_head_bottleneck_dim=32", "train.steps=100"] + [f"{s}.{o}" for o in overrides])
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


# -- the step before issue 58: a head call per kind of crop, a log-softmax and a product per crop pair
def _student(model: Any, global_crops: torch.Tensor, local_crops: torch.Tensor | None, masks: torch.Tensor | None,
             rope_aug: Any = None, mask_indices: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    g_aug, l_aug = rope_aug if rope_aug is not None else (None, None)
    g = model._tokens(global_crops, masks, g_aug)
    out = {"global_cls": g.cls_token, "global": model.dino_head(g.cls_token), "global_patch": g.patch_tokens}
    if local_crops is not None:
        out["local"] = model.dino_head(model._tokens(local_crops, None, l_aug).cls_token)
    if masks is not None:
        out["masked"] = model.patch_head(gather_rows(g.patch_tokens, masks, mask_indices))
    return out


def _teacher(model: Any, global_crops: torch.Tensor, masks: torch.Tensor | None,
             mask_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    t = model.backbone.forward_tokens(global_crops)
    first, second = t.cls_token.chunk(2)
    cls_out = model.dino_head(torch.cat([second, first]))
    if masks is None:
        return cls_out, None
    return cls_out, model.patch_head(gather_rows(t.patch_tokens, masks, mask_indices))


def _terms(objective: Any, engine: Any, views: Any, out: dict[str, torch.Tensor], t_dino: torch.Tensor,  # noqa: ARG001 - loss_terms' signature
           t_ibot: torch.Tensor | None) -> dict[str, torch.Tensor]:
    d, n_local = objective.d, views.n_local
    terms = 2 + 2 * n_local
    losses: dict[str, torch.Tensor] = {}
    if n_local:
        losses["dino_local_crops_loss"] = d.dino_loss_weight * objective.dino_loss(
            out["local"].float().chunk(n_local), list(t_dino)) / terms
    losses["dino_global_crops_loss"] = d.dino_loss_weight * objective.dino_loss(
        [out["global"].float()], [t_dino.flatten(0, 1)]) * 2 / terms
    if d.koleo_loss_weight > 0:
        losses["koleo_loss"] = d.koleo_loss_weight * sum(objective.koleo_loss(c.float())
                                                         for c in out["global_cls"].chunk(2))
    if views.masks is not None:  # unchanged by issue 58 (the iBOT targets: the objective's `targets`)
        valid = views.mask_valid
        weights = masked_weights(views.masks, views.mask_indices, valid)
        losses["ibot_loss"] = d.ibot_loss_weight * objective.ibot_loss.forward_masked(
            out["masked"].float(), t_ibot, views.masks, masks_weight=weights)
    return losses


class PerCropEngine(PlainEngine):
    """The student's forward before issue 58 (`_student`)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _student(self.module, *args, **kwargs)


@contextmanager
def per_crop(objective: Any, engine: PlainEngine) -> Iterator[PlainEngine]:
    """The objective's loss as it ran before issue 58 (commit 7326259) on the same modules: yields the engine to
    pass to `objective.loss`. The head calls and the loss terms are the old code (above); the rest is the
    objective's own (asserted: no Gram term, no anchor, which the old `loss_terms` here leaves out)."""
    assert getattr(objective, "gram", None) is None and objective.anchor is None
    teacher = objective.teacher
    objective.loss_terms = lambda *a: _terms(objective, *a)
    teacher.teacher_forward = lambda *a, **k: _teacher(teacher, *a, **k)
    try:
        yield PerCropEngine(engine.module)
    finally:
        del objective.loss_terms, teacher.teacher_forward


# -- counting
class OpCount(TorchDispatchMode):
    """Every aten op dispatched while open, by name (forward and, through autograd, backward); `views`: those
    that only make a view (`t`, `expand`, `detach`, ...), which launch no kernel on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.views = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket.__name__)] += 1
        self.views += func.is_view
        return func(*args, **(kwargs or {}))


def micro_step(objective: Any, engine: Any, crops: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, dict[str, Any]]:
    """One micro step's loss and backward from zero gradients: (the loss, each parameter's gradient)."""
    engine.module.zero_grad(set_to_none=True)
    loss = objective.loss(engine, crops, torch.zeros(crops[0].shape[0]), None)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None}


def count(objective: Any, engine: Any, crops: tuple[torch.Tensor, ...]) -> OpCount:
    """The aten ops of one micro step, counted after a first one (whose first calls differ a little)."""
    micro_step(objective, engine, crops)
    with OpCount() as ops:
        micro_step(objective, engine, crops)
    return ops


def measure(recipes: list[str], local_crops: int, log: Any = print) -> dict[str, Any]:
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    for recipe in recipes:
        objective, engine, crops = tiny_step(recipe, local_crops)
        after = count(objective, engine, crops)
        with per_crop(objective, engine) as old:
            before = count(objective, old, crops)
        n_before, n_after = sum(before.ops.values()), sum(after.ops.values())
        out[recipe] = {"before": n_before, "after": n_after, "before_not_views": n_before - before.views,
                       "after_not_views": n_after - after.views, "fewer": dict((before.ops - after.ops).most_common(6))}
        log(f"{recipe}: {n_before} -> {n_after} aten ops per micro step")
    return {"recipes": out, "local_crops": local_crops, "seconds": round(time.perf_counter() - t0, 1)}


def compiled_vs_eager(recipe: str, parts: tuple[str, ...] = ("student", "teacher", "terms")) -> dict[str, Any]:
    """The micro step with `parts` through torch.compile (default mode): all three, as train.compile would run
    it were the teacher's forward and the loss terms compiled beside the student (train.compile today: the
    student alone); graphs, graph breaks, compile time, and the loss and gradients against eager (fp32, the
    same state)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    objective, engine, crops = tiny_step(recipe)
    loss, grads = micro_step(objective, engine, crops)
    counters.clear()
    t0 = time.perf_counter()
    if "teacher" in parts:
        objective.teacher.teacher_forward = torch.compile(objective.teacher.teacher_forward)
    if "terms" in parts:
        objective.loss_terms = torch.compile(objective.loss_terms)
    if "student" in parts:
        engine.module = torch.compile(engine.module)
    micro_step(objective, engine, crops)  # compiles
    seconds = time.perf_counter() - t0
    c_loss, c_grads = micro_step(objective, engine, crops)
    c_grads = {k.removeprefix("_orig_mod."): v for k, v in c_grads.items()}
    worst = max(grads, key=lambda k: ((grads[k] - c_grads[k]).abs().max() / grads[k].abs().max()).item())
    return {"compile_s": round(seconds, 1), "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()), "loss_rel_diff": abs((c_loss / loss - 1).item()),
            "grad_rel_diff": ((grads[worst] - c_grads[worst]).abs().max() / grads[worst].abs().max()).item(),
            "grad_worst": worst}


def bench_dino_ops(args: argparse.Namespace) -> dict[str, Any]:
    """aten ops dispatched per DINOv2/DINOv3 micro step (loss + backward), before and after issue 58's fusion."""
    torch.set_num_threads(1)
    figures = measure([r.strip() for r in args.ops_recipes.split(",") if r.strip()], args.ops_local_crops)
    print_table(f"aten ops per micro step (loss + backward; 2 global + {args.ops_local_crops} local crops, tiny "
                f"model, CPU)", ["recipe", "per crop (before)", "fused (after)", "not views: before", "after",
                                 "ops removed, most first"],
                [[r, f["before"], f["after"], f["before_not_views"], f["after_not_views"],
                  ", ".join(f"{k} -{v}" for k, v in f["fewer"].items())] for r, f in figures["recipes"].items()])
    if args.ops_compiled:
        figures["compiled"] = {f"{r} {'+'.join(parts)}": compiled_vs_eager(r, parts) for r in figures["recipes"]
                               for parts in (("student", "teacher", "terms"), ("student",), ("teacher",), ("terms",))}
        for r, f in figures["compiled"].items():
            print(f"{r} compiled: {f}")
    return figures


def add_dino_ops_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ops-recipes", default="dinov2,dinov3", help="which recipes (default dinov2,dinov3)")
    p.add_argument("--ops-local-crops", type=int, default=8, help="local crops per image (default 8, Meta's)")
    p.add_argument("--ops-compiled", action="store_true", help="then the whole micro step through torch.compile "
                   "against eager: graphs, breaks, compile time, loss and gradient differences (minutes on a CPU)")
