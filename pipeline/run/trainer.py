"""Training, top to bottom: setup -> (resume) -> step loop with eval, checkpoints, preemption -> export.

Used by launch/pretrain.py and launch/finetune.py alike; fine-tuning only adds a `prepare_model` hook
that loads the source weights into the freshly built model. Whether to start or resume is decided once,
at the command (`pipeline.run.resume.start`: process group, lock, plan), and handed to `fit`; what a
resume restores in which order is `pipeline.run.resume`. Exit codes: `pipeline.exit_codes`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from pipeline.config import Config, save_config, to_dict
from pipeline.data import build_train_loader, dataset_info_of
from pipeline.derived import deepspeed_config, resolve_batch
from pipeline.dist import DistEnv, after_exit, say
from pipeline.exit_codes import ExitCode
from pipeline.objectives import OBJECTIVES, EvalResult, Objective, build_objective
from pipeline.run import resume
from pipeline.tracking import start_metrics, start_tracking
from pipeline.train import checkpoint as ckpt
from pipeline.train import mirror
from pipeline.train.ema import ModelEma, build_model_ema, float32_init
from pipeline.train.metrics import ThroughputMeter, device_peak_flops
from pipeline.train.optim import (
    apply_hparams,
    build_optimizer,
    build_scheduler,
    exempt_names,
    param_groups,
    peak_group_lr,
)
from pipeline.train.preemption import Preemption
from pipeline.train.state import ClientState, training_client_state
from pipeline.train.watchdog import Watchdog

MIRROR_POLL_S = 5.0  # a preempted stop waiting for run.remote's uploads: seconds between agreements
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
    eval_loaders: list[Any]  # the objective's: each batch is progress for the watchdog
    tracker: Any
    dtype: torch.dtype
    flops_per_image: float
    plan: resume.ResumePlan | None
    objective: Objective  # what the recipe is (pipeline/objectives/): model, data view, loss, eval
    run_dir: Path
    client_state: ClientState  # what a checkpoint holds besides DeepSpeed's engine (pipeline/train/state.py)
    ema: ModelEma | None = None  # train.ema_decay: evaluated beside the model, exported in its place
    watchdog: Watchdog | None = None  # started with the loop (fit)

    @property
    def eval_loader(self) -> Any:
        """The objective's validation pass."""
        return self.objective.eval_loader


# ----------------------------------------------------------------------------- setup


def build_model(cfg: Config, model_kwargs: dict[str, Any], ds_config: dict[str, Any],
                objective: Objective | None = None) -> nn.Module:
    """The objective's model (by default the one model.objective registers), seeded, under zero.Init
    with ZeRO-3."""
    # Same seed on every rank: identical initial weights without a broadcast (ZeRO-3 broadcasts rank 0's).
    torch.manual_seed(cfg.train.seed)
    build = objective.build_model if objective is not None else \
        (lambda kwargs: OBJECTIVES[cfg.model.objective].model_class(**kwargs))
    if cfg.deepspeed.zero_stage == 3:
        # Parameters are partitioned as they are created: a model larger than one device still builds.
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = build(model_kwargs)
    else:
        model = build(model_kwargs)
    model.set_grad_checkpointing(cfg.model.grad_checkpointing)
    return model


def build_engine(cfg: Config, model: nn.Module, depth: int, ds_config: dict[str, Any]
                 ) -> tuple[Any, torch.optim.Optimizer, list[dict[str, Any]]]:
    """The DeepSpeed engine around `model`: parameter groups, optimizer, schedule, compile where asked.
    Returns (engine, the client optimizer, what each of its groups is). benchmarks/engine.py uses it too."""
    groups = param_groups(model, cfg.train, depth)
    optimizer = build_optimizer(groups, cfg.train, offload=cfg.deepspeed.offload_optimizer)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           lr_scheduler=build_scheduler(optimizer, cfg.train), config=ds_config)
    if cfg.train.compile:
        engine.compile()
    return engine, optimizer, groups


