"""What the model, engine and e2e benchmarks share: presets, the timing loop, the plain PyTorch step.

Timing: every contender gets a warm-up, then the contenders take turns (A, B, C, A, B, C, ...), each
turn one window of `steps` training steps, and a contender's figure is the median of its windows. On
a shared machine the load then falls on all of them alike, and a ratio from one run means something
even when the absolute numbers wander.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import TrainConfig
from pipeline.model.vit import model_flops, variant_kwargs
from pipeline.train.metrics import device_peak_flops
from pipeline.train.optim import build_optimizer, build_scheduler, param_groups

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class BenchSpec:
    """One model configuration to measure; timing knobs included."""

    variant: str = "vit_ti16"
    res: int = 224
    batch: int = 32
    dtype: str = "bf16"
    grad_ckpt: bool = False
    compile: bool = False
    num_classes: int = 1000
    steps: int = 3
    """Timed training steps per window."""
    windows: int = 3
    """Timed windows per contender; the median counts."""
    warmup: int = 2
    """Untimed steps per contender before the first window (allocator, autotuning, compilation)."""

    @property
    def label(self) -> str:
        extra = "".join([" ckpt" if self.grad_ckpt else "", " compiled" if self.compile else ""])
        return f"{self.variant}@{self.res} b{self.batch} {self.dtype}{extra}"

    def model_kwargs(self) -> dict[str, Any]:
        return variant_kwargs(self.variant, img_size=self.res, num_classes=self.num_classes)

    def flops_per_image(self) -> float:
        return model_flops(self.model_kwargs())


# CPU defaults keep `python launch/bench.py all` under 10 minutes on 2 cores. The GPU preset is the
# paper's B/16 and L/16 at 224; L/16's batch leaves room on an 80 GB device for the engine benchmark,
# which holds the plain model and four DeepSpeed engines (weights, fp32 masters, Adam states) at once.
PRESETS: dict[str, list[BenchSpec]] = {
    "cpu": [BenchSpec("vit_ti16", 224, 32, "bf16", steps=2, windows=5, warmup=2)],
    "gpu": [BenchSpec("vit_b16", 224, 256, "bf16", steps=20, windows=5, warmup=10),
            BenchSpec("vit_l16", 224, 64, "bf16", steps=10, windows=5, warmup=5)],
}


def default_preset() -> str:
    return "gpu" if torch.cuda.is_available() else "cpu"


def bench_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def use_cpu_accelerator() -> None:
    """Tell DeepSpeed not to probe for GPUs and compilers when there is no GPU (before importing it)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _proc_stat(pid: int | str) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state, ppid, ...), or None if it is gone."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_seconds(pids: Sequence[int] = ()) -> float:
    """CPU time (user + system) of this process and of the given other processes (loader workers)."""
    t = os.times()
    total, tick = t.user + t.system, os.sysconf("SC_CLK_TCK")
    for fields in filter(None, map(_proc_stat, pids)):
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def child_pids() -> list[int]:
    """This process's live children (DataLoader workers, whatever loader started them)."""
    me = os.getpid()
    return [int(pid) for pid in filter(str.isdigit, os.listdir("/proc"))
            if (fields := _proc_stat(pid)) is not None and int(fields[1]) == me]  # ppid


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic_batch(spec: BenchSpec, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Images in the training dtype and integer targets, already on the device."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(spec.batch, 3, spec.res, spec.res, generator=g)
    targets = torch.randint(0, spec.num_classes, (spec.batch,), generator=g)
    return images.to(device, DTYPES[spec.dtype]), targets.to(device)


@dataclass
class Timings:
    """Seconds per step of each contender in each window: wall clock, and this process's CPU time.

    CPU time (all threads of this process) is what the step itself consumed; unlike wall time it does
    not grow while other processes hold the cores, so on a shared CPU machine ratios of CPU times are
    the steadier figure. On a GPU wall time is the figure (the host mostly waits)."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]


def interleaved(contenders: dict[str, Callable[[], Any]], steps: int, windows: int, warmup: int,
                device: torch.device, before_window: dict[str, Callable[[], Any]] | None = None) -> Timings:
    """Time each contender in turns (see the module doc).

    `before_window[name]`, if given, runs untimed before each of that contender's windows (e.g. to
    use up batches a loader prefetched while the others ran)."""
    before_window = before_window or {}
    for step in contenders.values():
        for _ in range(warmup):
            step()
    synchronize(device)
    out = Timings({name: [] for name in contenders}, {name: [] for name in contenders})
    for _ in range(windows):
        for name, step in contenders.items():
            if name in before_window:
                before_window[name]()
            synchronize(device)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                step()
            synchronize(device)
            out.wall[name].append((time.perf_counter() - t0) / steps)
            out.cpu[name].append((time.process_time() - c0) / steps)
    return out


def ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Window-by-window ratios a/b (each pair measured back to back)."""
    return [round(x / y, 4) for x, y in zip(a, b)]


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def spread(xs: Sequence[float]) -> float:
    """(max - min) / median of the windows: how much the machine wandered during the run."""
    return float((max(xs) - min(xs)) / statistics.median(xs)) if xs else 0.0


