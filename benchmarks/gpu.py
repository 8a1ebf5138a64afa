"""`python launch/bench.py gpu`: the GPU figures in one command (planned: under 8 minutes on one H100).

1. Training step of each model (ViT-B/16@224, L/16@224, B/16@384: the paper's pretraining shapes and
   the fine-tune shape), bf16, SDPA attention: the largest micro batch that fits (found with the plain
   loop, stepped down for an arm that runs out of memory), then the arms one after another, each built,
   warmed up (compiled), timed and freed: {plain PyTorch loop, DeepSpeed ZeRO-1} x {eager, compiled},
   ZeRO-1 compiled without DeepSpeed's bf16 overflow check, and ZeRO-1 compiled with gradient
   checkpointing at twice the batch. images/s and MFU (3 x forward FLOPs per image / the device's peak
   from pipeline.train.metrics).
2. Profile (torch.profiler) of a few steps of the fastest ZeRO-1 arm and of the fastest plain arm of the
   first model: the top kernels by device time, the idle fraction (1 - kernel time / wall time), kernels
   and host synchronisations per step.
3. End to end from JPEG shards on local disk (benchmarks.e2e, ZeRO-1): CPU decode with
   cores - 1 workers, and `data.decode_device: cuda` (nvjpeg), each against the same step on synthetic
   tensors already on the device; the CPU cores each needs to keep up with the synthetic step.
4. Correctness: bf16 against fp32 (the loss curves of the same ZeRO-1 run on a fixed synthetic set),
   nvjpeg against PIL decode of the same JPEGs (pixel differences).

`--parts` runs some of them: "training" (1 and 2), "e2e" (3), "correctness" (4); each run is one CSV row.

Arms run one after another, not in turns: a dedicated GPU has no neighbours to share the noise with,
and holding every arm's optimizer states at once would shrink the largest batch. `--smoke` runs the
same code on the CPU with a tiny model (seconds), which is what the unit test does.
"""

from __future__ import annotations

import gc
import io
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from benchmarks.common import (
    BenchSpec,
    bench_device,
    child_pids,
    cpu_seconds,
    median,
    profile_step,
    synchronize,
    synthetic_batch,
    throughput,
)

# (variant, res): B/16 and L/16 at the pretraining resolution, B/16 at the fine-tune resolution.
MODELS = [("vit_b16", 224), ("vit_l16", 224), ("vit_b16", 384)]
# Micro batches tried, largest first; the first the plain eager step survives is the model's batch.
BATCHES = [1024, 768, 512, 384, 256, 192, 128, 96, 64, 48, 32, 16, 8]
# --smoke: the code on the CPU. fp32, because a CPU without AVX512-BF16/AMX emulates bf16 matmuls (the cost:
# configs/pretrain/demo.yaml); the correctness part still compares bf16 with fp32.
SMOKE = BenchSpec("vit_ti16", res=32, batch=4, dtype="fp32", num_classes=10, steps=2, windows=1, warmup=1)


@dataclass(frozen=True)
class Arm:
    loop: str  # "plain" or "zero1"
    compile: bool
    grad_ckpt: bool = False
    batch_scale: int = 1  # gradient checkpointing frees activations: twice the batch
    overrides: tuple[str, ...] = ()  # config overrides of this arm alone (after the command's --set)
    label: str = ""  # what the overrides change, in the arm's name

    @property
    def name(self) -> str:
        return (f"{self.loop}{' compiled' if self.compile else ' eager'}{' ckpt' if self.grad_ckpt else ''}"
                f"{' ' + self.label if self.label else ''}")


# DeepSpeed's own checks, the default before 1f46285: its bf16 overflow check (a finiteness test per gradient
# tensor and a host read) and its grad-norm host reads, each step (docs/performance.md, "Host reads"); the
# default arms run without them, this arm measures what they cost.
DEEPSPEED_CHECKS = "train.check_finite=true"

# What `--parts` chooses among; all by default. Each part alone is one shorter run and its own CSV row.
PARTS = ("training", "e2e", "correctness")


def check_parts(parts: Sequence[str]) -> None:
    """ValueError naming what is not a part (or that none was given)."""
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        what = f"{','.join(unknown)} is not" if unknown else "none given; expected some"
        raise ValueError(f"bench gpu --parts: {what} among {','.join(PARTS)}")