def setup(cfg: Config, env: DistEnv, plan: resume.ResumePlan | None,
          prepare_model: Callable[[nn.Module], dict[str, str]] | None = None) -> Setup:
    """Everything the loop needs, in a process group joined and a run directory locked by `resume.start`,
    which also made `plan` (None: a fresh start)."""
    run_dir = Path(cfg.run.dir)
    info = dataset_info_of(cfg.data)  # a dataset.json at a URL is retried by data.retry_*, as shards are
    objective = build_objective(cfg, info)
    model_kwargs = objective.model_kwargs()
    resume.check_model_and_convert(plan, cfg, env, model_kwargs)  # a wrong checkpoint: refused before DeepSpeed
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    ds_config = deepspeed_config(cfg, env.world_size)
    if plan is not None and plan.universal:
        ds_config["checkpoint"] = {"load_universal": True}

    model = build_model(cfg, model_kwargs, ds_config, objective)
    tags = prepare_model(model) if prepare_model is not None else {}
    resume.check_same_decay_groups(plan, model)  # before DeepSpeed loads an optimizer state of other groups
    # The models that follow this one (a teacher, the model EMA): after the fine-tune source is loaded (they
    # start from it) and before DeepSpeed casts the model to bf16; float32, under ZeRO-3 partitioned alike.
    objective.build_companions(model, model_kwargs, float32_init(cfg, ds_config))
    ema = build_model_ema(cfg, model, lambda: objective.build_model(model_kwargs), ds_config)
    engine, optimizer, groups = build_engine(cfg, model, model_kwargs["depth"], ds_config)
    if ema is not None:
        ema.to(engine.device)

    img_size = model_kwargs["img_size"]
    # The loader hands out micro batches; loader.accum of them (DeepSpeed's accumulation) make a step.
    train_loader = build_train_loader(objective.train_data(), img_size, cfg.train.micro_batch_size,
                                      seed=cfg.train.seed, rank=env.rank, world_size=env.world_size, info=info,
                                      global_batch_size=resolve_batch(cfg.train, env.world_size)[0],
                                      per_batch=objective.per_batch(model_kwargs),
                                      view=objective.sample_view(model_kwargs))
    eval_loaders = objective.build_eval(env, img_size, cfg.train.eval_batch_size or cfg.train.micro_batch_size)
    tracker = start_tracking(cfg, run_dir, env.is_main, env.world_size, tags=tags)
    dtype = torch.bfloat16 if cfg.deepspeed.bf16 else torch.float32
    return Setup(env, engine, optimizer, groups, model_kwargs, train_loader, eval_loaders, tracker, dtype,
                 objective.flops_per_image(model_kwargs), plan, objective, run_dir,
                 training_client_state(train_loader, objective, env, ema), ema)


# ----------------------------------------------------------------------------- save


def save(s: Setup, cfg: Config, step: int) -> str:
    """Collective checkpoint: DeepSpeed's engine + the client state's parts (data position, objective,
    every rank's RNG: pipeline/train/state.py) + what the tag is (trainer_state.json, written by rank 0)."""
    s.watchdog.beat("checkpoint save", step)
    client = s.client_state.state_dict()
    state = ckpt.TrainerState(step=step, world_size=s.env.world_size,
                              model={k: resume.plain(v) for k, v in s.model_kwargs.items()}, config=to_dict(cfg),
                              no_weight_decay=exempt_names(s.engine.module))
    tag = ckpt.save_checkpoint(s.engine, Path(cfg.run.dir), state, client, cfg.train.keep_last,
                               cfg.train.keep_every)
    if s.env.is_main:
        mirror.saved(Path(cfg.run.dir), tag)  # run.remote: uploaded in the background (train/mirror.py)
    return tag


# ----------------------------------------------------------------------------- step and eval


