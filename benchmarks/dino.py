"""A DINOv2 (or, with `--dino-recipe dinov3`, a DINOv3) training step against a supervised one on the same
backbone: what the recipe costs, and whether the objective's `flops_per_image` predicts it.

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
from pipeline.model.dinov3 import build_backbone
from pipeline.model.vit import model_flops, model_kwargs_from_config
from pipeline.objectives import OBJECTIVES, load_config
from pipeline.objectives.dino.cost import expected_masked_patches
from pipeline.train.metrics import device_peak_flops
from pipeline.train.optim import build_optimizer, param_groups


def add_dino_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dino-recipe", choices=("dinov2", "dinov3"), default="dinov2",
                   help="the objective stepped (default dinov2; dinov3: RoPE backbone, its heads and Sinkhorn-Knopp)")
    p.add_argument("--dino-variant", default=None,
                   help="backbone (default: vit_b14 on a GPU, vit_s14 on CPU; dinov3_vitb16 / dinov3_vits16 for dinov3)")
    p.add_argument("--dino-res", type=int, default=None, help="global crop size (default 224; dinov3 256)")
    p.add_argument("--dino-local-crops", type=int, default=8, help="local crops per image (default 8)")
    p.add_argument("--dino-local-res", type=int, default=None, help="local crop size (default 98; dinov3 112)")
    p.add_argument("--dino-prototypes", type=int, default=None,
                   help="DINO head prototypes (default 65,536; dinov3 262,144 and the iBOT head's 98,304)")
    p.add_argument("--dino-batch", type=int, default=None, help="images per step (default: 64 on a GPU, 2 on CPU)")
    p.add_argument("--dino-steps", type=int, default=None, help="steps per window (default: 10 on a GPU, 1 on CPU)")
    p.add_argument("--dino-windows", type=int, default=3)
    p.add_argument("--dino-profile", action="store_true",
                   help="then profile 3 DINOv2 steps: top kernels, idle fraction, host syncs per step")
    p.add_argument("--dino-tiny", action="store_true",
                   help="a 2-block, 64-wide backbone at 56 + 28 px (dinov3: 64 + 32), heads of 64 hidden and 256 "
                        "prototypes: the bench's code on the CPU in seconds (SMOKE=1 bash launch/gpu_bench.sh)")
    p.add_argument("--dino-threads", type=int, default=None,
                   help="torch CPU threads (default on CPU: 1, see docs/performance.md; a GPU run leaves torch's)")


class _Engine:
    """What `DINOv2.before_step`, `loss` and `after_step` use of a DeepSpeed engine: the module, its device, the
    optimizer's groups (the step's weight decay and the frozen prototypes' lr are written there), forward."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.module, self.optimizer, self.device = module, optimizer, device

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # DINOv3's student takes its RoPE jitter by name
        return self.module(*args, **kwargs)


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

    def __init__(self, model: torch.nn.Module, depth: int, images: torch.Tensor, targets: torch.Tensor,
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


# Per recipe: the default global and local crop sizes and prototypes (dinov2_vit*14.yaml, dinov3_vit*16.yaml).
RECIPE_DEFAULTS = {"dinov2": {"res": 224, "local_res": 98, "prototypes": 65536},
                   "dinov3": {"res": 256, "local_res": 112, "prototypes": 262144}}


TINY = {"dinov2": {"res": 56, "local_res": 28, "prototypes": 256}, "dinov3": {"res": 64, "local_res": 32, "prototypes": 256}}


def tiny_overrides(recipe: str) -> list[str]:
    """--dino-tiny: the backbone and heads made small (the sizes of TINY come through the flags' defaults)."""
    s = "dinov3" if recipe == "dinov3" else "dino"
    return ["model.embed_dim=64", "model.depth=2", "model.num_heads=2", f"{s}.head_hidden_dim=64",
            f"{s}.head_bottleneck_dim=32", f"{s}.ibot_head_bottleneck_dim=32"]


def recipe_config(variant: str, res: int, local_crops: int, local_res: int, prototypes: int,
                  recipe: str = "dinov2", extra: list[str] = ()) -> Any:
    """The recipe's config at this backbone (dinov2_vitb14.yaml's or dinov3_vitl16.yaml's values; no freeze, so
    that every timed step is a full one; lr and schedules do not change the cost); `extra` overrides last."""
    if recipe == "dinov3":
        return load_config(None, [
            "model.objective=dinov3", f"model.variant={variant}", f"model.img_size={res}", "model.drop_path_rate=0.0",
            f"dinov3.local_crops_number={local_crops}", f"dinov3.local_crops_size={local_res}",
            f"dinov3.head_n_prototypes={prototypes}", "dinov3.head_hidden_dim=8192", "dinov3.head_bottleneck_dim=512",
            f"dinov3.ibot_head_n_prototypes={min(prototypes, 98304)}", "dinov3.ibot_head_bottleneck_dim=384",
            "dinov3.freeze_last_layer_steps=0", "dinov3.patch_embed_lr_mult=0.2", "train.steps=1000",
            "train.lr=4e-4", "train.layer_decay=0.98", "train.weight_decay=0.04", "train.betas=[0.9, 0.99]",
            "train.grad_clip=0.0", *extra])
    return load_config(None, [
        "model.objective=dinov2", f"model.variant={variant}", f"model.img_size={res}", "model.drop_path_rate=0.0",
        f"dino.local_crops_number={local_crops}", f"dino.local_crops_size={local_res}", f"dino.head_n_prototypes={prototypes}",
        "dino.freeze_last_layer_steps=0", "train.steps=1000", "train.lr=4e-3", "train.layer_decay=0.9",
        "train.weight_decay=0.04", "train.betas=[0.9, 0.999]", "train.grad_clip=0.0", *extra])


def bench_dino(args: Any) -> dict[str, Any]:
    t_start = time.perf_counter()
    device = bench_device()
    gpu = device.type == "cuda"
    recipe = getattr(args, "dino_recipe", "dinov2")
    tiny = getattr(args, "dino_tiny", False)
    defaults = (TINY if tiny else RECIPE_DEFAULTS)[recipe]
    prefix = "dinov3_" if recipe == "dinov3" else ""
    variant = args.dino_variant or (f"{prefix}vit_b{16 if prefix else 14}" if gpu else f"{prefix}vit_s{16 if prefix else 14}")
    variant = variant.replace("dinov3_vit_", "dinov3_vit")
    res, batch = args.dino_res or defaults["res"], args.dino_batch or (64 if gpu else 2)
    local_res, prototypes = args.dino_local_res or defaults["local_res"], args.dino_prototypes or defaults["prototypes"]
    steps, windows = args.dino_steps or (10 if gpu else 1), args.dino_windows
    if args.dino_threads is not None or not gpu:
        # On a small shared CPU box OpenMP threads waiting for each other at every op make each step
        # several times slower (docs/performance.md): one thread unless told.
        torch.set_num_threads(args.dino_threads or 1)
    cfg = recipe_config(variant, res, args.dino_local_crops, local_res, prototypes, recipe,
                        tiny_overrides(recipe) if tiny else [])
    torch.manual_seed(0)
    objective = OBJECTIVES[recipe](cfg, SimpleNamespace(num_classes=0))
    kwargs = objective.model_kwargs()
    student = objective.build_all(kwargs)
    objective.teacher.to(device)
    # Each image's crops and iBOT masks as the loader workers make them (the objective's view, seeded).
    view = objective.train_view(kwargs).sample
    rng = np.random.default_rng(0)
    samples = [view(Image.fromarray(rng.integers(0, 255, (res + 32, res + 32, 3), dtype=np.uint8)), i)
               for i in range(batch)]
    # On a GPU the crops come in bf16, as the trainer's loader hands them over (`to_device` casts the floating
    # parts to the run's dtype): the objective runs its float32 teacher under bf16 autocast only when the crops
    # are not float32. Float32 crops (this bench before 2026-11-28) timed the teacher's forward in float32 on
    # CUDA cores: 402 of the 863 ms of the H200's DINOv2 ViT-L/14 step (docs/performance.md).
    low = torch.bfloat16 if gpu else torch.float32
    crops = tuple(torch.stack(part).to(device, low if part[0].is_floating_point() else part[0].dtype)
                  for part in zip(*samples))
    masked = int(crops[2].sum())
    # The supervised ViT: the same backbone (variant, size, weights) with a 1000-class head.
    sup_kwargs = model_kwargs_from_config(cfg.model, 1000)
    vit = build_backbone(sup_kwargs)
    missing = vit.load_state_dict({k[len("backbone."):]: v for k, v in student.state_dict().items()
                                   if k.startswith("backbone.") and k != "backbone.mask_token"}, strict=False)
    assert set(missing.missing_keys) <= {"head.weight", "head.bias"}, missing  # only the classifier is new
    images = crops[0][:, 0].contiguous()  # each image's first global crop
    targets = torch.randint(0, 1000, (batch,), device=device)
    contenders = {"dino": DinoStep(objective, student, crops, device),
                  "supervised": SupervisedStep(vit, kwargs["depth"], images, targets, cfg.train)}
    print(f"dino: {recipe} {variant} @ {res} + {args.dino_local_crops} x {local_res}, {prototypes} prototypes, batch {batch} "
          f"on {device}: {windows} windows of {steps} steps, in turns")
    measured = {name: measured_flops(step, batch) for name, step in contenders.items()}  # also the warm-up
    t = interleaved(contenders, steps, windows, 0, device)
    synchronize(device)
    predicted = {"dino": 3 * objective.flops_per_image(kwargs), "supervised": 3 * model_flops(sup_kwargs)}
    figures: dict[str, Any] = {"recipe": recipe, "variant": variant, "res": res, "local_crops": args.dino_local_crops,
                               "local_res": local_res,
                               "prototypes": prototypes, "batch": batch, "ibot_masked_patches": masked,
                               "ibot_masked_patches_expected": round(batch * expected_masked_patches(objective.d, kwargs), 1),
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
    print(f"{recipe} step {d['step_ms']} ms, supervised {s['step_ms']} ms: ratio {figures['dino_vs_supervised']} "
          f"(FLOPs: predicted {figures['flop_ratio_predicted']}, measured {figures['flop_ratio_measured']}); "
          f"GFLOP per image predicted/measured: {recipe} {d['predicted_gflops_per_image']}/"
          f"{d['measured_gflops_per_image']}, supervised {s['predicted_gflops_per_image']}/"
          f"{s['measured_gflops_per_image']}")
    return figures
