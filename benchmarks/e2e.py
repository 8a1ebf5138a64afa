"""Does data loading keep up? Shards on local disk -> the real train loader -> the DeepSpeed step,
against the same step fed synthetic tensors already on the device.

The two arms share one engine and take turns (loader window, synthetic window, ...). While the
synthetic arm runs, the loader's workers keep decoding until their prefetch queue is full; those
batches are used up untimed at the start of each loader window, so the loader arm is timed in its
steady state. `e2e_vs_synthetic` = loader images/s / synthetic images/s: 1.0 means the loader keeps
up; `data_wait` is the fraction of the loader arm's time spent in `next(loader)`.

On a CPU-only machine the loader's worker processes share the cores with the model, so a ratio below
1 there says "decode competes with compute for the same cores", not "the disk is slow".
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    DTYPES,
    BenchSpec,
    bench_device,
    interleaved,
    median,
    ratios,
    spread,
    synthetic_batch,
    throughput,
)
from benchmarks.engine import build_engine, init_single_process, make_ds_step, trainer_step


def write_shards(out: Path, images: int, size: int, classes: int, per_shard: int = 128) -> Path:
    """Synthetic JPEG shards (pipeline.data.shards, what `make_shards.py --source synthetic` writes)."""
    from pipeline.data.shards import synthetic_source, write_dataset

    write_dataset(synthetic_source(images, classes, size, val_fraction=0.0), out,
                  max_samples_per_shard=per_shard, workers=min(8, os.cpu_count() or 1), progress=False, log=lambda _msg: None)
    return out


class LoaderStep:
    """One trainer step fed by the train loader: next(), copy to the device in the training dtype
    (non_blocking, from pinned memory on a GPU), then the DeepSpeed step. Counts time spent waiting."""

    def __init__(self, engine: Any, loader: Any, dtype: torch.dtype):
        self.engine, self.loader, self.dtype = engine, loader, dtype
        self.loss_sum = torch.zeros((), device=engine.device)
        self.wait = 0.0

    def __call__(self) -> None:
        t0 = time.perf_counter()
        images, targets = next(self.loader)
        self.wait += time.perf_counter() - t0
        # As the trainer does: a plain copy, or with data.decode_device=cuda the batch decode on the device.
        images, targets = self.loader.to_device(images, targets, self.engine.device, self.dtype)
        trainer_step(self.engine, images, targets, False, self.loss_sum)


def run(spec: BenchSpec, workers: int = 1, images: int = 512, image_size: int | None = None,
        zero_stage: int = 1, tmp: str | None = None, peak: float | None = None, overrides: Sequence[str] = (),
        log: Any = print, decode_device: str = "cpu") -> dict[str, Any]:
    from pipeline.config import DataConfig
    from pipeline.data import build_train_loader

    t_start = time.perf_counter()
    init_single_process()
    device = bench_device()
    # JPEGs a little larger than the crop, as ImageNet shards resized to 256 for 224 training.
    image_size = image_size or max(spec.res * 8 // 7, spec.res)
    if spec.num_classes < 10:
        raise ValueError("the synthetic shards have 10 classes; the model needs num_classes >= 10")
    with tempfile.TemporaryDirectory(prefix="bench-e2e-", dir=tmp) as folder:
        t0 = time.perf_counter()
        shards = write_shards(Path(folder) / "shards", images, image_size, classes=10)
        shard_s = time.perf_counter() - t0
        log(f"e2e: wrote {images} {image_size}px JPEGs as shards in {shard_s:.1f} s")
        data_cfg = DataConfig(path=str(shards), num_workers=workers, shuffle_span=min(1000, images),
                              decode_device=decode_device)
        loader = build_train_loader(data_cfg, spec.res, spec.batch, seed=0)
        engine = build_engine(spec, zero_stage, overrides)
        if loader.decoder is not None:  # as the trainer: the next batch's device decode overlaps this step
            loader.decode_ahead_on = engine.device
        batch = synthetic_batch(spec, device)
        loader_step = LoaderStep(engine, loader, DTYPES[spec.dtype])
        prefetched = max(1, workers) * data_cfg.prefetch_factor if workers > 0 else 0

        def drain() -> None:  # batches prefetched while the synthetic arm ran: untimed
            for _ in range(prefetched):
                loader_step()
            loader_step.wait = 0.0

        contenders = {"loader": loader_step, "synthetic": make_ds_step(engine, *batch, check_finite=False)}
        log(f"e2e: {spec.label} on {device}, ZeRO-{zero_stage}, {workers} loader worker(s): loader vs synthetic "
            f"tensors; {spec.warmup} warm-up steps, then {spec.windows} windows of {spec.steps} steps each, in "
            f"turns ({prefetched} prefetched batches used up before each loader window)")
        waits: list[float] = []  # each timed loader window's wait, read just after it (loader goes first)
        t = interleaved(contenders, spec.steps, spec.windows, spec.warmup, device,
                            before_window={"loader": drain, "synthetic": lambda: waits.append(loader_step.wait)})
        loader.close()
    lt, st = median(t.wall["loader"]), median(t.wall["synthetic"])
    figures: dict[str, Any] = {
        "variant": spec.variant, "res": spec.res, "batch": spec.batch, "dtype": spec.dtype,
        "grad_ckpt": spec.grad_ckpt, "compile": spec.compile, "zero_stage": zero_stage, "workers": workers,
        "images": images, "image_size": image_size, "overrides": list(overrides), "steps": spec.steps, "windows": spec.windows,
        "device": device.type, "threads": torch.get_num_threads(),
        "loader": {**throughput(spec, lt, peak), "spread": round(spread(t.wall["loader"]), 3),
                   "data_wait": round(median([w / (s * spec.steps) for w, s in zip(waits, t.wall["loader"])]), 4)},
        "synthetic": {**throughput(spec, st, peak), "spread": round(spread(t.wall["synthetic"]), 3)},
        "e2e_vs_synthetic_windows": ratios(t.wall["synthetic"], t.wall["loader"]),
        "e2e_vs_synthetic": round(st / lt, 4),
        "shard_write_s": round(shard_s, 1),
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    return figures


def rows(figures: dict[str, Any]) -> list[list[Any]]:
    lo, sy = figures["loader"], figures["synthetic"]
    return [
        ["shards -> loader -> step", lo["img_s"], lo["step_ms"], f"{figures['e2e_vs_synthetic']:.3f}",
         f"{100 * lo['data_wait']:.1f}%", f"{100 * lo['spread']:.0f}%"],
        ["synthetic on device -> step", sy["img_s"], sy["step_ms"], "1.000", "-", f"{100 * sy['spread']:.0f}%"],
    ]


HEADER = ["input", "images/s", "step ms", "images/s / synthetic", "data wait", "window spread"]
