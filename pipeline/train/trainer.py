"""Training, top to bottom: setup -> (resume) -> step loop with eval, checkpoints, preemption -> export.

Used by launch/pretrain.py and launch/finetune.py alike; fine-tuning only adds a `prepare_model` hook
that loads the source weights into the freshly built model. Whether to start or resume, and what a
resume restores in which order, is `pipeline.train.resume`. Exit codes: `pipeline.exit_codes`.
"""

from __future__ import annotations

import dataclasses
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

from pipeline.config import Config, save_config, to_dict
from pipeline.data import (
    DataError,
    build_eval_loader,
    build_train_loader,
    merge_counters,
    raise_if_any_failed,
    read_dataset_info,
)
from pipeline.derived import deepspeed_config, resolve_batch
from pipeline.dist import DistEnv, init_distributed
from pipeline.exit_codes import ExitCode
from pipeline.model.mae import MaskedAutoencoderViT, mae_flops
from pipeline.model.vit import VisionTransformer, model_flops, model_kwargs_from_config
from pipeline.signals import exit_at_once_on_signal
from pipeline.tracking import start_tracking
from pipeline.train import checkpoint as ckpt
from pipeline.train import mae, resume
from pipeline.train.metrics import ThroughputMeter, device_peak_flops, topk_correct
from pipeline.train.optim import build_optimizer, build_scheduler, exempt_names, param_groups, peak_group_lr
from pipeline.train.preemption import Preemption
from pipeline.train.watchdog import Watchdog, process_group_timeout_s

# Agree on preemption every N optimizer steps (an all-reduce of one int; `python launch/bench.py preemption` measures its cost).
PREEMPTION_CHECK_EVERY = 1


@dataclass
class Setup:
    env: DistEnv
    engine: Any
    optimizer: torch.optim.Optimizer  # the client optimizer: its param_groups are the ones DeepSpeed steps
    groups: list[dict[str, Any]]  # what each of its groups is (decay? layer?), as param_groups built them
    model_kwargs: dict[str, Any]
    train_loader: Any
    eval_loader: Any
    tracker: Any
    dtype: torch.dtype
    flops_per_image: float
    plan: resume.ResumePlan | None
    is_mae: bool = False  # model.objective: mae (pipeline/train/mae.py)
    knn_loader: Any = None  # MAE's k-NN memory: a labelled subset of train, visited like the eval split
    watchdog: Watchdog | None = None  # started with the loop (fit)


def log(env: DistEnv, msg: str) -> None:
    if env.is_main:
        print(msg, flush=True)


# ----------------------------------------------------------------------------- setup


def build_model(cfg: Config, model_kwargs: dict[str, Any], ds_config: dict[str, Any]) -> VisionTransformer:
    # Same seed on every rank: identical initial weights without a broadcast (ZeRO-3 broadcasts rank 0's).
    torch.manual_seed(cfg.train.seed)
    model_class = MaskedAutoencoderViT if cfg.model.objective == "mae" else VisionTransformer
    if cfg.deepspeed.zero_stage == 3:
        # Parameters are partitioned as they are created: a model larger than one device still builds.
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = model_class(**model_kwargs)
    else:
        model = model_class(**model_kwargs)
    model.set_grad_checkpointing(cfg.model.grad_checkpointing)
    return model


