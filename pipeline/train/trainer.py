"""Training, top to bottom: setup -> (resume) -> step loop with eval, checkpoints, preemption -> export.

Used by launch/pretrain.py and launch/finetune.py alike; fine-tuning only adds a `prepare_model` hook
that loads the source weights into the freshly built model. Exit codes: 0 done, 75 checkpointed for
preemption (requeue me), 3 stopped on non-finite losses; config errors exit 2 before we get here.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline.config import Config, deepspeed_config, resolve_batch, save_config, to_dict
from pipeline.data import DataError, build_eval_loader, build_train_loader, merge_counters, read_dataset_info
from pipeline.dist import DistEnv, init_distributed
from pipeline.model.vit import VisionTransformer, model_flops, model_kwargs_from_config
from pipeline.tracking import start_tracking
from pipeline.train import checkpoint as ckpt
from pipeline.train.metrics import ThroughputMeter, device_peak_flops, topk_correct
from pipeline.train.optim import build_optimizer, build_scheduler, param_groups
from pipeline.train.preemption import PREEMPTED_EXIT_CODE, PreemptionHandler

NONFINITE_EXIT_CODE = 3
SHAPE_KEYS = ("img_size", "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias",
              "num_classes", "representation_size")


class TrainError(RuntimeError):
    """A condition the user must act on (wrong checkpoint, diverged run); the message says what."""


@dataclass
class Setup:
    env: DistEnv
    engine: Any
    model_kwargs: dict[str, Any]
    train_loader: Any
    eval_loader: Any
    tracker: Any
    dtype: torch.dtype
    flops_per_image: float


def log(env: DistEnv, msg: str) -> None:
    if env.is_main:
        print(msg, flush=True)


# ----------------------------------------------------------------------------- setup


def build_model(cfg: Config, model_kwargs: dict[str, Any], ds_config: dict[str, Any]) -> VisionTransformer:
    # Same seed on every rank: identical initial weights without a broadcast (ZeRO-3 broadcasts rank 0's).
    torch.manual_seed(cfg.train.seed)
    if cfg.deepspeed.zero_stage == 3:
        # Parameters are partitioned as they are created: a model larger than one device still builds.
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = VisionTransformer(**model_kwargs)
    else:
        model = VisionTransformer(**model_kwargs)
    model.set_grad_checkpointing(cfg.model.grad_checkpointing)
    return model


def setup(cfg: Config, prepare_model: Callable[[nn.Module], dict[str, str]] | None = None) -> Setup:
    env = init_distributed()
    run_dir = Path(cfg.run.dir)
    info = read_dataset_info(cfg.data.path)
    model_kwargs = model_kwargs_from_config(cfg.model, info.num_classes)
    if model_kwargs["num_classes"] != info.num_classes:
        raise DataError(f"model.num_classes={model_kwargs['num_classes']} but {cfg.data.path}/dataset.json has "
                        f"{info.num_classes} classes")
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    ds_config = deepspeed_config(cfg, env.world_size)

    model = build_model(cfg, model_kwargs, ds_config)
    tags = prepare_model(model) if prepare_model is not None else {}
    groups = param_groups(model, cfg.train, model_kwargs["depth"])
    optimizer = build_optimizer(groups, cfg.train)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           lr_scheduler=build_scheduler(optimizer, cfg.train), config=ds_config)
    if cfg.train.compile:
        engine.compile()

    img_size = model_kwargs["img_size"]
    # The loader hands out micro batches; loader.accum of them (DeepSpeed's accumulation) make a step.
    train_loader = build_train_loader(cfg.data, img_size, cfg.train.micro_batch_size, seed=cfg.train.seed,
                                      rank=env.rank, world_size=env.world_size, info=info,
                                      global_batch_size=resolve_batch(cfg.train, env.world_size)[0])
    eval_loader = build_eval_loader(cfg.data, img_size, cfg.train.eval_batch_size or cfg.train.micro_batch_size,
                                    rank=env.rank, world_size=env.world_size, info=info)
    tracker = start_tracking(cfg, run_dir, env.is_main, env.world_size, tags=tags)
    dtype = torch.bfloat16 if cfg.deepspeed.bf16 else torch.float32
    return Setup(env, engine, model_kwargs, train_loader, eval_loader, tracker, dtype,
                 model_flops(model_kwargs))


# ----------------------------------------------------------------------------- resume


def resume(s: Setup, cfg: Config) -> int:
    """Load RUN_DIR's latest checkpoint if there is one; return the step to continue from."""
    run_dir = Path(cfg.run.dir)
    tag = ckpt.latest_tag(run_dir)
    if tag is None:
        return 0
    state_file = ckpt.checkpoint_dir(run_dir) / tag / "trainer_state.json"
    saved = json.loads(state_file.read_text())
    diff = [f"{k}: {saved['model'].get(k)} (checkpoint) vs {s.model_kwargs.get(k)} (config)"
            for k in SHAPE_KEYS if _norm(saved["model"].get(k)) != _norm(s.model_kwargs.get(k))]
    if diff:
        raise TrainError(f"{state_file.parent} was trained with a different model; refusing to resume: "
                         + "; ".join(diff) + ". Use a new run.dir or the matching config.")
    client = ckpt.load_checkpoint(s.engine, run_dir, tag)
    s.train_loader.load_state_dict(client["data"])  # layout-free: continues the epoch on any world size
    if client["world_size"] == s.env.world_size:
        ckpt.set_rng_state(client["rng"][s.env.rank])
    else:
        log(s.env, f"note: checkpoint was written by {client['world_size']} ranks, this job has "
                   f"{s.env.world_size}: the same samples follow, but dropout's random draws differ")
    log(s.env, f"resumed from {state_file.parent} at step {client['step']}")
    return int(client["step"])