# The ViT step's options for the GPU (docs/performance.md): the patch embedding as one matmul, and Inductor's
# matmul templates (max-autotune: the bias and GELU in the matmul's epilogue; minutes of autotuning per model).
MATMUL_PATCH_EMBED = "model.patch_embed_impl=matmul"
MAX_AUTOTUNE = "train.compile_mode=max-autotune-no-cudagraphs"

ARMS = [Arm("plain", False), Arm("plain", True), Arm("zero1", False), Arm("zero1", True),
        Arm("zero1", True, overrides=(DEEPSPEED_CHECKS,), label="deepspeed-checks"),
        Arm("zero1", True, overrides=(MATMUL_PATCH_EMBED,), label="matmul-patch"),
        Arm("zero1", True, grad_ckpt=True, batch_scale=2)]
# Not among the default arms: its autotuning takes minutes, so a lease runs it as a part of its own (--arms), where
# a cap that stops it loses only its own row.
AUTOTUNE_ARMS = [Arm("zero1", True, overrides=(MATMUL_PATCH_EMBED, MAX_AUTOTUNE), label="matmul-patch max-autotune")]


def select_arms(names: str | None) -> list[Arm] | None:
    """`--arms`: arm names, comma-separated, from ARMS and AUTOTUNE_ARMS (None: the default ARMS)."""
    if not names:
        return None
    known = {a.name: a for a in ARMS + AUTOTUNE_ARMS}
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in known]
    if unknown or not chosen:
        raise ValueError(f"bench gpu --arms: {', '.join(unknown) or 'none given'}: expected some of: "
                         + ", ".join(known))
    return [known[n] for n in chosen]


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def build_arm(spec: BenchSpec, arm: Arm, overrides: list[str]) -> Callable[[], Any]:
    """One training step of this arm on a fixed synthetic batch (already on the device)."""
    from benchmarks.engine import build_engine, build_plain, make_ds_step

    spec = replace(spec, compile=arm.compile, grad_ckpt=arm.grad_ckpt)
    images, targets = synthetic_batch(spec, bench_device())
    overrides = [*overrides, *arm.overrides]
    if arm.loop == "plain":  # the run config carries grad_ckpt into the model, compile into the step
        return build_plain(spec, images, targets, overrides)
    return make_ds_step(build_engine(spec, 1, overrides), images, targets, check_finite=False)


def time_arm(spec: BenchSpec, step: Callable[[], Any]) -> tuple[float, float]:
    """(median seconds per step over `windows` windows, seconds spent warming up / compiling)."""
    device = bench_device()
    t0 = time.perf_counter()
    for _ in range(spec.warmup):
        step()
    synchronize(device)
    warm = time.perf_counter() - t0
    windows = []
    for _ in range(spec.windows):
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(spec.steps):
            step()
        synchronize(device)
        windows.append((time.perf_counter() - t0) / spec.steps)
    return median(windows), warm


def largest_batch(spec: BenchSpec, overrides: list[str], candidates: list[int], log: Any) -> int:
    """The largest candidate micro batch whose plain eager bf16 step runs (two steps: optimizer states too)."""
    for batch in candidates:
        step = None
        try:
            step = build_arm(replace(spec, batch=batch), Arm("plain", False), overrides)
            step()
            step()
            synchronize(bench_device())
            return batch
        except RuntimeError as e:
            if not _is_oom(e):
                raise
            log(f"  batch {batch}: out of memory")
        finally:
            del step
            _free()
    raise RuntimeError(f"{spec.label}: not even batch {candidates[-1]} fits")


def run_arm(spec: BenchSpec, arm: Arm, overrides: list[str], peak: float | None, log: Any) -> dict[str, Any]:
    """Build, warm up, time, free one arm; halve the batch (down to a quarter) when it runs out of memory."""
    batch = spec.batch * arm.batch_scale
    for _ in range(3):
        s = replace(spec, batch=batch, compile=arm.compile, grad_ckpt=arm.grad_ckpt)
        step = None
        try:
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            step = build_arm(s, arm, overrides)
            step_s, warm_s = time_arm(s, step)
            mem = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
            out = {"batch": batch, **throughput(s, step_s, peak), "warmup_s": round(warm_s, 1),
                   "max_mem_gib": None if mem is None else round(mem, 1)}
            mfu = "-" if out["mfu"] is None else f"{100 * out['mfu']:.1f}%"
            log(f"  {arm.name:22s} b{batch:<5d} {out['img_s']:>9,.0f} img/s  MFU {mfu}  (warm-up {warm_s:.0f} s)")
            return out
        except RuntimeError as e:
            if not _is_oom(e):
                raise
            log(f"  {arm.name}: batch {batch} out of memory, trying {batch // 2}")
            batch //= 2
        finally:
            del step
            _free()
    return {"batch": batch, "error": "out of memory"}