def setup(cfg: Config, prepare_model: Callable[[nn.Module], dict[str, str]] | None = None) -> Setup:
    with exit_at_once_on_signal("joining the process group"):
        env = init_distributed(process_group_timeout_s(cfg.dist.timeout_s))
    run_dir = Path(cfg.run.dir)
    info = read_dataset_info(cfg.data.path)
    is_mae = cfg.model.objective == "mae"
    if not is_mae and info.num_classes == 0:
        raise DataError(f"{cfg.data.path}: the shards have no labels (dataset.json: num_classes 0); supervised "
                        f"training needs them: pretrain on them with model.objective=mae, or write labelled shards")
    model_kwargs = mae.mae_model_kwargs(cfg) if is_mae else model_kwargs_from_config(cfg.model, info.num_classes)
    if not is_mae and model_kwargs["num_classes"] != info.num_classes:
        raise DataError(f"model.num_classes={model_kwargs['num_classes']} but {cfg.data.path}/dataset.json has "
                        f"{info.num_classes} classes")
    plan = resume.plan(cfg, env, model_kwargs)  # locks run_dir; refuses a wrong checkpoint before DeepSpeed
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    ds_config = deepspeed_config(cfg, env.world_size)
    if plan is not None and plan.universal:
        ds_config["checkpoint"] = {"load_universal": True}

    model = build_model(cfg, model_kwargs, ds_config)
    tags = prepare_model(model) if prepare_model is not None else {}
    resume.check_same_decay_groups(plan, model)  # before DeepSpeed loads an optimizer state of other groups
    groups = param_groups(model, cfg.train, model_kwargs["depth"])
    optimizer = build_optimizer(groups, cfg.train, offload=cfg.deepspeed.offload_optimizer)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           lr_scheduler=build_scheduler(optimizer, cfg.train), config=ds_config)
    if cfg.train.compile:
        engine.compile()

    img_size = model_kwargs["img_size"]
    # The loader hands out micro batches; loader.accum of them (DeepSpeed's accumulation) make a step.
    # MAE reads no labels: label-free shards train, and a labelled set's labels are not needed.
    train_data = mae.label_free(cfg.data) if is_mae else cfg.data
    train_loader = build_train_loader(train_data, img_size, cfg.train.micro_batch_size, seed=cfg.train.seed,
                                      rank=env.rank, world_size=env.world_size, info=info,
                                      global_batch_size=resolve_batch(cfg.train, env.world_size)[0],
                                      per_batch=mae.train_noise_fn(cfg.train.seed, mae.num_patches(model_kwargs))
                                      if is_mae else None)
    eval_batch = cfg.train.eval_batch_size or cfg.train.micro_batch_size
    labelled = info.num_classes > 0
    eval_data = mae.label_free(cfg.data) if is_mae and not labelled else cfg.data
    eval_loader = build_eval_loader(eval_data, img_size, eval_batch, rank=env.rank, world_size=env.world_size,
                                    info=info)
    knn_loader = None
    if is_mae and labelled and cfg.mae.knn_k > 0:
        # The k-NN memory: the first mae.knn_train_samples of the train split, eval transform, labels read.
        knn_loader = build_eval_loader(dataclasses.replace(cfg.data, val_split=cfg.data.train_split), img_size,
                                       eval_batch, rank=env.rank, world_size=env.world_size, info=info,
                                       limit=cfg.mae.knn_train_samples)
    tracker = start_tracking(cfg, run_dir, env.is_main, env.world_size, tags=tags)
    dtype = torch.bfloat16 if cfg.deepspeed.bf16 else torch.float32
    flops = mae_flops(model_kwargs, cfg.mae.mask_ratio) if is_mae else model_flops(model_kwargs)
    return Setup(env, engine, optimizer, groups, model_kwargs, train_loader, eval_loader, tracker, dtype,
                 flops, plan, is_mae, knn_loader)


# ----------------------------------------------------------------------------- save


def save(s: Setup, cfg: Config, step: int) -> str:
    """Collective checkpoint: DeepSpeed state + the data state (once, layout-free) and every rank's RNG
    (client state) + what the tag is (trainer_state.json, written by rank 0)."""
    s.watchdog.beat("checkpoint save", step)
    counters = merge_counters(ckpt.gather_to_all(s.train_loader.counters()))  # bad data of all ranks
    client = {"data": s.train_loader.state_dict(counters), "rng": ckpt.gather_to_all(ckpt.rng_state())}
    state = ckpt.TrainerState(step=step, world_size=s.env.world_size,
                              model={k: resume.plain(v) for k, v in s.model_kwargs.items()}, config=to_dict(cfg),
                              no_weight_decay=exempt_names(s.engine.module))
    return ckpt.save_checkpoint(s.engine, Path(cfg.run.dir), state, client, cfg.train.keep_last,
                                cfg.train.keep_every)


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
    raise_if_any_failed(s.eval_loader)  # collective: a pass that failed on one rank stops all of them here
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


