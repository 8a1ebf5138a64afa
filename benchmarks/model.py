"""Training-step throughput of our ViT against timm's VisionTransformer of the same configuration.

Both models get the same weights (timm loads our state dict), the same input, the same optimizer
(pipeline.train.optim: AdamW, the trainer's parameter groups, clipping, schedule) and the same step
(benchmarks.common.PlainStep), measured in turns. `ours_vs_timm` is our step time over timm's:
below 1 we are faster.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from benchmarks.common import (
    BenchSpec,
    PlainStep,
    bench_device,
    interleaved,
    median,
    ratios,
    spread,
    synthetic_batch,
    throughput,
)
from pipeline.model.vit import build_vit


def timm_twin(kwargs: dict[str, Any]) -> nn.Module:
    """timm's VisionTransformer with our configuration: class token, token pooling, no pre-logits."""
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    return TimmViT(img_size=kwargs["img_size"], patch_size=kwargs["patch_size"], num_classes=kwargs["num_classes"],
                   embed_dim=kwargs["embed_dim"], depth=kwargs["depth"], num_heads=kwargs["num_heads"],
                   mlp_ratio=kwargs.get("mlp_ratio", 4.0), qkv_bias=True, class_token=True, global_pool="token")


def build_pair(spec: BenchSpec) -> tuple[nn.Module, nn.Module]:
    """Ours and timm's, same weights, same gradient-checkpointing setting."""
    torch.manual_seed(0)
    kwargs = spec.model_kwargs()
    ours = build_vit(spec.variant, img_size=spec.res, num_classes=spec.num_classes)
    theirs = timm_twin(kwargs)
    theirs.load_state_dict(ours.state_dict())
    ours.set_grad_checkpointing(spec.grad_ckpt)
    theirs.set_grad_checkpointing(spec.grad_ckpt)
    return ours, theirs


def run(spec: BenchSpec, peak: float | None = None, log: Any = print) -> dict[str, Any]:
    """Measure one configuration; the figures for the table and the CSV."""
    t_start = time.perf_counter()
    device = bench_device()
    images, targets = synthetic_batch(spec, device)
    ours, theirs = build_pair(spec)
    steps = {"ours": PlainStep(ours, spec, images, targets), "timm": PlainStep(theirs, spec, images, targets)}
    if spec.compile:
        for step in steps.values():
            step.model = torch.compile(step.model)
    log(f"model: {spec.label} on {device}: ours vs timm, {spec.warmup} warm-up steps, then {spec.windows} "
        f"windows of {spec.steps} steps each, in turns")
    t = interleaved(dict(steps), spec.steps, spec.windows, spec.warmup, device)
    figures: dict[str, Any] = {
        "variant": spec.variant, "res": spec.res, "batch": spec.batch, "dtype": spec.dtype,
        "grad_ckpt": spec.grad_ckpt, "compile": spec.compile, "steps": spec.steps, "windows": spec.windows,
        "warmup": spec.warmup, "device": device.type, "threads": torch.get_num_threads(),
        "gflops_per_image": round(spec.flops_per_image() / 1e9, 3),
    }
    for name in steps:
        figures[name] = {**throughput(spec, median(t.wall[name]), peak),
                         "cpu_step_ms": round(1e3 * median(t.cpu[name]), 2), "spread": round(spread(t.wall[name]), 3)}
    # Step time ratios, wall clock and CPU time; per window too (each pair measured back to back).
    figures["ours_vs_timm"] = round(median(t.wall["ours"]) / median(t.wall["timm"]), 4)
    figures["ours_vs_timm_cpu"] = round(median(t.cpu["ours"]) / median(t.cpu["timm"]), 4)
    figures["ours_vs_timm_windows"] = ratios(t.wall["ours"], t.wall["timm"])
    figures["ours_vs_timm_cpu_windows"] = ratios(t.cpu["ours"], t.cpu["timm"])
    figures["seconds"] = round(time.perf_counter() - t_start, 1)
    return figures


def rows(figures: dict[str, Any]) -> list[list[Any]]:
    out = []
    for name in ("ours", "timm"):
        f = figures[name]
        mfu = "-" if f["mfu"] is None else f"{100 * f['mfu']:.1f}%"
        ratio = f"{figures['ours_vs_timm']:.3f}" if name == "ours" else "1.000"
        cpu_ratio = f"{figures['ours_vs_timm_cpu']:.3f}" if name == "ours" else "1.000"
        out.append([name, f["img_s"], f["step_ms"], f"{f['tflops']:.3f}", mfu, ratio, f["cpu_step_ms"], cpu_ratio,
                    f"{100 * f['spread']:.0f}%"])
    return out


HEADER = ["model", "images/s", "step ms", "TFLOP/s", "MFU", "step time / timm", "CPU ms/step", "CPU time / timm",
          "window spread"]