def _norm(v: Any) -> Any:
    return list(v) if isinstance(v, (tuple, list)) else v


def save(s: Setup, cfg: Config, step: int) -> str:
    """Collective checkpoint: DeepSpeed state + the data state (once) + every rank's RNG + what the run is."""
    counters = merge_counters(ckpt.gather_to_all(s.train_loader.counters()))  # bad data of all ranks
    client = {
        "version": ckpt.STATE_VERSION,
        "step": step,
        "world_size": s.env.world_size,
        "data": s.train_loader.state_dict(counters),
        "rng": ckpt.gather_to_all(ckpt.rng_state()),
        "mlflow_run_id": s.tracker.run_id,
    }
    tag = ckpt.tag_for(step)
    if s.env.is_main:  # human-readable and checked before DeepSpeed touches a mismatched model
        state_dir = ckpt.checkpoint_dir(Path(cfg.run.dir)) / tag
        state_dir.mkdir(parents=True, exist_ok=True)
        (state_dir / "trainer_state.json").write_text(json.dumps(
            {"step": step, "world_size": s.env.world_size, "model": _jsonable(s.model_kwargs),
             "config": to_dict(cfg), "mlflow_run_id": s.tracker.run_id}, indent=1))
    return ckpt.save_checkpoint(s.engine, Path(cfg.run.dir), step, client, cfg.train.keep_last,
                                cfg.train.keep_every)


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _norm(v) for k, v in d.items()}


# ----------------------------------------------------------------------------- step and eval


