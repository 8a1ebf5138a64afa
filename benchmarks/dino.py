"""A DINOv2 training step against a supervised one on the same backbone: what the recipe costs, and
whether `DINOv2.flops_per_image` predicts it.

Both steps are the trainer's work in plain PyTorch (forward, loss, backward, AdamW with the trainer's
parameter groups), on the same backbone weights, measured in turns (`benchmarks.common.interleaved`).
The DINOv2 step is the objective's own code (`DINOv2.before_step`, `loss`, then `after_step`: the
teacher's forward on the 2 global crops, the student's on the global and local crops with iBOT masks drawn
by the objective's train view, the heads, the losses, the centres and the teacher's EMA); the supervised one classifies
the global crop's size into 1000 classes. Crops, heads and prototypes are the recipe's
(`configs/pretrain/dinov2_vit*14.yaml`: 2 x 224 + 8 x 98, 65,536 prototypes) unless the flags say else.

FLOPs, per image: `predicted` is 3 x the objective's `flops_per_image` (the trainer's MFU numerator:
forward + backward, the teacher's forward counted once) and the ViT's `model_flops` for the supervised
step; `measured` is what `torch.utils.flop_counter.FlopCounterMode` counts over one whole step (matmuls,
convolutions, attention; forward, backward and the teacher; not the element-wise work). Their ratio says
how far MFU figures computed from the prediction are off. The prediction takes iBOT's masked patches at
their expected number, the count at the number this batch drew (both are in the figures): with a small
batch they differ.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from benchmarks.common import bench_device, interleaved, median, profile_step, spread, synchronize
from pipeline.model.vit import VisionTransformer, model_flops, model_kwargs_from_config
from pipeline.objectives import OBJECTIVES, load_config
from pipeline.train.metrics import device_peak_flops
from pipeline.train.optim import build_optimizer, param_groups


def add_dino_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dino-variant", default=None, help="backbone (default: vit_b14 on a GPU, vit_s14 on CPU)")
    p.add_argument("--dino-res", type=int, default=224, help="global crop size (default 224)")
    p.add_argument("--dino-local-crops", type=int, default=8, help="local crops per image (default 8)")
    p.add_argument("--dino-local-res", type=int, default=98, help="local crop size (default 98)")
    p.add_argument("--dino-prototypes", type=int, default=65536, help="DINO head prototypes (default 65,536)")
    p.add_argument("--dino-batch", type=int, default=None, help="images per step (default: 64 on a GPU, 2 on CPU)")
    p.add_argument("--dino-steps", type=int, default=None, help="steps per window (default: 10 on a GPU, 1 on CPU)")
    p.add_argument("--dino-windows", type=int, default=3)
    p.add_argument("--dino-profile", action="store_true",
                   help="then profile 3 DINOv2 steps: top kernels, idle fraction, host syncs per step")
    p.add_argument("--dino-threads", type=int, default=None,
                   help="torch CPU threads (default on CPU: 1, see docs/performance.md; a GPU run leaves torch's)")


class _Engine:
    """What `DINOv2.before_step`, `loss` and `after_step` use of a DeepSpeed engine: the module, its device, the
    optimizer's groups (the step's weight decay and the frozen prototypes' lr are written there), forward."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.module, self.optimizer, self.device = module, optimizer, device

    def __call__(self, *args: Any) -> Any:
        return self.module(*args)


class DinoStep:
    """The objective's step as the trainer runs it: `before_step` (the schedules into the optimizer's groups),
    the micro batch loss, backward, AdamW step, then `after_step` (centres, teacher EMA)."""

    def __init__(self, objective: Any, student: torch.nn.Module, images: tuple[torch.Tensor, ...],
                 device: torch.device) -> None:
        self.objective, self.images, self.cuda = objective, images, device.type == "cuda"
        train = objective.cfg.train
        self.optimizer = build_optimizer(param_groups(student, train, objective.model_kwargs()["depth"]), train)
        self.engine = _Engine(student.to(device).train(), self.optimizer, device)
        self.targets = torch.zeros(images[0].shape[0], device=device)

    def __call__(self) -> None:
        self.objective.before_step(self.engine, self.objective.step)
        with torch.autocast("cuda", torch.bfloat16, enabled=self.cuda):
            loss = self.objective.loss(self.engine, self.images, self.targets, None)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.objective.after_step(self.engine, self.objective.step + 1)


