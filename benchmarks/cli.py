"""Command-line side of the model/engine/e2e benchmarks: flags, presets, tables (used by launch/bench.py).

Importing this module does not import torch, so that `launch/bench.py --help` stays quick.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

PrintTable = Callable[[str, list[str], list[list[Any]]], None]


def _add(p: argparse.ArgumentParser, *flags: str, **kwargs: Any) -> None:
    """Add an option unless the parser already has it (`all` collects every benchmark's flags)."""
    if not any(f in p._option_string_actions for f in flags):
        p.add_argument(*flags, **kwargs)


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """What model to measure and how long; every flag overrides the preset (None: the preset's value)."""
    _add(p, "--preset", choices=["cpu", "gpu"], default=None,
         help="cpu: vit_ti16@224 batch 32 bf16, few steps (the default without a GPU); gpu: vit_b16@224 batch "
              "256 and vit_l16@224 batch 64, bf16 (the default with one)")
    _add(p, "--variant", default=None, help="ViT variant (vit_ti16, vit_s16, vit_b16, vit_l16, ...)")
    _add(p, "--res", type=int, default=None, help="image resolution")
    _add(p, "--batch", type=int, default=None, help="micro batch per step")
    _add(p, "--dtype", choices=["bf16", "fp32"], default=None, help="training dtype")
    _add(p, "--grad-ckpt", action=argparse.BooleanOptionalAction, default=None,
         help="gradient checkpointing per block")
    _add(p, "--compile", action=argparse.BooleanOptionalAction, default=None,
         help="torch.compile the model (DeepSpeed: engine.compile(), as train.compile does)")
    _add(p, "--steps", type=int, default=None, help="timed steps per window")
    _add(p, "--windows", type=int, default=None, help="timed windows per contender (the median counts)")
    _add(p, "--warmup-steps", type=int, default=None, help="untimed steps per contender first")
    _add(p, "--threads", type=int, default=None,
         help="torch CPU threads (default on CPU: 1, see docs/performance.md; a GPU run leaves torch's default)")
    _add(p, "--peak-flops", type=float, default=None,
         help="peak FLOP/s of the device for MFU (default: the GPU's bf16 datasheet figure; none on CPU)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    add_spec_args(p)


def add_config_args(p: argparse.ArgumentParser) -> None:
    _add(p, "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
         help="run-config override for the DeepSpeed engines (repeatable), as on the trainer's command line, e.g. "
              "--set 'deepspeed.extra={bf16: {check_grad_overflow: false}}'")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_spec_args(p)
    add_config_args(p)
    _add(p, "--stages", default="0,1,2,3", help="ZeRO stages to compare with the plain loop (default 0,1,2,3)")
    _add(p, "--no-check-finite", action="store_true",
         help="skip the train.check_finite column (halves the engine benchmark's time)")


def add_e2e_args(p: argparse.ArgumentParser) -> None:
    add_spec_args(p)
    add_config_args(p)
    _add(p, "--e2e-workers", type=int, default=None,
         help="train loader worker processes (default: 1 on CPU, min(8, cores - 1) with a GPU)")
    _add(p, "--e2e-images", type=int, default=None,
         help="synthetic JPEGs written as shards (default: max(512, 8 x batch))")
    _add(p, "--e2e-image-size", type=int, default=None, help="their size in pixels (default: res x 8/7)")
    _add(p, "--zero-stage", type=int, default=1, help="ZeRO stage of the e2e engine (default 1)")
    _add(p, "--decode-device", choices=["cpu", "cuda"], default="cpu",
         help="data.decode_device: cuda decodes JPEGs with nvjpeg on the device (default cpu)")
    _add(p, "--tmp", default=None, help="folder for the temporary data (default: system temp)")


def add_gpu_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    _add(p, "--smoke", action="store_true",
         help="run the gpu benchmark's code on the CPU with a tiny model (minutes on 2 cores, mostly compiling)")
    _add(p, "--models", default=None,
         help="VARIANT@RES,... to measure (default vit_b16@224,vit_l16@224,vit_b16@384)")
    _add(p, "--parts", default="training,e2e,correctness",
         help="which parts, each alone a shorter run and its own row: training (the arms and the profile), e2e, "
              "correctness (default: all three)")
    _add(p, "--arms", default=None,
         help="training arms to run, by name, comma-separated (default: every arm but the max-autotune one; "
              "benchmarks/gpu.py ARMS, AUTOTUNE_ARMS)")
    _add(p, "--budget-s", type=float, default=360.0,
         help="start no training arm after this many seconds (compiling dominates; default 360)")
    _add(p, "--correctness-steps", type=int, default=300, help="steps of the bf16-vs-fp32 loss curves (default 300)")
    _add(p, "--e2e-workers", type=int, default=None,
         help="train loader worker processes (default: 1 on CPU, min(8, cores - 1) with a GPU)")
    _add(p, "--peak-flops", type=float, default=None,
         help="peak FLOP/s of the device for MFU (default: the GPU's bf16 datasheet figure; none on CPU)")
    _add(p, "--tmp", default=None, help="folder for the temporary data (default: system temp)")


def _specs(args: argparse.Namespace) -> list[Any]:
    import dataclasses

    import torch

    from benchmarks.common import PRESETS, default_preset

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif not torch.cuda.is_available():
        # On a small shared CPU box OpenMP threads that wait for each other at every op make each step
        # several times slower the moment another process runs; one thread measures the code, not that.
        torch.set_num_threads(1)
    specs = PRESETS[args.preset or default_preset()]
    given = {k: v for k, v in dict(variant=args.variant, res=args.res, batch=args.batch, dtype=args.dtype,
                                   grad_ckpt=args.grad_ckpt, compile=args.compile, steps=args.steps,
                                   windows=args.windows, warmup=args.warmup_steps).items() if v is not None}
    if "variant" in given:  # one named model replaces a multi-model preset
        specs = specs[:1]
    return [dataclasses.replace(s, **given) for s in specs]


def _collect(runs: list[tuple[Any, dict[str, Any]]]) -> dict[str, Any]:
    """One configuration: its figures as they are; several: keyed by label."""
    if len(runs) == 1:
        return runs[0][1]
    return {spec.label: figures for spec, figures in runs}


def run_model(args: argparse.Namespace, print_table: PrintTable) -> dict[str, Any]:
    """Training step images/s and MFU, ours vs timm's VisionTransformer (same config, optimizer, step)."""
    from benchmarks import model
    from benchmarks.common import peak_flops

    runs = []
    for spec in _specs(args):
        figures = model.run(spec, peak_flops(args))
        print_table(f"training step (forward + backward + AdamW), {spec.label}, {figures['threads']} thread(s), "
                    f"median of {spec.windows} windows x {spec.steps} steps, in turns", model.HEADER,
                    model.rows(figures))
        print(f"ours / timm per window: {figures['ours_vs_timm_windows']}; took {figures['seconds']:.0f} s")
        runs.append((spec, figures))
    return _collect(runs)


def run_engine(args: argparse.Namespace, print_table: PrintTable) -> dict[str, Any]:
    """DeepSpeed ZeRO 0-3 step vs a plain PyTorch loop (same model, optimizer, dtype), check_finite cost."""
    from benchmarks import engine
    from benchmarks.common import peak_flops

    stages = [int(s) for s in args.stages.split(",") if s.strip()]
    runs = []
    for spec in _specs(args):
        figures = engine.run(spec, stages, check_finite=not args.no_check_finite, peak=peak_flops(args),
                             overrides=args.overrides)
        print_table(f"DeepSpeed vs plain loop, {spec.label}, world size 1, {figures['threads']} thread(s), "
                    f"median of {spec.windows} windows x {spec.steps} steps, in turns", engine.HEADER,
                    engine.rows(figures))
        print(f"took {figures['seconds']:.0f} s")
        runs.append((spec, figures))
    return _collect(runs)


def run_e2e(args: argparse.Namespace, print_table: PrintTable) -> dict[str, Any]:
    """Shards -> train loader -> DeepSpeed step vs the same step on synthetic tensors: does data keep up?"""
    import torch

    from benchmarks import e2e
    from benchmarks.common import peak_flops

    runs = []
    for spec in _specs(args):
        workers = args.e2e_workers
        if workers is None:
            workers = min(8, max(1, (os.cpu_count() or 2) - 1)) if torch.cuda.is_available() else 1
        images = args.e2e_images or max(512, 8 * spec.batch)
        figures = e2e.run(spec, workers=workers, images=images, image_size=args.e2e_image_size,
                          zero_stage=args.zero_stage, tmp=args.tmp, peak=peak_flops(args), overrides=args.overrides,
                          decode_device=args.decode_device)
        print_table(f"end to end, {spec.label}, ZeRO-{args.zero_stage}, {workers} loader worker(s), "
                    f"{figures['threads']} thread(s), median of {spec.windows} windows x {spec.steps} steps, "
                    f"in turns", e2e.HEADER, e2e.rows(figures))
        print(f"took {figures['seconds']:.0f} s (shards written in {figures['shard_write_s']:.0f} s)")
        runs.append((spec, figures))
    return _collect(runs)


def run_gpu(args: argparse.Namespace, print_table: PrintTable) -> dict[str, Any]:
    """GPU figures: B/16, L/16 (224) and B/16@384 training steps (plain/ZeRO-1 x eager/compiled, checkpointing),
    a profile, end to end from JPEG shards (CPU decode and nvjpeg), bf16-vs-fp32 and nvjpeg-vs-PIL checks."""
    import torch

    from benchmarks import gpu
    from benchmarks.common import peak_flops

    if not args.smoke and not torch.cuda.is_available():
        raise NotImplementedError("bench gpu needs a CUDA GPU (`--smoke` runs its code on the CPU)")
    if args.smoke:
        torch.set_num_threads(1)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    try:
        gpu.check_parts(parts)  # before anything slow: one line, not a traceback
        arms = gpu.select_arms(args.arms)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    models = None
    if args.models:
        models = [(m.split("@")[0], int(m.split("@")[1])) for m in args.models.split(",")]
    figures = gpu.run(smoke=args.smoke, models=models, overrides=args.overrides, peak=peak_flops(args),
                      workers=args.e2e_workers, correctness_steps=args.correctness_steps, tmp=args.tmp,
                      budget_s=args.budget_s, parts=parts, arms=arms)
    if figures["training"]:
        print_table("training step, bf16, SDPA attention, one device; arms one after another", gpu.HEADER,
                    gpu.rows(figures))
    for decode, f in figures["e2e"].items():
        print(f"end to end, decode on {decode}: {f['e2e_vs_synthetic']:.3f} of synthetic, data wait "
              f"{100 * f['loader']['data_wait']:.1f}%, ~{f['cores_to_keep_up']} CPU cores to keep up")
    print(f"took {figures['seconds']:.0f} s")
    return figures