def loss_fn(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    if targets.ndim == 2:  # Mixup/CutMix soft targets (already smoothed)
        return torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()
    return F.cross_entropy(logits, targets, label_smoothing=label_smoothing)


@torch.no_grad()
def evaluate(s: Setup) -> dict[str, float]:
    """Loss, top-1, top-5 over the whole validation split; padded samples are masked out."""
    s.engine.eval()
    device = s.engine.device
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, top-1 hits, top-5 hits, count
    for images, targets, valid in s.eval_loader:
        logits = s.engine(images.to(device, s.dtype, non_blocking=True)).float()
        targets, valid = targets.to(device, non_blocking=True), valid.to(device, torch.float64)
        loss = F.cross_entropy(logits, targets, reduction="none").double()
        top1, top5 = topk_correct(logits, targets)
        totals += torch.stack([(loss * valid).sum(), (top1.double() * valid).sum(), (top5.double() * valid).sum(),
                               valid.sum()])
    if dist.is_initialized():
        dist.all_reduce(totals)
    s.engine.train()
    n = max(totals[3].item(), 1.0)
    return {"eval/loss": totals[0].item() / n, "eval/top1": totals[1].item() / n, "eval/top5": totals[2].item() / n,
            "eval/samples": totals[3].item()}


def all_finite(loss: torch.Tensor) -> bool:
    """Do all ranks have a finite loss? (They must agree: one rank skipping backward alone would hang.)"""
    bad = (~torch.isfinite(loss.detach())).float().reshape(1)
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() == 0


def _format(step: int, total: int, m: dict[str, float]) -> str:
    parts = [f"step {step}/{total}", f"loss {m['train/loss']:.4f}", f"lr {m['train/lr']:.3e}"]
    if "train/grad_norm" in m:
        parts.append(f"gnorm {m['train/grad_norm']:.3f}")
    parts.append(f"{m['perf/images_per_s']:,.0f} img/s")
    if "perf/mfu" in m:
        parts.append(f"mfu {100 * m['perf/mfu']:.1f}%")
    parts += [f"data {100 * m['perf/data_wait']:.0f}%", f"bad {m['data/bad_samples']:.0f}"]
    return " | ".join(parts)


# ----------------------------------------------------------------------------- the loop


def fit(cfg: Config, prepare_model: Callable[[nn.Module], dict[str, str]] | None = None) -> int:
    s = setup(cfg, prepare_model)
    env, engine, tc = s.env, s.engine, cfg.train
    step = resume(s, cfg)
    preemption = PreemptionHandler()
    meter = ThroughputMeter(s.flops_per_image, env.world_size, device_peak_flops(tc.peak_flops))
    log(env, f"{cfg.run.kind}: {cfg.model.variant} {s.model_kwargs['img_size']} | world size {env.world_size} | "
             f"global batch {s.train_loader.global_batch} ({s.train_loader.accum} x {tc.micro_batch_size} x "
             f"{env.world_size}) | "
             f"ZeRO-{cfg.deepspeed.zero_stage} | steps {step}->{tc.steps} | run dir {cfg.run.dir}")
    bar = _progress(env, step, tc.steps)
    data = iter(s.train_loader)
    loss_sum = torch.zeros((), device=engine.device)  # summed on device; read only at log steps (no sync)
    micro_count, nonfinite_in_a_row, nonfinite_total = 0, 0, 0
    last_saved = step if step > 0 else -1  # a resumed run's checkpoint is the one at `step`

    while step < tc.steps:
        t0 = time.perf_counter()
        images, targets = next(data)
        wait = time.perf_counter() - t0
        images, targets = s.train_loader.to_device(images, targets, engine.device, s.dtype)  # data.decode_device
        loss = loss_fn(engine(images).float(), targets, cfg.data.label_smoothing)
        meter.add(images.shape[0], wait)
        if tc.check_finite and not all_finite(loss):
            nonfinite_in_a_row, nonfinite_total = nonfinite_in_a_row + 1, nonfinite_total + 1
            log(env, f"warning: non-finite loss at step {step}: micro batch skipped ({nonfinite_in_a_row} in a row)")
            if nonfinite_in_a_row >= tc.max_nonfinite_steps:
                good = ckpt.latest_tag(Path(cfg.run.dir))
                print(f"error: {nonfinite_in_a_row} non-finite losses in a row at step {step}; stopping without "
                      f"saving. Last good checkpoint: {good or 'none'} in {ckpt.checkpoint_dir(Path(cfg.run.dir))}",
                      file=sys.stderr, flush=True)
                s.tracker.finish("FAILED")
                return NONFINITE_EXIT_CODE
            continue
        boundary = engine.is_gradient_accumulation_boundary()
        engine.backward(loss)
        engine.step()  # optimizer + schedule step only at the accumulation boundary
        loss_sum += loss.detach()
        micro_count += 1
        if not boundary:
            continue
        step += 1
        nonfinite_in_a_row = 0
        if bar is not None:
            bar.update(1)

        if step % tc.log_every == 0 or step == tc.steps:
            metrics = window_metrics(s, loss_sum, micro_count, meter, nonfinite_total)
            loss_sum.zero_()
            micro_count = 0
            s.tracker.log_metrics(metrics, step)
            _print_log(env, bar, _format(step, tc.steps, metrics))
        if (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps:
            metrics = evaluate(s)
            s.tracker.log_metrics(metrics, step)
            _print_log(env, bar, f"eval step {step} | loss {metrics['eval/loss']:.4f} | "
                                 f"top-1 {100 * metrics['eval/top1']:.2f}% | top-5 {100 * metrics['eval/top5']:.2f}%")
            meter.reset()  # eval time is not training throughput
        if tc.ckpt_every and step % tc.ckpt_every == 0 and step < tc.steps:
            save(s, cfg, step)
            last_saved = step
            meter.reset()
        if step < tc.steps and preemption.should_stop():
            if last_saved != step:
                save(s, cfg, step)
            log(env, f"preempted: checkpoint at step {step} saved; exiting with {PREEMPTED_EXIT_CODE} to be requeued")
            s.tracker.finish(status=None)  # the requeued job continues this MLflow run
            return PREEMPTED_EXIT_CODE

    if last_saved != step:
        save(s, cfg, step)
    finish(s, cfg, step)
    if bar is not None:
        bar.close()
    return 0


def window_metrics(s: Setup, loss_sum: torch.Tensor, micro_count: int, meter: ThroughputMeter,
                   nonfinite_total: int) -> dict[str, float]:
    """The figures of one log line. Reads the device (one sync per log step, not per step)."""
    window = loss_sum.clone()
    if dist.is_initialized():
        dist.all_reduce(window)
    # Grouped by prefix: MLflow's chart view groups and sorts by it (data/, eval/, perf/, train/).
    metrics = {"train/loss": window.item() / max(micro_count * s.env.world_size, 1),
               "train/lr": s.engine.get_lr()[0], "train/nonfinite_skipped": float(nonfinite_total),
               **{f"perf/{k}": v for k, v in meter.read().items()},
               "data/bad_samples": float(sum(s.train_loader.bad_counts().values()))}
    grad_norm = s.engine.get_global_grad_norm()
    if grad_norm is not None:
        metrics["train/grad_norm"] = float(grad_norm)
    return metrics


def finish(s: Setup, cfg: Config, step: int) -> None:
    """Export consolidated weights (collective), hand the artifacts to MLflow, end the run."""
    run_dir = Path(cfg.run.dir)
    ckpt.export_weights(s.engine, run_dir / "model.safetensors",
                        metadata={"variant": cfg.model.variant, "step": str(step)})
    if s.env.is_main:
        s.tracker.log_artifact(run_dir / "config.yaml")
        s.tracker.log_artifact(run_dir / "model.safetensors")  # a path tag instead with tracking.log_model=false
    s.tracker.finish("FINISHED")
    log(s.env, f"done: {run_dir / 'model.safetensors'}")


def _progress(env: DistEnv, start: int, total: int):
    """A tqdm bar on an interactive terminal; plain lines in batch jobs (Slurm logs)."""
    if not env.is_main or not sys.stdout.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, dynamic_ncols=True, unit="step")


def _print_log(env: DistEnv, bar, line: str) -> None:
    if not env.is_main:
        return
    if bar is not None:
        bar.write(line)
    else:
        print(line, flush=True)