def evaluate(s: Setup, step: int) -> EvalResult:
    """The objective's evaluation (collective); rank 0 is given the run directory to write figures to. With
    train.ema_decay the model EMA's too, its metrics beside the model's (eval/top1_ema)."""
    result = s.objective.evaluate(s.engine, s.dtype, s.run_dir if s.env.is_main else None, step)
    if s.ema is None:
        return result
    ema = s.ema.evaluate(s.objective, step)
    return EvalResult({**result.metrics, **ema.metrics}, f"{result.line}\n{ema.line}", result.artifacts)


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

    def finite(self, loss: torch.Tensor, step: int) -> bool:
        if all_finite(loss):
            return True
        self.in_a_row, self.total = self.in_a_row + 1, self.total + 1
        say(f"warning: non-finite loss at step {step}: micro batch skipped ({self.in_a_row} in a row)")
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
        # Extras (the objective's per_batch) were computed in the loader's workers with this micro batch.
        loss = s.objective.loss(s.engine, images, targets, s.train_loader.last_per_batch)
        meter.add(len(targets), wait)  # samples: an objective's view makes `images` a tuple of crops
        if guard is None or guard.finite(loss, step):
            return loss


def backward_and_step(engine: Any, loss: torch.Tensor) -> None:
    """One micro batch's backward; DeepSpeed steps the optimizer (and the schedule) at the last micro
    batch of the step and only accumulates before it. benchmarks/engine.py times this very function."""
    engine.backward(loss)
    engine.step()


def fit(cfg: Config, env: DistEnv, plan: resume.ResumePlan | None,
        prepare_model: Callable[[nn.Module], dict[str, str]] | None = None) -> int:
    """Train `cfg` from `plan` (`resume.start`'s, made once at the command); the exit code."""
    s = setup(cfg, env, plan, prepare_model)
    engine = s.engine
    step = resume.restore(s.plan, cfg, env, engine, s.client_state, reapply_hparams=lambda: apply_hparams(
        s.optimizer.param_groups, s.groups, engine.lr_scheduler, cfg.train, s.model_kwargs["depth"]))
    if env.is_main:  # world size, restarts and lost steps, before this start logs anything
        s.tracker.log_metrics(start_metrics(Path(cfg.run.dir), step, env.world_size), step)
    preemption = Preemption(every=PREEMPTION_CHECK_EVERY)
    if preemption.should_stop():  # first safe point: a signal arrived during setup or the checkpoint load
        say(f"preempted during setup: nothing new to save (step {step}); exiting with {int(ExitCode.PREEMPTED)} "
            f"{after_exit()}")
        s.tracker.finish(status=None)
        return ExitCode.PREEMPTED
    # From here on a rank that stops making progress ends the job and says where (pipeline/train/watchdog.py).
    s.watchdog = Watchdog(cfg.dist.timeout_s, env.rank, Path(cfg.run.dir))
    for loader in s.eval_loaders:
        loader.progress = s.watchdog.touch  # each eval batch is progress
    try:
        return train_loop(s, cfg, step, preemption)
    finally:
        s.watchdog.stop()


def wait_for_mirror(s: Setup, cfg: Config, step: int, group: Any) -> None:
    """A preempted stop: no rank exits before rank 0's run.remote uploads are done (a launcher ends the
    other ranks when one exits). Rounds of at most MIRROR_POLL_S and one all-reduce over the preemption's
    CPU group, every rank beating its watchdog: an upload longer than dist.timeout_s is not a hang."""
    while True:
        s.watchdog.beat("run.remote upload", step)
        busy = torch.tensor([0 if not s.env.is_main or mirror.drain(Path(cfg.run.dir), MIRROR_POLL_S) else 1],
                            dtype=torch.int32)
        if group is not None:
            dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=group)
        if not busy.item():
            return