class NonFiniteLosses(Exception):
    """Too many non-finite losses in a row: stop without saving (exit 3)."""


@dataclass
class NonFiniteGuard:
    """Skips micro batches whose loss is not finite on some rank, and stops a diverged run."""

    limit: int
    in_a_row: int = 0
    total: int = 0

    def finite(self, env: DistEnv, loss: torch.Tensor, step: int) -> bool:
        if all_finite(loss):
            return True
        self.in_a_row, self.total = self.in_a_row + 1, self.total + 1
        log(env, f"warning: non-finite loss at step {step}: micro batch skipped ({self.in_a_row} in a row)")
        if self.in_a_row >= self.limit:
            raise NonFiniteLosses(f"{self.in_a_row} non-finite losses in a row at step {step}")
        return False


def micro_batch_loss(s: Setup, cfg: Config, data, meter: ThroughputMeter, guard: NonFiniteGuard | None,
                     step: int) -> torch.Tensor:
    """The loss of the next micro batch with a finite loss on every rank (forward only)."""
    while True:
        s.watchdog.beat("train step", step)  # a micro batch: progress
        t0 = time.perf_counter()
        images, targets = next(data)
        wait = time.perf_counter() - t0
        images, targets = s.train_loader.to_device(images, targets, s.engine.device, s.dtype)  # data.decode_device
        if s.is_mae:
            # The mask of each sample is a function of its global position: the same on any layout.
            noise = s.train_loader.last_per_batch  # drawn in the loader's workers (mae.train_noise_fn)
            loss = s.engine(images, mask_ratio=cfg.mae.mask_ratio, noise=noise.to(s.engine.device))[0].float()
        else:
            loss = loss_fn(s.engine(images).float(), targets, cfg.data.label_smoothing)
        meter.add(images.shape[0], wait)
        if guard is None or guard.finite(s.env, loss, step):
            return loss


def fit(cfg: Config, prepare_model: Callable[[nn.Module], dict[str, str]] | None = None) -> int:
    s = setup(cfg, prepare_model)
    env, engine = s.env, s.engine
    step = resume.restore(s.plan, cfg, env, engine, s.optimizer, s.groups, engine.lr_scheduler, s.train_loader,
                          s.model_kwargs["depth"])
    preemption = Preemption(every=PREEMPTION_CHECK_EVERY)
    if preemption.should_stop():  # first safe point: a signal arrived during setup or the checkpoint load
        log(env, f"preempted during setup: nothing new to save (step {step}); exiting with {int(ExitCode.PREEMPTED)} "
                 f"to be requeued")
        s.tracker.finish(status=None)
        return ExitCode.PREEMPTED
    # From here on a rank that stops making progress ends the job and says where (pipeline/train/watchdog.py).
    s.watchdog = Watchdog(cfg.dist.timeout_s, env.rank, Path(cfg.run.dir))
    for loader in (s.eval_loader, s.knn_loader):
        if loader is not None:
            loader.progress = s.watchdog.touch  # each eval batch is progress
    try:
        return train_loop(s, cfg, step, preemption)
    finally:
        s.watchdog.stop()


