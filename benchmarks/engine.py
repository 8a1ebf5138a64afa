"""DeepSpeed's cost: the trainer's step through `deepspeed.initialize` at ZeRO 0-3 against a plain loop.

One process, world size 1 (gloo on CPU, NCCL on a GPU): what is measured is DeepSpeed's own work per
step (flat buffers, gradient hooks, partitioning bookkeeping, its bf16 optimizer wrapper), not
communication. Everything comes from the pipeline: the model from pipeline.run.step.build_model
(ZeRO-3 builds it inside deepspeed.zero.Init), the DeepSpeed JSON from pipeline.derived.deepspeed_config,
the optimizer from pipeline.train.optim, the step body from pipeline.run.trainer.Trainer.optimizer_step. The plain loop
(benchmarks.common.PlainStep) does the same work by hand: same model and weights, optimizer,
clipping, schedule and dtype (bf16 with fp32 master weights, as DeepSpeed's bf16 mode).

`check_finite` is the trainer's `train.check_finite`: one all-reduce and one `.item()` per micro batch,
measured as a second column on the same engines.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

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
    use_cpu_accelerator,
)
from pipeline.config import Config
from pipeline.derived import deepspeed_config


def init_single_process() -> Any:
    """Join a one-process group (gloo on CPU) the way a launcher would; returns pipeline.dist's DistEnv.
    Under a real launcher (RANK/WORLD_SIZE set) its environment is used and must be world size 1."""
    use_cpu_accelerator()
    from pipeline.dist import init_distributed

    env = init_distributed()  # no launcher: rank 0 of 1 on a free local port
    if env.world_size != 1:
        raise SystemExit(f"the engine benchmarks run in one process; this one is rank {env.rank} of "
                         f"{env.world_size}: run `python launch/bench.py ...` without a launcher")
    return env


def run_config(spec: BenchSpec, zero_stage: int, overrides: Sequence[str] = ()) -> Config:
    """The run config the trainer would get for this benchmark (num_classes and size from the spec)."""
    from pipeline.config import load_config

    return load_config(None, [
        f"model.variant={spec.variant}", f"model.img_size={spec.res}", f"model.num_classes={spec.num_classes}",
        f"model.grad_checkpointing={str(spec.grad_ckpt).lower()}", f"train.micro_batch_size={spec.batch}",
        "train.grad_accum_steps=1", f"train.steps={10**6}", f"deepspeed.zero_stage={zero_stage}",
        f"deepspeed.bf16={str(spec.dtype == 'bf16').lower()}", f"train.compile={str(spec.compile).lower()}",
        *overrides])


def build_engine(spec: BenchSpec, zero_stage: int, overrides: Sequence[str] = ()) -> Any:
    """The engine pipeline.run.trainer.Trainer builds, by its own functions (no data, no tracking)."""
    from pipeline.model.vit import model_kwargs_from_config
    from pipeline.run.step import build_engine as trainer_build_engine
    from pipeline.run.step import build_model

    cfg = run_config(spec, zero_stage, overrides)
    ds_config = deepspeed_config(cfg, world_size=1)
    kwargs = model_kwargs_from_config(cfg.model)
    model = build_model(cfg, kwargs, ds_config)
    return trainer_build_engine(cfg, model, kwargs["depth"], ds_config)[0]


def trainer_step(engine: Any, images: torch.Tensor, targets: torch.Tensor, check_finite: bool,
                 loss_sum: torch.Tensor) -> None:
    """The body of pipeline.run.trainer.Trainer.optimizer_step for one micro batch (data and logging left out)."""
    from pipeline.objectives.supervised.objective import loss_fn
    from pipeline.run.step import all_finite, backward_and_step

    loss = loss_fn(engine(images).float(), targets, 0.0)
    if check_finite and not all_finite(loss):
        raise RuntimeError("non-finite loss in the benchmark")
    engine.is_gradient_accumulation_boundary()
    backward_and_step(engine, loss)
    loss_sum += loss.detach()


def make_ds_step(engine: Any, images: torch.Tensor, targets: torch.Tensor, check_finite: bool
                 ) -> Callable[[], None]:
    loss_sum = torch.zeros((), device=engine.device)
    return lambda: trainer_step(engine, images, targets, check_finite, loss_sum)


def build_plain(spec: BenchSpec, images: torch.Tensor, targets: torch.Tensor,
                overrides: Sequence[str] = ()) -> PlainStep:
    """The plain loop on the very model the trainer builds (same seed, so the same weights)."""
    from pipeline.model.vit import model_kwargs_from_config
    from pipeline.run.step import build_model, compile_kwargs

    cfg = run_config(spec, 0, overrides)
    model = build_model(cfg, model_kwargs_from_config(cfg.model), deepspeed_config(cfg, 1))
    step = PlainStep(model, spec, images, targets, cfg.train)
    if spec.compile:
        step.model = torch.compile(step.model, **compile_kwargs(cfg.train.compile_mode))
    return step


def run(spec: BenchSpec, stages: Sequence[int] = (0, 1, 2, 3), check_finite: bool = True,
        peak: float | None = None, overrides: Sequence[str] = (), log: Any = print) -> dict[str, Any]:
    """Plain loop vs DeepSpeed at each ZeRO stage (and each with check_finite), measured in turns.
    `overrides` are run-config `key=value`s (e.g. 'deepspeed.extra={bf16: {check_grad_overflow: false}}')."""
    t_start = time.perf_counter()
    init_single_process()
    device = bench_device()
    images, targets = synthetic_batch(spec, device)
    contenders: dict[str, Callable[[], Any]] = {"plain": build_plain(spec, images, targets, overrides)}
    for stage in stages:
        engine = build_engine(spec, stage, overrides)
        contenders[f"zero{stage}"] = make_ds_step(engine, images, targets, check_finite=False)
        if check_finite:
            contenders[f"zero{stage}+check_finite"] = make_ds_step(engine, images, targets, check_finite=True)
    log(f"engine: {spec.label} on {device}: plain loop vs DeepSpeed ZeRO {', '.join(map(str, stages))}"
        f"{' (each also with train.check_finite)' if check_finite else ''}; {spec.warmup} warm-up steps, then "
        f"{spec.windows} windows of {spec.steps} steps each, in turns")
    t = interleaved(contenders, spec.steps, spec.windows, spec.warmup, device)
    plain, plain_cpu = median(t.wall["plain"]), median(t.cpu["plain"])
    figures: dict[str, Any] = {
        "variant": spec.variant, "res": spec.res, "batch": spec.batch, "dtype": spec.dtype,
        "grad_ckpt": spec.grad_ckpt, "compile": spec.compile, "steps": spec.steps, "windows": spec.windows,
        "warmup": spec.warmup, "device": device.type, "threads": torch.get_num_threads(),
        "overrides": list(overrides),
        "plain": {**throughput(spec, plain, peak), "cpu_step_ms": round(1e3 * plain_cpu, 2),
                  "spread": round(spread(t.wall["plain"]), 3)},
    }
    for stage in stages:
        name = f"zero{stage}"
        wall, cpu = median(t.wall[name]), median(t.cpu[name])
        fig = {**throughput(spec, wall, peak), "cpu_step_ms": round(1e3 * cpu, 2),
               "spread": round(spread(t.wall[name]), 3),
               "vs_plain": round(wall / plain, 4), "vs_plain_cpu": round(cpu / plain_cpu, 4),
               "vs_plain_windows": ratios(t.wall[name], t.wall["plain"]),
               "vs_plain_cpu_windows": ratios(t.cpu[name], t.cpu["plain"])}
        if check_finite:
            cf = name + "+check_finite"
            wall_cf, cpu_cf = median(t.wall[cf]), median(t.cpu[cf])
            fig["check_finite"] = {**throughput(spec, wall_cf, peak), "cpu_step_ms": round(1e3 * cpu_cf, 2),
                                   "vs_plain": round(wall_cf / plain, 4), "vs_off": round(wall_cf / wall, 4),
                                   "vs_off_cpu": round(cpu_cf / cpu, 4)}
        figures[name] = fig
    figures["seconds"] = round(time.perf_counter() - t_start, 1)
    return figures


def rows(figures: dict[str, Any]) -> list[list[Any]]:
    p = figures["plain"]
    out = [["plain PyTorch", p["img_s"], p["step_ms"], "1.000", p["cpu_step_ms"], "1.000", "-", "-", "-",
            f"{100 * p['spread']:.0f}%"]]
    for key in sorted(k for k in figures if k.startswith("zero")):
        f = figures[key]
        cf = f.get("check_finite")
        out.append([f"DeepSpeed ZeRO-{key[4:]}", f["img_s"], f["step_ms"], f"{f['vs_plain']:.3f}", f["cpu_step_ms"],
                    f"{f['vs_plain_cpu']:.3f}",
                    "-" if cf is None else f"{cf['step_ms']:.1f}", "-" if cf is None else f"{cf['vs_off']:.3f}",
                    "-" if cf is None else f"{cf['vs_off_cpu']:.3f}", f"{100 * f['spread']:.0f}%"])
    return out


HEADER = ["loop", "images/s", "step ms", "step time / plain", "CPU ms/step", "CPU time / plain",
          "check_finite: step ms", "vs off", "vs off (CPU)", "window spread"]