def profile_arm(spec: BenchSpec, arm: Arm, overrides: list[str], steps: int = 5, top: int = 12) -> dict[str, Any]:
    """benchmarks.common.profile_step of this arm, built, warmed up and freed."""
    s = replace(spec, compile=arm.compile, grad_ckpt=arm.grad_ckpt, batch=spec.batch * arm.batch_scale)
    step = build_arm(s, arm, overrides)
    try:
        for _ in range(max(spec.warmup, 1)):
            step()
        return {"arm": arm.name, "batch": s.batch, **profile_step(step, bench_device(), steps, top)}
    finally:
        del step
        _free()


def end_to_end(spec: BenchSpec, decode_device: str, workers: int, images: int, overrides: list[str],
               peak: float | None, tmp: str | None, log: Any) -> dict[str, Any]:
    """benchmarks.e2e plus the CPU it took: cores needed to feed the synthetic step's rate."""
    from benchmarks import e2e

    c0 = cpu_seconds(child_pids())
    f = e2e.run(spec, workers=workers, images=images, zero_stage=1, tmp=tmp, peak=peak, overrides=overrides,
                log=log, decode_device=decode_device)
    cpu_s = cpu_seconds(child_pids()) - c0
    # Every image the loader decoded in the run (warm-up, drained and timed batches); an upper bound
    # on CPU per image because shard writing and the main process's own work are in cpu_s too.
    consumed = spec.batch * (spec.warmup + spec.windows * (spec.steps + max(1, workers) * 2))
    f["cpu_ms_per_img_upper"] = round(1e3 * cpu_s / max(consumed, 1), 3)
    f["cores_to_keep_up"] = round(f["cpu_ms_per_img_upper"] * f["synthetic"]["img_s"] / 1e3, 2)
    return f


