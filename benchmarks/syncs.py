"""Host reads per training step (`python launch/bench.py syncs`): each recipe (supervised, MAE, DINOv2,
DINOv3) at ZeRO-1 and ZeRO-3, through the real trainer (`pipeline.run.trainer.Trainer`: its loop, the
objective's loss and schedules, DeepSpeed's backward and step, the preemption agreement), one process
over gloo, a tiny model in bf16 on synthetic shards, with `pipeline.train.host_reads.HostReads` open.

Each recipe runs its demo config (configs/pretrain/*_demo.yaml: its clipping, centring, check_finite)
made tiny (2 blocks, 16 px, heads of 64 prototypes), in bf16 (as on a GPU; the demos are fp32 for the
CPU), 2 micro batches a step, a log step every 3. Steps 1-5 run, then the loop is stopped: step 1 is
the first (DeepSpeed builds buffers then), step 3 a log step (where reads are expected: the window's
figures), steps 2, 4 and 5 the non-log steps whose reads the figures give. The loader's own work is
not counted (a run does it in worker processes; here it runs in the training process): its batch then
counts as on the device, as the trainer's copy puts it there.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.results import ROOT, print_table

STAGES = (1, 3)
HEADS = ["head_n_prototypes=64", "head_hidden_dim=32", "head_bottleneck_dim=16", "local_crops_number=2",
         "local_crops_size=8", "knn_train_samples=16", "pca_images=0"]
RECIPES: dict[str, tuple[str, list[str]]] = {
    "supervised": ("configs/pretrain/demo.yaml", []),
    "mae": ("configs/pretrain/mae_demo.yaml", ["mae.decoder_embed_dim=16", "mae.decoder_depth=1",
                                               "mae.decoder_num_heads=2"]),
    "dinov2": ("configs/pretrain/dino_demo.yaml", [f"dino.{h}" for h in HEADS]),
    "dinov3": ("configs/pretrain/dinov3_demo.yaml", [f"dinov3.{h}" for h in HEADS] + [
        "dinov3.ibot_head_n_prototypes=48", "dinov3.ibot_head_bottleneck_dim=16", "model.variant=dinov3_vits16"]),
}
TINY = ["model.img_size=16", "model.patch_size=4", "model.embed_dim=32", "model.depth=2", "model.num_heads=2",
        "data.num_workers=0", "data.shuffle_span=16", "train.global_batch_size=8", "train.micro_batch_size=4",
        "train.steps=100", "train.log_every=3", "train.eval_every=0", "train.ckpt_every=0",
        "deepspeed.bf16=true", "tracking.enabled=false"]
LOG_STEP, LAST_STEP = 3, 5  # (train.log_every above)


class Enough(Exception):
    """Raised at the start of the step after LAST_STEP: the loop has run what is counted."""


def write_shards(folder: Path) -> Path:
    from pipeline.data.shards import write_dataset
    from pipeline.data.sources import synthetic_source

    write_dataset(synthetic_source(64, 4, 16), folder, max_samples_per_shard=16, progress=False, log=lambda _: None)
    return folder


def count_steps(recipe: str, stage: int, data: Path, run_dir: Path, overrides: list[str] = ()) -> list[dict[str, Any]]:
    """The trainer's steps 1..LAST_STEP of `recipe` at ZeRO-`stage`: per step its device and host reads and
    where the device reads were made."""
    import torch

    from pipeline.objectives import load_config
    from pipeline.run.trainer import Trainer
    from pipeline.train.host_reads import HostReads, host_tensor

    config, extra = RECIPES[recipe]
    cfg = load_config(str(ROOT / config), [*TINY, *extra, f"data.path={data}", f"run.dir={run_dir}",
                                           f"deepspeed.zero_stage={stage}", *overrides])
    from benchmarks.engine import init_single_process

    trainer = Trainer(cfg, init_single_process(), None)
    steps: list[dict[str, Any]] = []
    reads = HostReads()
    mark = {"device": 0, "host": 0, "sites": Counter()}
    real_step = trainer.optimizer_step

    def boundary() -> None:  # the reads since the last boundary are the step that just ended
        if trainer.step > 0:
            steps.append({"step": trainer.step, "device": reads.device - mark["device"],
                          "host": reads.host - mark["host"], "sites": dict(reads.sites - mark["sites"])})
        mark.update(device=reads.device, host=reads.host, sites=Counter(reads.sites))
        # torch's unfused AdamW (the CPU's) keeps each parameter's step count on the host and reads it
        # there; on a GPU the fused kernel takes it on the device and reads nothing.
        for state in trainer.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                host_tensor(state["step"])

    def batches(data: Any) -> Any:
        while True:
            with reads.outside():  # the loader's work: worker processes in a run
                item = next(data)
            yield item

    def optimizer_step(data: Any, *args: Any) -> int:
        boundary()
        if trainer.step >= LAST_STEP:
            raise Enough
        return real_step(batches(data), *args)

    trainer.optimizer_step = optimizer_step
    try:
        with reads:
            trainer.fit()
    except Enough:
        pass
    return steps


def summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """A recipe's figures: device and host reads per non-log step (the most over steps 2, 4, 5), at the
    first step and at the log step, and where the non-log steps' device reads were made."""
    plain = [s for s in steps if s["step"] not in (1, LOG_STEP)]
    sites: Counter[str] = Counter()
    for s in plain:
        sites.update(s["sites"])
    by = {s["step"]: s for s in steps}
    return {"device_per_step": max(s["device"] for s in plain), "host_per_step": max(s["host"] for s in plain),
            "first_step_device": by[1]["device"], "log_step_device": by[LOG_STEP]["device"],
            "sites": {k: v / len(plain) for k, v in sites.most_common()}}