def throughput(spec: BenchSpec, step_s: float, peak: float | None) -> dict[str, float | None]:
    """images/s, achieved model TFLOP/s (3 x forward FLOPs per image) and MFU (None without a peak)."""
    img_s = spec.batch / step_s
    achieved = img_s * 3 * spec.flops_per_image()
    return {"img_s": round(img_s, 2), "step_ms": round(1e3 * step_s, 2), "tflops": round(achieved / 1e12, 4),
            "mfu": round(achieved / peak, 4) if peak else None}


def peak_flops(args: Any) -> float | None:
    """--peak-flops, else the GPU's datasheet bf16 peak (pipeline.train.metrics); None on CPU."""
    return device_peak_flops(getattr(args, "peak_flops", None))


def train_config(spec: BenchSpec, **overrides: Any) -> TrainConfig:
    """The trainer's defaults (AdamW, weight decay 0.05, clip 1.0) with the benchmark's batch."""
    return dataclasses.replace(TrainConfig(), micro_batch_size=spec.batch, steps=10**6, **overrides)


def loss_of(model: nn.Module, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # pipeline.run.trainer.loss_fn with hard targets and no smoothing, without importing the trainer
    # (and through it MLflow) here.
    return F.cross_entropy(model(images).float(), targets)


class PlainStep:
    """A training step in plain PyTorch that does the same work as DeepSpeed's: forward, loss, backward,
    clip the global gradient norm, AdamW (the trainer's parameter groups), schedule step.

    bf16 is done as DeepSpeed's bf16 mode does it: the model's parameters and activations are bf16, an
    fp32 master copy of the parameters is what the optimizer updates, and the result is copied back
    into the bf16 model after each step. fp32 is the textbook loop.
    """

    def __init__(self, model: nn.Module, spec: BenchSpec, images: torch.Tensor, targets: torch.Tensor,
                 train: TrainConfig | None = None):
        self.train = train or train_config(spec)
        self.dtype = DTYPES[spec.dtype]
        self.model = model.to(images.device, self.dtype).train()
        self.images, self.targets = images, targets
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        groups = param_groups(self.model, self.train, spec.model_kwargs()["depth"])
        if self.dtype != torch.float32:
            self.master = {p: p.detach().float().clone().requires_grad_(True) for p in self.params}
            for g in groups:
                g["params"] = [self.master[p] for p in g["params"]]
            self.master_params = [self.master[p] for p in self.params]
            for m in self.master_params:
                m.grad = torch.zeros_like(m)
        else:
            self.master_params = self.params
        self.optimizer = build_optimizer(groups, self.train)
        self.scheduler = build_scheduler(self.optimizer, self.train)

    def __call__(self, images: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
        images = self.images if images is None else images
        targets = self.targets if targets is None else targets
        loss = loss_of(self.model, images, targets)
        loss.backward()
        grads = [p.grad for p in self.params]
        if self.master_params is not self.params:
            torch._foreach_copy_([m.grad for m in self.master_params], grads)
        if self.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.master_params, self.train.grad_clip, foreach=True)
        self.optimizer.step()
        self.scheduler.step()
        if self.master_params is not self.params:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.master_params)
        for p in self.params:
            p.grad = None
        return loss.detach()


def profile_step(step: Callable[[], Any], device: torch.device, steps: int = 5, top: int = 12) -> dict[str, Any]:
    """torch.profiler over `steps` calls of a warmed-up `step`: the top kernels by device time (CPU ops on
    the CPU), the idle fraction (1 - kernel time / wall time), kernels and host synchronisations per step."""
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        wall = time.perf_counter() - t0
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    averages = prof.key_averages()
    # Host waits: the runtime's synchronisations on a GPU (the one after the profiled steps included);
    # on the CPU, the reads of a tensor's value (.item(), bool(tensor)), which are such waits on a GPU.
    sync_names = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize") if cuda \
        else ("aten::_local_scalar_dense",)
    syncs = sum(e.count for e in averages if e.key in sync_names)
    events = [e for e in averages if getattr(e, attr, 0) > 0]
    if cuda:  # kernels only: the device's own timeline
        events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA] or events
    busy_us = sum(getattr(e, attr) for e in events)
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    return {"steps": steps, "wall_ms_per_step": round(1e3 * wall / steps, 2),
            "busy_fraction": round(busy_us / 1e6 / wall, 4) if cuda else None,
            "idle_fraction": round(1 - busy_us / 1e6 / wall, 4) if cuda else None,
            "kernels_per_step": round(sum(e.count for e in events) / steps, 1),
            "host_syncs_per_step": round(syncs / steps, 1),
            "top": [{"name": e.key[:90], "ms_per_step": round(getattr(e, attr) / 1e3 / steps, 3),
                     "share": round(getattr(e, attr) / max(busy_us, 1), 4), "calls": e.count // steps}
                    for e in events[:top]]}


def table_cell(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)