def train_loop(s: Setup, cfg: Config, step: int, preemption: Preemption) -> int:
    """From `step` to train.steps: the steps, evaluations, checkpoints, the preemption check, the export."""
    env, engine, tc = s.env, s.engine, cfg.train
    accum = s.train_loader.accum  # micro batches per rank per step: train.global_batch_size / layout
    meter = ThroughputMeter(s.flops_per_image, env.world_size, device_peak_flops(tc.peak_flops))
    say(f"{cfg.run.kind}: {cfg.model.variant} {s.model_kwargs['img_size']} | world size {env.world_size} | "
        f"global batch {s.train_loader.global_batch} ({s.train_loader.accum} x {tc.micro_batch_size} x "
        f"{env.world_size}) | "
        f"ZeRO-{cfg.deepspeed.zero_stage} | steps {step}->{tc.steps} | run dir {cfg.run.dir}")
    bar = _progress(env, step, tc.steps)
    data = iter(s.train_loader)
    guard = NonFiniteGuard(tc.max_nonfinite_steps) if tc.check_finite else None
    loss_sum = torch.zeros((), device=engine.device)  # summed on device; read only at log steps (no sync)
    micro_count = 0
    last_saved = step if step > 0 else -1  # a resumed run's checkpoint is the one at `step`
    saved_at = time.monotonic()  # train.ckpt_every_s counts from here and from each save

    while step < tc.steps:  # one optimizer step per iteration
        try:
            for _ in range(accum):  # the micro batches of this step; DeepSpeed steps at the last one
                loss = micro_batch_loss(s, cfg, data, meter, guard, step)
                backward_and_step(engine, loss)
                loss_sum += loss.detach()
                micro_count += 1
            s.objective.after_step(engine, step + 1)  # DeepSpeed stepped the optimizer at the last one
            if s.ema is not None:
                s.ema.update(step + 1)
        except NonFiniteLosses as e:
            good = ckpt.newest_complete_tag(Path(cfg.run.dir))
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
            result = evaluate(s, step)
            s.tracker.log_metrics(result.metrics, step)
            for path, folder in result.artifacts:
                s.tracker.log_artifact(path, folder)
            _print_log(env, bar, result.line)
            meter.reset()  # eval time is not training throughput
        # train.ckpt_every_s: each rank's clock only proposes; the agreement makes every rank save one step.
        due = bool(tc.ckpt_every_s) and time.monotonic() - saved_at >= tc.ckpt_every_s
        stop, timed = preemption.check(step, due) if step < tc.steps else (False, False)
        if (tc.ckpt_every and step % tc.ckpt_every == 0 and step < tc.steps) or timed:
            save(s, cfg, step)
            last_saved, saved_at = step, time.monotonic()
            meter.reset()
        if stop:
            if last_saved != step:
                save(s, cfg, step)
            wait_for_mirror(s, cfg, step, preemption.group)
            say(f"preempted: checkpoint at step {step} saved; exiting with {int(ExitCode.PREEMPTED)} {after_exit()}")
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
    """The figures of one log line. Reads the device (one sync per log step, not per step): the loss sum and
    the objective's own figures (per-rank means) in one all-reduce."""
    own = s.objective.train_metrics()
    window = torch.stack([loss_sum, *(v.to(loss_sum.device, torch.float32) for v in own.values())])
    if dist.is_initialized():
        dist.all_reduce(window)
    window = window.tolist()
    # Grouped by prefix: MLflow's chart view groups and sorts by it (data/, eval/, perf/, train/).
    metrics = {"train/loss": window[0] / max(micro_count * s.env.world_size, 1),
               **{f"train/{name}": v / s.env.world_size for name, v in zip(own, window[1:])},
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
    metadata = {"variant": cfg.model.variant, "step": str(step)}
    if s.ema is not None:  # the EMA is the run's product; the checkpoints keep the raw weights
        say(f"export: model.safetensors holds the model EMA (train.ema_decay={cfg.train.ema_decay}); the "
            f"raw weights stay in {ckpt.checkpoint_dir(run_dir)}")
        state, metadata["ema_decay"] = s.ema.exported_weights(), str(cfg.train.ema_decay)
    else:
        state = s.objective.exported_weights(s.engine)  # a teacher, for DINOv2
    ckpt.export_weights(s.engine, run_dir / "model.safetensors", metadata=metadata, state=state)
    if s.env.is_main:
        # (config.yaml reached MLflow when this start connected: tracking/sync.py logs tracking.json's config)
        s.tracker.log_artifact(run_dir / "model.safetensors")  # a path tag instead with tracking.log_model=false
    s.tracker.finish("FINISHED")
    if s.env.is_main:
        mirror.finish(run_dir)  # run.remote: every tag, then config, metrics and weights are up before the end
    say(f"done: {run_dir / 'model.safetensors'}")


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