def measure(recipes: list[str], stages: list[int], overrides: list[str] = (), log: Any = print) -> dict[str, Any]:
    from benchmarks.common import use_cpu_accelerator

    use_cpu_accelerator()
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_shards(Path(tmp) / "data")
        for recipe in recipes:
            for stage in stages:
                key = f"{recipe}.zero{stage}"
                out[key] = summary(count_steps(recipe, stage, data, Path(tmp) / key, list(overrides)))
                log(f"{key}: {out[key]['device_per_step']} device read(s), {out[key]['host_per_step']} host "
                    f"read(s) per non-log step")
    return {"recipes": out, "overrides": list(overrides), "seconds": round(time.perf_counter() - t0, 1)}


def bench_syncs(args: argparse.Namespace) -> dict[str, Any]:
    """Device-to-host reads per non-log training step, per recipe and ZeRO stage."""
    import torch

    torch.set_num_threads(1)
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    stages = [int(s) for s in args.syncs_stages.split(",") if s.strip()]
    figures = measure(recipes, stages, args.overrides)
    rows = [[key, f["device_per_step"], f["host_per_step"], f["first_step_device"], f["log_step_device"]]
            for key, f in figures["recipes"].items()]
    print_table("host reads per training step (tiny model, bf16, 2 micro batches a step, one process)",
                ["recipe.stage", "device/step", "host/step", "device at step 1", "device at a log step"], rows)
    for key, f in figures["recipes"].items():  # where each non-log step's device reads are made
        for site, n in f["sites"].items():
            print(f"{key}: {site} x{n:g}")
    return figures


def add_syncs_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--syncs-recipes", dest="recipes", default=",".join(RECIPES),
                   help=f"which recipes (default {','.join(RECIPES)})")
    p.add_argument("--syncs-stages", dest="syncs_stages", default=",".join(map(str, STAGES)),
                   help="ZeRO stages (default 1,3)")
    if not any("--set" in a.option_strings for a in p._actions):  # `all` has it from the engine benchmarks
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="run-config override for every recipe (repeatable), e.g. train.check_finite=true")