def bf16_vs_fp32(spec: BenchSpec, overrides: list[str], steps: int, log: Any) -> dict[str, Any]:
    """The same ZeRO-1 run in bf16 and in fp32 on a fixed synthetic set (8 batches, cycled: the loss falls
    as the model memorises them); the gap between the two loss curves, smoothed (EMA 0.9)."""
    from benchmarks.engine import build_engine
    from pipeline.objectives.supervised.objective import loss_fn

    curves = {}
    for dtype in ("fp32", "bf16"):
        s = replace(spec, dtype=dtype, compile=False, grad_ckpt=False)
        batches = [synthetic_batch(s, bench_device(), seed=i) for i in range(8)]
        engine = build_engine(s, 1, overrides)
        losses = []
        for i in range(steps):
            images, targets = batches[i % len(batches)]
            loss = loss_fn(engine(images).float(), targets, 0.0)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        curves[dtype] = torch.stack(losses).float().cpu().tolist()
        del engine, batches
        _free()
    ema = {k: _ema(v) for k, v in curves.items()}
    skip = min(20, steps // 2)  # the first steps are the same random model; compare where it learns
    rel = [abs(a - b) / max(abs(a), 1e-6) for a, b in zip(ema["fp32"][skip:], ema["bf16"][skip:])]
    out = {"variant": spec.variant, "res": spec.res, "batch": spec.batch, "steps": steps,
           "fp32_first_last": [round(curves["fp32"][0], 4), round(ema["fp32"][-1], 4)],
           "bf16_first_last": [round(curves["bf16"][0], 4), round(ema["bf16"][-1], 4)],
           "max_rel_gap_smoothed": round(max(rel, default=0.0), 4)}
    log(f"  bf16 vs fp32 over {steps} steps: loss {out['fp32_first_last']} (fp32) vs {out['bf16_first_last']} "
        f"(bf16), largest relative gap of the smoothed curves {100 * out['max_rel_gap_smoothed']:.1f}%")
    return out


def _ema(xs: list[float], beta: float = 0.9) -> list[float]:
    out, m = [], xs[0]
    for x in xs:
        m = beta * m + (1 - beta) * x
        out.append(m)
    return out


def nvjpeg_vs_pil(n: int = 64, size: int = 256, log: Any = print) -> dict[str, Any]:
    """Decode the same synthetic JPEGs with torchvision's decode_jpeg on the device (nvjpeg on a GPU) and
    with PIL; per-image mean and max absolute pixel difference (0-255)."""
    import numpy as np
    from PIL import Image
    from torchvision.io import ImageReadMode, decode_jpeg

    from pipeline.data.shards import synthetic_image

    device = bench_device()
    blobs = []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(synthetic_image(i, i % 10, 10, (size, size))).save(buf, format="JPEG", quality=90)
        blobs.append(buf.getvalue())
    data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
    decoded = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    means, maxes = [], []
    for b, d in zip(blobs, decoded):
        ref = torch.from_numpy(np.asarray(Image.open(io.BytesIO(b)).convert("RGB")).copy()).permute(2, 0, 1)
        diff = (d.cpu().int() - ref.int()).abs()
        means.append(diff.float().mean().item())
        maxes.append(int(diff.max()))
    out = {"device": device.type, "images": n, "size": size, "mean_abs_diff": round(max(means), 4),
           "max_abs_diff": max(maxes)}
    log(f"  decode_jpeg on {device.type} vs PIL, {n} JPEGs {size}px: worst image mean |diff| "
        f"{out['mean_abs_diff']:.3f}, max |diff| {out['max_abs_diff']} (0-255)")
    return out


def e2e_setting(best_zero1: tuple[BenchSpec, Arm, float] | None, first: BenchSpec, smoke: bool,
                first_model_batch: Callable[[], int]) -> BenchSpec:
    """The step the end-to-end part times: the profiled (fastest ZeRO-1) arm's batch, compile and
    checkpointing; without one (no training part, or every ZeRO-1 arm failed or was skipped), ZeRO-1
    compiled (eager on the CPU, where Inductor's build takes minutes) at the first model's largest micro
    batch."""
    if best_zero1 is None:
        spec, arm = replace(first, batch=first_model_batch()), Arm("zero1", not smoke)
    else:
        spec, arm, _ = best_zero1
    return replace(spec, batch=spec.batch * arm.batch_scale, compile=arm.compile, grad_ckpt=arm.grad_ckpt,
                   steps=2 if smoke else 10, windows=1 if smoke else 3, warmup=1 if smoke else 3)


def run(smoke: bool = False, models: list[tuple[str, int]] | None = None, arms: list[Arm] | None = None,
        overrides: list[str] | None = None, peak: float | None = None, workers: int | None = None,
        correctness_steps: int = 300, tmp: str | None = None, budget_s: float = 360.0,
        parts: Sequence[str] = PARTS, log: Any = print) -> dict[str, Any]:
    """The parts asked for (all by default), in the order of the module doc; returns the figures for the
    CSV row. `parts` splits the whole into shorter runs, each its own row: "training" (the arms and the
    profile), "e2e" (at the profiled arm's settings; without "training", at ZeRO-1 compiled with the
    first model's largest micro batch), "correctness".

    Training arms start only while less than `budget_s` has passed (compiling dominates: an arm that
    would start later is recorded as skipped), so the whole command stays under 8 minutes."""
    from benchmarks.engine import init_single_process

    check_parts(parts)
    t_start = time.perf_counter()
    overrides = list(overrides or [])
    init_single_process()
    if smoke:
        base_specs, candidates, correctness_steps = [SMOKE], [8, 4], min(correctness_steps, 6)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench gpu needs a CUDA GPU; `--smoke` runs its code on the CPU with a tiny model")
        base_specs = [BenchSpec(v, r, 0, "bf16", steps=10, windows=3, warmup=3) for v, r in (models or MODELS)]
        candidates = BATCHES
    workers = workers if workers is not None else max(1, (os.cpu_count() or 2) - 1)
    figures: dict[str, Any] = {"device": bench_device().type, "peak_flops": peak, "overrides": overrides,
                               "parts": list(parts), "training": {}, "profile": None, "profile_plain": None, "e2e": {},
                               "correctness": {}}
    best_zero1: tuple[BenchSpec, Arm, float] | None = None
    best_plain: tuple[BenchSpec, Arm, float] | None = None
    for base in base_specs if "training" in parts else []:
        log(f"training step {base.variant}@{base.res}: largest micro batch ...")
        batch = largest_batch(base, overrides, candidates, log)
        spec = replace(base, batch=batch)
        log(f"  micro batch {batch}")
        rows = {}
        for arm in arms or ARMS:
            if time.perf_counter() - t_start > budget_s:
                rows[arm.name] = {"batch": batch * arm.batch_scale, "error": f"skipped: past --budget-s {budget_s:.0f}"}
                log(f"  {arm.name}: {rows[arm.name]['error']}")
                continue
            rows[arm.name] = run_arm(spec, arm, overrides, peak, log)
            r = rows[arm.name]
            # The fastest arm of each loop at the trainer's own settings (no arm overrides) is profiled.
            if base is base_specs[0] and not arm.overrides and "img_s" in r:
                best = best_zero1 if arm.loop == "zero1" else best_plain
                if best is None or r["img_s"] > best[2]:
                    if arm.loop == "zero1":
                        best_zero1 = (spec, arm, r["img_s"])
                    else:
                        best_plain = (spec, arm, r["img_s"])
        figures["training"][f"{base.variant}@{base.res}"] = {
            "batch": batch, "gflops_per_image": round(spec.flops_per_image() / 1e9, 2), "arms": rows}
    # "profile": the fastest ZeRO-1 arm; "profile_plain": the fastest plain loop, for DeepSpeed's overhead.
    for key, best in (("profile", best_zero1), ("profile_plain", best_plain)):
        if best is None:
            continue
        spec, arm, _ = best
        log(f"profile: {arm.name} {spec.variant}@{spec.res} ...")
        figures[key] = p = profile_arm(spec, arm, overrides)
        log(f"  {p['wall_ms_per_step']} ms/step, idle {p['idle_fraction']}, {p['kernels_per_step']} kernels and "
            f"{p['host_syncs_per_step']} host syncs per step")
        for k in p["top"][:6]:
            log(f"  {k['ms_per_step']:8.3f} ms/step {100 * k['share']:5.1f}%  {k['name']}")
    if "e2e" in parts:
        def first_model_batch() -> int:
            log(f"end to end: {base_specs[0].variant}@{base_specs[0].res}: largest micro batch ...")
            return largest_batch(base_specs[0], overrides, candidates, log)

        e2e_spec = e2e_setting(best_zero1, base_specs[0], smoke, first_model_batch)
        images = 48 if smoke else max(2048, 8 * e2e_spec.batch)
        for decode in ("cpu", "cuda"):
            log(f"end to end, decode on {decode}, {workers} worker(s) ...")
            figures["e2e"][decode] = end_to_end(e2e_spec, decode, workers, images, overrides, peak, tmp, log)
    if "correctness" in parts:
        log("correctness ...")
        small = SMOKE if smoke else BenchSpec("vit_s16", 224, 128, "bf16")
        figures["correctness"]["bf16_vs_fp32"] = bf16_vs_fp32(small, overrides, correctness_steps, log)
        figures["correctness"]["nvjpeg_vs_pil"] = nvjpeg_vs_pil(8 if smoke else 64, 64 if smoke else 256, log)
    figures["seconds"] = round(time.perf_counter() - t_start, 1)
    return figures


def rows(figures: dict[str, Any]) -> list[list[Any]]:
    """One table row per (model, arm)."""
    out = []
    for model, m in figures["training"].items():
        for arm, r in m["arms"].items():
            if "img_s" not in r:
                out.append([model, arm, r["batch"], "-", "-", "-", "-", r.get("error", "")])
                continue
            mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
            out.append([model, arm, r["batch"], f"{r['img_s']:,.0f}", r["step_ms"], mfu,
                        "-" if r["max_mem_gib"] is None else r["max_mem_gib"], ""])
    return out


HEADER = ["model", "arm", "micro batch", "images/s", "step ms", "MFU", "max GiB", "note"]
