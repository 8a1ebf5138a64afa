"""Distillation with one student and with two on one teacher forward, against two runs of one: what sharing the
teacher's forward saves (docs/distill.md).

Each step is the objective's own code as the trainer runs it (`Distill.before_step`, `loss`: the frozen teacher's
forward once per micro batch, each student's forward and projections, the feature loss; then backward and AdamW
with the trainer's parameter groups), in plain PyTorch, measured in turns (`benchmarks.common.interleaved`).
`one`: one ViT student; `two`: two students of that architecture (`distill.students`, one engine, one teacher
forward); `two_runs_of_one_ms` is twice `one`'s step, what two separate distillations cost. The teacher is a ViT
of ours written to a temporary file and read back as any teacher is (`distill.teacher`), with random weights:
the cost does not depend on them. `flop_ratio` is what `flops_per_image` predicts for two against two runs of one.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from benchmarks.common import bench_device, interleaved, median, spread, synchronize
from pipeline.model.vit import VisionTransformer, architecture
from pipeline.model.weights import save_weights
from pipeline.objectives import OBJECTIVES, load_config
from pipeline.train.optim import build_optimizer, param_groups

# (teacher, student) widths and depths, the patch and the image size: ViT-B/16 into ViT-S/16 at 224 on a GPU;
# on a CPU a 192-wide teacher into 96-wide students at 64 px (patch 8: 64 tokens), steps of a second or so.
SIZES = {"gpu": dict(teacher=(768, 12, 12), student=(384, 12, 6), patch=16, res=224, batch=64),
         "cpu": dict(teacher=(192, 6, 3), student=(96, 4, 2), patch=8, res=64, batch=8)}


def add_distill_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--distill-batch", type=int, default=None, help="images per step (default: 64 on a GPU, 8 on CPU)")
    p.add_argument("--distill-steps", type=int, default=None, help="steps per window (default: 10 on a GPU, 3 on CPU)")
    p.add_argument("--distill-windows", type=int, default=5)


class _Engine:
    """What `Distill.before_step` and `loss` use of a DeepSpeed engine: its device, the forward."""

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self.module, self.device = module, device

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class DistillStep:
    """`before_step`, the micro batch's loss, backward, AdamW step (bf16 autocast on a GPU, as the trainer's)."""

    def __init__(self, objective: Any, images: torch.Tensor, device: torch.device) -> None:
        self.objective, self.images, self.cuda = objective, images, device.type == "cuda"
        self.kwargs = objective.model_kwargs()
        model = objective.build_all(self.kwargs).to(device).train()
        train = objective.cfg.train
        self.optimizer = build_optimizer(param_groups(model, train, 0), train)
        self.engine = _Engine(model, device)
        self.targets = torch.zeros(len(images), device=device)

    def __call__(self) -> None:
        self.objective.before_step(self.engine, 0)  # the teacher onto the device
        with torch.autocast("cuda", torch.bfloat16, enabled=self.cuda):
            loss = self.objective.loss(self.engine, self.images, self.targets, None)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def distill_objective(teacher: Path, size: dict[str, Any], students: int) -> Any:
    """distill_demo.yaml's objective at these sizes with `students` students of one architecture."""
    width, depth, heads = size["student"]
    several = [f"distill.students=[{', '.join(f'{{name: s{i}}}' for i in range(students))}]"] if students > 1 else []
    cfg = load_config("configs/pretrain/distill_demo.yaml", [
        f"distill.teacher={teacher}", f"model.img_size={size['res']}", f"model.patch_size={size['patch']}",
        f"model.embed_dim={width}", f"model.depth={depth}", f"model.num_heads={heads}", "model.drop_path_rate=0.0",
        "train.grad_clip=0.0", *several])
    return OBJECTIVES["distill"](cfg, SimpleNamespace(num_classes=0))


def bench_distill(args: Any) -> dict[str, Any]:
    t_start = time.perf_counter()
    device = bench_device()
    gpu = device.type == "cuda"
    size = SIZES["gpu" if gpu else "cpu"]
    batch, steps, windows = args.distill_batch or size["batch"], args.distill_steps or (10 if gpu else 3), \
        args.distill_windows
    if not gpu:  # one thread on a shared CPU box (docs/performance.md), as the other benchmarks
        torch.set_num_threads(1)
    torch.manual_seed(0)
    width, depth, heads = size["teacher"]
    arch = dict(img_size=size["res"], patch_size=size["patch"], embed_dim=width, depth=depth, num_heads=heads,
                num_classes=0)
    with tempfile.TemporaryDirectory() as tmp:  # the teacher as a file of ours, read back as distill.teacher reads
        teacher = Path(tmp) / "teacher.safetensors"
        save_weights(VisionTransformer(**arch).state_dict(), teacher, metadata={
            "variant": "vit_b16", **{k: str(v) for k, v in architecture(VisionTransformer, arch).items()}})
        objectives = {"one": distill_objective(teacher, size, 1), "two": distill_objective(teacher, size, 2)}
        images = torch.randn(batch, 3, size["res"], size["res"], device=device)
        if gpu:
            images = images.to(torch.bfloat16)  # as the trainer's loader hands them over: the teacher under autocast
        contenders = {name: DistillStep(obj, images, device) for name, obj in objectives.items()}
    print(f"distill: teacher {width}x{depth}, students {size['student'][0]}x{size['student'][1]}, patch "
          f"{size['patch']} @ {size['res']}, batch {batch} on {device}: {windows} windows of {steps} steps, in turns")
    t = interleaved(contenders, steps, windows, 1, device)
    synchronize(device)
    flops = {name: step.objective.flops_per_image(step.kwargs) for name, step in contenders.items()}
    figures: dict[str, Any] = {"teacher": list(size["teacher"]), "student": list(size["student"]),
                               "patch": size["patch"], "res": size["res"], "batch": batch, "steps": steps,
                               "windows": windows, "device": device.type, "threads": torch.get_num_threads(),
                               "dtype": "bf16-autocast" if gpu else "fp32"}
    for name in contenders:
        figures[name] = {"step_ms": round(1e3 * median(t.wall[name]), 1),
                         "cpu_step_ms": round(1e3 * median(t.cpu[name]), 1),
                         "gflops_per_image": round(flops[name] / 1e9, 3), "spread": round(spread(t.wall[name]), 3),
                         "teacher_forwards": contenders[name].objective.teacher_forwards}
    figures["two_runs_of_one_ms"] = round(2 * figures["one"]["step_ms"], 1)
    figures["two_vs_two_runs_of_one"] = round(median(t.wall["two"]) / (2 * median(t.wall["one"])), 3)
    # The CPU-time ratio: steadier than the wall clock's on a shared machine (docs/performance.md).
    figures["two_vs_two_runs_of_one_cpu"] = round(median(t.cpu["two"]) / (2 * median(t.cpu["one"])), 3)
    figures["flop_ratio"] = round(flops["two"] / (2 * flops["one"]), 3)
    figures["seconds"] = round(time.perf_counter() - t_start, 1)
    print(f"one student {figures['one']['step_ms']} ms, two on one teacher forward {figures['two']['step_ms']} ms, "
          f"two runs of one {figures['two_runs_of_one_ms']} ms: ratio {figures['two_vs_two_runs_of_one']} (CPU time "
          f"{figures['two_vs_two_runs_of_one_cpu']}; FLOPs predict {figures['flop_ratio']})")
    return figures