class SupervisedStep:
    """forward -> cross-entropy -> backward -> AdamW step of the plain ViT (bf16 autocast on a GPU)."""

    def __init__(self, model: VisionTransformer, depth: int, images: torch.Tensor, targets: torch.Tensor,
                 train: Any) -> None:
        self.model, self.images, self.targets = model.to(images.device).train(), images, targets
        self.optimizer = build_optimizer(param_groups(self.model, train, depth), train)
        self.cuda = images.device.type == "cuda"

    def __call__(self) -> None:
        with torch.autocast("cuda", torch.bfloat16, enabled=self.cuda):
            loss = F.cross_entropy(self.model(self.images).float(), self.targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def measured_flops(step: Any, batch: int) -> float:
    """FLOPs per image of one call of `step`, as PyTorch's FlopCounterMode counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops() / batch


def recipe_config(variant: str, res: int, local_crops: int, local_res: int, prototypes: int) -> Any:
    """The recipe's DINOv2 config at this backbone (dinov2_vitb14.yaml's values; no freeze, so that every
    timed step is a full one; lr and schedules do not change the cost)."""
    return load_config(None, [
        "model.objective=dinov2", f"model.variant={variant}", f"model.img_size={res}", "model.drop_path_rate=0.0",
        f"dino.local_crops_number={local_crops}", f"dino.local_crops_size={local_res}", f"dino.head_n_prototypes={prototypes}",
        "dino.freeze_last_layer_steps=0", "train.steps=1000", "train.lr=4e-3", "train.layer_decay=0.9",
        "train.weight_decay=0.04", "train.betas=[0.9, 0.999]", "train.grad_clip=0.0"])


def bench_dino(args: Any) -> dict[str, Any]:
    t_start = time.perf_counter()
    device = bench_device()
    gpu = device.type == "cuda"
    variant = args.dino_variant or ("vit_b14" if gpu else "vit_s14")
    res, batch = args.dino_res, args.dino_batch or (64 if gpu else 2)
    steps, windows = args.dino_steps or (10 if gpu else 1), args.dino_windows
    if args.dino_threads is not None or not gpu:
        # On a small shared CPU box OpenMP threads waiting for each other at every op make each step
        # several times slower (docs/performance.md): one thread unless told.
        torch.set_num_threads(args.dino_threads or 1)
    cfg = recipe_config(variant, res, args.dino_local_crops, args.dino_local_res, args.dino_prototypes)
    torch.manual_seed(0)
    objective = OBJECTIVES["dinov2"](cfg, SimpleNamespace(num_classes=0))
    kwargs = objective.model_kwargs()
    student = objective.build_all(kwargs)
    objective.teacher.to(device)
    # Each image's crops and iBOT masks as the loader workers make them (the objective's view, seeded).
    view = objective.train_view(kwargs).sample
    rng = np.random.default_rng(0)
    samples = [view(Image.fromarray(rng.integers(0, 255, (res + 32, res + 32, 3), dtype=np.uint8)), i)
               for i in range(batch)]
    crops = tuple(torch.stack(part).to(device) for part in zip(*samples))
    masked = int(crops[2].sum())
    # The supervised ViT: the same backbone (variant, size, weights) with a 1000-class head.
    sup_kwargs = model_kwargs_from_config(cfg.model, 1000)
    vit = VisionTransformer(**sup_kwargs)
    missing = vit.load_state_dict({k[len("backbone."):]: v for k, v in student.state_dict().items()
                                   if k.startswith("backbone.") and k != "backbone.mask_token"}, strict=False)
    assert set(missing.missing_keys) <= {"head.weight", "head.bias"}, missing  # only the classifier is new
    images = crops[0][:, 0].contiguous()  # each image's first global crop
    targets = torch.randint(0, 1000, (batch,), device=device)
    contenders = {"dino": DinoStep(objective, student, crops, device),
                  "supervised": SupervisedStep(vit, kwargs["depth"], images, targets, cfg.train)}
    print(f"dino: {variant} @ {res} + {args.dino_local_crops} x {args.dino_local_res}, {args.dino_prototypes} prototypes, batch {batch} "
          f"on {device}: {windows} windows of {steps} steps, in turns")
    measured = {name: measured_flops(step, batch) for name, step in contenders.items()}  # also the warm-up
    t = interleaved(contenders, steps, windows, 0, device)
    synchronize(device)
    predicted = {"dino": 3 * objective.flops_per_image(kwargs), "supervised": 3 * model_flops(sup_kwargs)}
    figures: dict[str, Any] = {"variant": variant, "res": res, "local_crops": args.dino_local_crops,
                               "local_res": args.dino_local_res,
                               "prototypes": args.dino_prototypes, "batch": batch, "ibot_masked_patches": masked,
                               "ibot_masked_patches_expected": round(batch * objective.expected_masked_patches(kwargs), 1),
                               "steps": steps, "windows": windows, "device": device.type,
                               "threads": torch.get_num_threads(), "dtype": "bf16-autocast" if gpu else "fp32"}
    for name in contenders:
        step_s = median(t.wall[name])
        figures[name] = {"step_ms": round(1e3 * step_s, 1), "img_s": round(batch / step_s, 2),
                         "cpu_step_ms": round(1e3 * median(t.cpu[name]), 1),
                         "predicted_gflops_per_image": round(predicted[name] / 1e9, 2),
                         "measured_gflops_per_image": round(measured[name] / 1e9, 2),
                         "measured_vs_predicted": round(measured[name] / predicted[name], 3),
                         "spread": round(spread(t.wall[name]), 3)}
    peak = device_peak_flops(None)  # the GPU's datasheet bf16 peak; None on CPU
    for name in contenders:  # MFU from the prediction (the trainer's numerator), as the trainer logs it
        figures[name]["mfu"] = round(predicted[name] * figures[name]["img_s"] / peak, 4) if peak else None
    figures["dino_vs_supervised"] = round(median(t.wall["dino"]) / median(t.wall["supervised"]), 3)
    # The CPU-time ratio: steadier than the wall clock's on a shared machine (docs/performance.md).
    figures["dino_vs_supervised_cpu"] = round(median(t.cpu["dino"]) / median(t.cpu["supervised"]), 3)
    figures["flop_ratio_predicted"] = round(predicted["dino"] / predicted["supervised"], 3)
    figures["flop_ratio_measured"] = round(measured["dino"] / measured["supervised"], 3)
    if getattr(args, "dino_profile", False):
        figures["profile"] = profile_step(contenders["dino"], device, steps=3)
    figures["seconds"] = round(time.perf_counter() - t_start, 1)
    d, s = figures["dino"], figures["supervised"]
    print(f"DINOv2 step {d['step_ms']} ms, supervised {s['step_ms']} ms: ratio {figures['dino_vs_supervised']} "
          f"(FLOPs: predicted {figures['flop_ratio_predicted']}, measured {figures['flop_ratio_measured']}); "
          f"GFLOP per image predicted/measured: DINOv2 {d['predicted_gflops_per_image']}/"
          f"{d['measured_gflops_per_image']}, supervised {s['predicted_gflops_per_image']}/"
          f"{s['measured_gflops_per_image']}")
    return figures