def train_loop(s: Setup, cfg: Config, step: int, preemption: Preemption) -> int:
    """From `step` to train.steps: the steps, evaluations, checkpoints, the preemption check, the export."""
    env, engine, tc = s.env, s.engine, cfg.train
    accum = s.train_loader.accum  # micro batches per rank per step: train.global_batch_size / layout
    meter = ThroughputMeter(s.flops_per_image, env.world_size, device_peak_flops(tc.peak_flops))
    log(env, f"{cfg.run.kind}: {cfg.model.variant} {s.model_kwargs['img_size']} | world size {env.world_size} | "
             f"global batch {s.train_loader.global_batch} ({s.train_loader.accum} x {tc.micro_batch_size} x "
             f"{env.world_size}) | "
             f"ZeRO-{cfg.deepspeed.zero_stage} | steps {step}->{tc.steps} | run dir {cfg.run.dir}")
    bar = _progress(env, step, tc.steps)
    data = iter(s.train_loader)
    guard = NonFiniteGuard(tc.max_nonfinite_steps) if tc.check_finite else None
    loss_sum = torch.zeros((), device=engine.device)  # summed on device; read only at log steps (no sync)
    micro_count = 0
    last_saved = step if step > 0 else -1  # a resumed run's checkpoint is the one at `step`

    while step < tc.steps:  # one optimizer step per iteration
        try:
            for _ in range(accum):  # the micro batches of this step; DeepSpeed steps at the last one
                loss = micro_batch_loss(s, cfg, data, meter, guard, step)
                engine.backward(loss)
                engine.step()
                loss_sum += loss.detach()
                micro_count += 1
        except NonFiniteLosses as e:
            good = ckpt.latest_tag(Path(cfg.run.dir))
            print(f"error: {e}; stopping without saving. Last good checkpoint: {good or 'none'} in "
                  f"{ckpt.checkpoint_dir(Path(cfg.run.dir))}", file=sys.stderr, flush=True)
            s.tracker.finish("FAILED")
            return ExitCode.NONFINITE
        step += 1
        # A micro batch skipped for a non-finite loss was replaced by the next one: realign the stream
        # so that every step keeps its own samples and the checkpoint's data position is exact.
        s.train_loader.seek_step(step)
        if guard is not None:
            guard.in_a_row = 0
        if bar is not None:
            bar.update(1)

        if step % tc.log_every == 0 or step == tc.steps:
            metrics = window_metrics(s, loss_sum, micro_count, meter, guard.total if guard else 0)
            loss_sum.zero_()
            micro_count = 0
            s.tracker.log_metrics(metrics, step)
            _print_log(env, bar, _format(step, tc.steps, metrics))
        evaluating = (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps
        if evaluating:
            s.watchdog.beat("eval", step)
        if s.is_mae and evaluating:
            metrics, image = mae.evaluate_mae(engine, s.eval_loader, s.knn_loader, cfg, s.dtype,
                                              Path(cfg.run.dir) if env.is_main else None, step)
            s.tracker.log_metrics(metrics, step)
            if image is not None:
                s.tracker.log_artifact(image, "reconstructions")
            knn = f" | k-NN top-1 {100 * metrics['eval/knn_top1']:.2f}%" if "eval/knn_top1" in metrics else ""
            _print_log(env, bar, f"eval step {step} | reconstruction loss {metrics['eval/recon_loss']:.4f}{knn}")
            meter.reset()
        elif evaluating:
            metrics = evaluate(s)
            s.tracker.log_metrics(metrics, step)
            _print_log(env, bar, f"eval step {step} | loss {metrics['eval/loss']:.4f} | "
                                 f"top-1 {100 * metrics['eval/top1']:.2f}% | top-5 {100 * metrics['eval/top5']:.2f}%")
            meter.reset()  # eval time is not training throughput
        if tc.ckpt_every and step % tc.ckpt_every == 0 and step < tc.steps:
            save(s, cfg, step)
            last_saved = step
            meter.reset()
        if step < tc.steps and preemption.should_stop(step):
            if last_saved != step:
                save(s, cfg, step)
            log(env, f"preempted: checkpoint at step {step} saved; exiting with {int(ExitCode.PREEMPTED)} to be requeued")
            s.tracker.finish(status=None)  # the requeued job continues this MLflow run
            return ExitCode.PREEMPTED

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
               "train/lr": peak_group_lr(s.optimizer.param_groups), "train/nonfinite_skipped": float(nonfinite_total),
               **{f"perf/{k}": v for k, v in meter.read().items()},
               "data/bad_samples": float(sum(s.train_loader.bad_counts().values()))}
    grad_norm = s.engine.get_global_grad_norm()
    if grad_norm is not None:
        metrics["train/grad_norm"] = float(grad_norm)
    return metrics


def finish(s: Setup, cfg: Config, step: int) -> None:
    """Export consolidated weights (collective), hand the artifacts to MLflow, end the run."""
    s.watchdog.beat("export", step)
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
