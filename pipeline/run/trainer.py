"""Training, top to bottom: the Trainer builds the run (and applies its start-or-resume plan), then the step
loop with eval, checkpoints, preemption, then the export.

    Trainer(cfg, env, plan, prepare_model).fit() -> exit code

Used by launch/pretrain.py and launch/finetune.py alike; fine-tuning only adds a `prepare_model` hook that
loads the source weights into the freshly built model. Whether to start or resume is decided once, at the
command (`pipeline.run.resume.start`: process group, lock, plan), and handed to the Trainer, which applies
it while it builds (`Trainer.__init__`: the model checked against the checkpoint, the decay groups, then
every part restored); what a resume restores in which order is `pipeline.run.resume`. Exit codes:
`pipeline.exit_codes`.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.config import Config, save_config, to_dict
from pipeline.data import build_train_loader, read_data
from pipeline.data.pixels import resolve_pixels
from pipeline.derived import deepspeed_config, resolve_batch
from pipeline.dist import DistEnv, after_exit, say
from pipeline.eval.sets import EvalSets
from pipeline.exit_codes import ExitCode
from pipeline.objectives import build_objective
from pipeline.objectives.base import EvalResult
from pipeline.remote.retry import storage_beacon
from pipeline.run import resume
from pipeline.run.data_mix import record_mix
from pipeline.run.init_source import reload_source, versus_init
from pipeline.run.step import (
    NonFiniteGuard,
    NonFiniteLosses,
    NonFiniteWatch,
    ProgressLog,
    all_finite,
    backward_and_step,
    build_engine,
    build_model,
    format_log,
    schedule_warnings,
)
from pipeline.tracking import start_metrics, start_tracking
from pipeline.tracking.served import log_exports
from pipeline.train import checkpoint as ckpt
from pipeline.train import mirror
from pipeline.train.ema import build_model_ema, float32_init
from pipeline.train.metrics import ThroughputMeter, device_peak_flops
from pipeline.train.optim import apply_hparams, exempt_names, peak_group_lr
from pipeline.train.preemption import Preemption
from pipeline.train.state import training_client_state
from pipeline.train.step_norm import StepNormStats, batch_norms
from pipeline.train.storage_wait import StorageWaits
from pipeline.train.watchdog import Watchdog

__all__ = ["Trainer", "all_finite", "backward_and_step", "build_engine", "build_model", "fit"]

MIRROR_POLL_S = 5.0  # a preempted stop waiting for run.remote's uploads: seconds between agreements
# Agree on preemption every N optimizer steps (an all-reduce of one int; `python launch/bench.py preemption` measures its cost).
PREEMPTION_CHECK_EVERY = 1


def fit(cfg: Config, env: DistEnv, plan: resume.ResumePlan | None,
        prepare_model: Callable[[nn.Module], dict[str, str]] | None = None) -> int:
    """Train `cfg` from `plan` (`resume.start`'s, made once at the command); the exit code."""
    return Trainer(cfg, env, plan, prepare_model).fit()


class Trainer:
    """One run in a process group joined and a run directory locked by `resume.start`: its config, run
    directory, objective, DeepSpeed engine and loaders, and the parts it checkpoints (`client_state`:
    pipeline/train/state.py). Built whole by the constructor, which also restores the plan's checkpoint
    (None: a fresh start) and leaves `step` where training continues."""

    def __init__(self, cfg: Config, env: DistEnv, plan: resume.ResumePlan | None,
                 prepare_model: Callable[[nn.Module], dict[str, str]] | None = None) -> None:
        info = read_data(cfg.data)  # a dataset.json at a URL is retried by data.retry_*, as shards are; data.sources merged
        cfg = resolve_pixels(cfg, info)  # model.in_chans and data.mean/std as the set's pixels need (docs/data.md)
        self.cfg, self.env, self.run_dir = cfg, env, Path(cfg.run.dir)
        self.objective = build_objective(cfg, info)  # what the recipe is (pipeline/objectives/)
        if cfg.adapt.init:  # --init: an anchor is stored in no checkpoint, a resume reads it from the source again
            self.objective.read_source = lambda module, what: reload_source(module, cfg, what)
        self.model_kwargs = kwargs = self.objective.model_kwargs()
        # The plan, before anything is built: a checkpoint of another model is refused before DeepSpeed
        # starts, another layout converted; the DeepSpeed config says how to load it.
        ds_config = resume.before_build(plan, cfg, env, self.objective.model_class, kwargs,
                                        deepspeed_config(cfg, env.world_size))
        if env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / "config.yaml")

        model = build_model(cfg, kwargs, ds_config, self.objective)
        tags = prepare_model(model) if prepare_model is not None else {}
        resume.check_same_decay_groups(plan, model)  # before DeepSpeed loads an optimizer state of other groups
        # The models that follow this one (a teacher, the model EMA): after the fine-tune source is loaded (they
        # start from it) and before DeepSpeed casts the model to bf16; float32, under ZeRO-3 partitioned alike.
        self.objective.build_companions(model, kwargs, float32_init(cfg, ds_config))
        self.ema = build_model_ema(cfg, model, lambda: self.objective.build_model(kwargs), ds_config)
        # optimizer: the client optimizer, whose param_groups DeepSpeed steps; groups: what each of them is
        depth = kwargs.get("depth", 0)  # the blocks train.layer_decay counts (a timm student has none said)
        self.engine, self.optimizer, self.groups = build_engine(cfg, model, depth, ds_config)
        if self.ema is not None:  # train.ema_decay: evaluated beside the model, exported in its place
            self.ema.to(self.engine.device)

        img_size = kwargs["img_size"]
        view = self.objective.train_view(kwargs)
        # The loader hands out micro batches; loader.accum of them (DeepSpeed's accumulation) make a step.
        self.train_loader = build_train_loader(
            view.data, img_size, cfg.train.micro_batch_size, seed=cfg.train.seed, rank=env.rank,
            world_size=env.world_size, info=info, global_batch_size=resolve_batch(cfg.train, env.world_size)[0],
            per_batch=view.per_batch, view=view.sample)
        # BatchNorm's running statistics (a CNN student's): one update per step from the global batch (step_norm.py)
        self.norm_stats = StepNormStats(self.engine.module, self.train_loader.accum, env.rank, env.world_size) \
            if batch_norms(self.engine.module) else None
        for line in schedule_warnings(cfg, info.splits[cfg.data.train_split].num_samples,
                                      self.train_loader.global_batch):
            say(line)
        # The objective's evaluation loaders: each batch is progress for the watchdog. A pretraining pile of
        # one split (no val) judged by eval.sets skips the objective's own evaluation, which reads val.
        self.own_eval = cfg.data.val_split in info.splits or not cfg.eval.sets
        if not self.own_eval:
            say(f"eval: {cfg.data.path or 'data.sources'} has no split '{cfg.data.val_split}' (it has: "
                f"{', '.join(sorted(info.splits))}): the objective's own evaluation is skipped, eval.sets "
                f"({', '.join(cfg.eval.sets)}) judge the run")
        self.eval_loaders = self.objective.build_eval(env, img_size, cfg.train.eval_batch_size or
                                                      cfg.train.micro_batch_size) if self.own_eval else []
        # eval.sets: labelled sets judged on the run's features at every evaluation (pipeline/eval/sets.py).
        self.eval_sets = EvalSets.build(cfg.eval, cfg.data, env, img_size,
                                        cfg.train.eval_batch_size or cfg.train.micro_batch_size)
        self.eval_loaders += self.eval_sets.loaders
        # What is trained, as the start line says it: a distillation's students (a timm name, a ViT's variant)
        # rather than the run's model.variant, which none of them may be (MLflow's model_variant tag).
        self.models = ", ".join(f"{m} ({k})" if k else m for k, m in self.objective.model_names().items())
        self.tracker = start_tracking(cfg, self.run_dir, env.is_main, env.world_size,
                                      tags={"model_variant": self.models, **tags})
        self.dtype = torch.bfloat16 if cfg.deepspeed.bf16 else torch.float32
        self.flops_per_image = self.objective.flops_per_image(kwargs)
        self.client_state = training_client_state(self.train_loader, self.objective, env, self.ema)
        self.watchdog: Watchdog | None = None  # started with the loop (fit)
        self.step = resume.restore(plan, cfg, self.engine, self.client_state, reapply_hparams=lambda: apply_hparams(
            self.optimizer.param_groups, self.groups, self.engine.lr_scheduler, cfg.train, depth))
        if env.is_main:  # data.sources: the mix in RUN_DIR/data_mix.jsonl, a changed one tagged in MLflow
            record_mix(self.run_dir, self.tracker, self.train_loader, self.step)

    # ------------------------------------------------------------------------- save and evaluate

    def save(self) -> str:
        """Collective checkpoint: DeepSpeed's engine + the client state's parts (data position, objective,
        every rank's RNG: pipeline/train/state.py) + what the tag is (trainer_state.json, written by rank 0)."""
        self.watchdog.beat("checkpoint save", self.step)
        client = self.client_state.state_dict()
        state = ckpt.TrainerState(step=self.step, world_size=self.env.world_size,
                                  model={k: resume.plain(v) for k, v in self.model_kwargs.items()},
                                  config=to_dict(self.cfg), no_weight_decay=exempt_names(self.engine.module))
        tag = ckpt.save_checkpoint(self.engine, self.run_dir, state, client, self.cfg.train.keep_last,
                                   self.cfg.train.keep_every, protect=lambda: mirror.protected(self.run_dir))
        if self.env.is_main:
            mirror.saved(self.run_dir, tag)  # run.remote: uploaded in the background (train/mirror.py)
        return tag

    def evaluate(self, step: int) -> EvalResult:
        """One evaluation (collective; rank 0 is given the run directory to write figures to). The rule, once:
        what judges the run's val split (the objective's own evaluation, and the model EMA's with
        train.ema_decay) runs where the run has that split or no eval.sets stand in for it (`own_eval`);
        eval.sets judge the run's features on their own sets whenever they are configured."""
        on_val = self.own_eval
        own = (self.objective.evaluate(self.engine, self.dtype, self.run_dir if self.env.is_main else None, step)
               if on_val else EvalResult({}, f"eval step {step}"))
        sets = self._judge_sets(step) if self.eval_sets else None
        ema = self.ema.evaluate(self.objective, step) if on_val and self.ema is not None else None
        metrics = {**own.metrics, **(sets.metrics if sets else {}), **(ema.metrics if ema else {})}
        return EvalResult(metrics, own.line + (f" | {sets.line}" if sets else "") + (f"\n{ema.line}" if ema else ""),
                          own.artifacts)

    def _judge_sets(self, step: int) -> EvalResult:
        """eval.sets on the features the objective names (Objective.judged_features); with --init, each figure
        also against the source's at step 0."""
        judged, line = self.eval_sets.judge(self.objective.judged_features(self.engine), self.engine.device)
        if self.cfg.adapt.init and self.env.is_main:
            judged = versus_init(judged, self.run_dir, step, self.cfg.adapt.warn_drop)
        return EvalResult(judged, line)

    def log_references(self, log: ProgressLog) -> None:
        """eval.sets on what the objective judges once at step 0 (a distillation's teacher), collective."""
        if self.eval_sets and (references := self.objective.reference_features(self.engine)):
            self.watchdog.beat("eval", 0)
            judged, line = self.eval_sets.judge(references, self.engine.device)
            self.tracker.log_metrics(judged, 0)
            log.line(f"eval step 0 | {line}")

    def log_evaluation(self, step: int, log: ProgressLog) -> None:
        """`evaluate` at `step` (collective), its metrics and files to MLflow, its line to the log."""
        self.watchdog.beat("eval", step)
        result = self.evaluate(step)
        self.tracker.log_metrics(result.metrics, step)
        for path, folder in result.artifacts:
            self.tracker.log_artifact(path, folder)
        log.line(result.line)

    # ------------------------------------------------------------------------- the loop

    def fit(self) -> int:
        """From the restored step to train.steps; the exit code."""
        env = self.env
        if env.is_main:  # world size, restarts and lost steps, before this start logs anything; each model's cost
            costs = {f"perf/{k}/flops_per_image": v for k, v in self.objective.model_flops(self.model_kwargs).items()}
            self.tracker.log_metrics({**start_metrics(self.run_dir, self.step, env.world_size), **costs}, self.step)
        preemption = Preemption(every=PREEMPTION_CHECK_EVERY)
        if preemption.should_stop():  # first safe point: a signal arrived during setup or the checkpoint load
            say(f"preempted during setup: nothing new to save (step {self.step}); exiting with "
                f"{int(ExitCode.PREEMPTED)} {after_exit()}")
            self.tracker.finish(status=None)
            return ExitCode.PREEMPTED
        # From here on a rank that stops making progress ends the job and says where (pipeline/train/watchdog.py).
        self.watchdog = Watchdog(self.cfg.dist.timeout_s, env.rank, self.run_dir,  # a storage wait is not a hang
                                 storage=StorageWaits.of_job(storage_beacon(self.cfg.data.cache_dir), env.world_size))
        for loader in self.eval_loaders:
            loader.progress = self.watchdog.touch  # each eval batch is progress
            loader.starting = functools.partial(self.watchdog.touch, starts_loader=True)  # its workers' start
        if self.train_loader.decoder is not None:  # data.decode_device: cuda: the next decode overlaps this step
            self.train_loader.decode_ahead_on = self.engine.device
        try:
            return self.train_loop(preemption)
        finally:
            self.watchdog.stop()

    def draw(self, data, meter: ThroughputMeter) -> tuple[Any, torch.Tensor, Any]:
        """The next micro batch on the engine's device: (images, targets, the view's per-batch extras)."""
        # a micro batch: progress; the first of a (re)started loader waits for its workers to start
        self.watchdog.beat("train step", self.step, starts_loader=self.train_loader.starting)
        t0 = time.perf_counter()
        images, targets = next(data)
        meter.add(len(targets), time.perf_counter() - t0)  # samples: a view makes `images` a tuple of crops
        # data.decode_device: the loader decodes on the device where asked
        images, targets = self.train_loader.to_device(images, targets, self.engine.device, self.dtype)
        # Extras (the train view's per_batch) were computed in the loader's workers with this micro batch.
        return images, targets, self.train_loader.last_per_batch

    def micro_batch_loss(self, data, meter: ThroughputMeter, guard: NonFiniteGuard | None,
                         drawn: tuple[Any, torch.Tensor, Any] | None = None) -> torch.Tensor:
        """The loss of the next micro batch (`drawn`, if the step drew it ahead) with a finite loss on every
        rank (forward only); a skipped one is replaced by a new draw."""
        while True:
            images, targets, extras = drawn if drawn is not None else self.draw(data, meter)
            drawn = None
            loss = self.objective.loss(self.engine, images, targets, extras)
            if guard is None or guard.finite(loss, self.step):
                return loss

    def optimizer_step(self, data, meter: ThroughputMeter, guard: NonFiniteGuard | NonFiniteWatch,
                       loss_sum: torch.Tensor) -> int:
        """One optimizer step: the objective's schedules, the step's micro batches (DeepSpeed steps the
        optimizer at the last one), the objective's and the model EMA's updates. The micro batches run."""
        engine, accum = self.engine, self.train_loader.accum
        self.objective.before_step(engine, self.step)  # schedules that write into the optimizer's groups
        if self.norm_stats is not None:
            self.norm_stats.before_step()
        # An objective whose targets normalise over the step's global batch (Sinkhorn-Knopp) sees all of this
        # rank's micro batches before the first forward; one micro batch per rank is the step already.
        drawn = [self.draw(data, meter) for _ in range(accum)] if accum > 1 and self.objective.step_targets() \
            else [None] * accum
        if drawn[0] is not None:
            self.objective.begin_step(engine, [d[0] for d in drawn])
        step_loss = torch.zeros((), device=loss_sum.device)
        for ahead in drawn:  # micro batches per rank per step: global batch / layout
            if self.norm_stats is not None:  # a replacement for a skipped micro batch shares its slot
                self.norm_stats.micro_batch()
            loss = self.micro_batch_loss(data, meter, guard if isinstance(guard, NonFiniteGuard) else None, ahead)
            backward_and_step(engine, loss)
            step_loss += loss.detach()
        loss_sum += step_loss
        if self.norm_stats is not None:
            self.norm_stats.after_step()
        if isinstance(guard, NonFiniteWatch):
            guard.after_step(engine, step_loss)
        self.objective.after_step(engine, self.step + 1)  # DeepSpeed stepped the optimizer at the last one
        if self.ema is not None:
            self.ema.update(self.step + 1)
        return accum

    def wait_for_mirror(self, group: Any) -> None:
        """The end of a run, a preempted stop: no rank exits before rank 0's run.remote uploads are done (a
        launcher ends the other ranks when one exits). Rounds of at most MIRROR_POLL_S and one all-reduce over
        the preemption's CPU group, every rank beating its watchdog: an upload longer than dist.timeout_s is
        not a hang."""
        while True:
            self.watchdog.beat("run.remote upload", self.step)
            busy = torch.tensor([0 if not self.env.is_main or mirror.drain(self.run_dir, MIRROR_POLL_S) else 1],
                                dtype=torch.int32)
            if group is not None:
                dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=group)
            if not busy.item():
                return

    def train_loop(self, preemption: Preemption) -> int:
        """From `step` to train.steps: the steps, evaluations, checkpoints, the preemption check, the export."""
        env, tc, loader = self.env, self.cfg.train, self.train_loader
        meter = ThroughputMeter(self.flops_per_image, env.world_size, device_peak_flops(tc.peak_flops))
        say(f"{self.cfg.run.kind}: {self.models} {self.model_kwargs['img_size']} | world size "
            f"{env.world_size} | global batch {loader.global_batch} ({loader.accum} x {tc.micro_batch_size} x "
            f"{env.world_size}) | ZeRO-{self.cfg.deepspeed.zero_stage} | steps {self.step}->{tc.steps} | run dir "
            f"{self.cfg.run.dir}")
        log = ProgressLog(env, self.step, tc.steps)
        start = self.step
        data = iter(loader)
        # train.check_finite: each micro batch's loss read before backward; else the steps watched on the device
        guard = NonFiniteGuard(tc.max_nonfinite_steps) if tc.check_finite else \
            NonFiniteWatch(tc.max_nonfinite_steps, self.engine.device)
        loss_sum = torch.zeros((), device=self.engine.device)  # summed on device; read only at log steps (no sync)
        micro_count = 0
        last_saved = self.step if self.step > 0 else -1  # a resumed run's checkpoint is the one at `step`
        saved_at = time.monotonic()  # train.ckpt_every_s counts from here and from each save
        if self.step == 0 and self.cfg.adapt.init and self.eval_sets:
            self.log_evaluation(0, log)  # --init: the source judged before it moves (docs/adapt.md)
        if self.step == 0:
            self.log_references(log)  # a distillation's teacher: the figures the run's read against

        while self.step < tc.steps:  # one optimizer step per iteration
            try:
                micro_count += self.optimizer_step(data, meter, guard, loss_sum)
            except NonFiniteLosses as e:
                return self.stop_nonfinite(e)
            self.step = step = self.step + 1
            # A micro batch skipped for a non-finite loss was replaced by the next one: realign the stream
            # so that every step keeps its own samples and the checkpoint's data position is exact.
            loader.seek_step(step)
            if isinstance(guard, NonFiniteGuard):
                guard.in_a_row = 0
            log.advance()

            if step % tc.log_every == 0 or step == tc.steps:
                metrics = self.window_metrics(loss_sum, micro_count, meter, guard)
                error = metrics.pop("error", None)  # the watch's limit: the figures logged, nothing saved
                loss_sum.zero_()
                micro_count = 0
                self.tracker.log_metrics(metrics, step)
                log.line(format_log(step, tc.steps, metrics))
                if error is not None:
                    return self.stop_nonfinite(error)
            if step == tc.steps and last_saved != step:
                # The last step's checkpoint before its evaluation: an evaluation that fails (a set that will
                # not read, a model the set cannot judge) loses no training; the next start evaluates it.
                self.save()
                last_saved = step
            if (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps:
                self.log_evaluation(step, log)
                meter.reset()  # eval time is not training throughput
            # train.ckpt_every_s: each rank's clock only proposes; the agreement makes every rank save one step.
            due = bool(tc.ckpt_every_s) and time.monotonic() - saved_at >= tc.ckpt_every_s
            stop, timed = preemption.check(step, due) if step < tc.steps else (False, False)
            if (tc.ckpt_every and step % tc.ckpt_every == 0 and step < tc.steps) or timed:
                self.save()
                last_saved, saved_at = step, time.monotonic()
                meter.reset()
            if stop:
                if last_saved != step:
                    self.save()
                self.wait_for_mirror(preemption.group)
                say(f"preempted: checkpoint at step {step} saved; exiting with {int(ExitCode.PREEMPTED)} "
                    f"{after_exit()}")
                self.tracker.finish(status=None)  # the requeued job continues this MLflow run
                return ExitCode.PREEMPTED

        if last_saved != self.step:
            self.save()
        if start == tc.steps and not (self.run_dir / "model.safetensors").is_file():
            # Resumed at the end without an export: the final evaluation failed (or the export did); run it.
            self.log_evaluation(self.step, log)
        self.finish(preemption.group)
        log.close()
        return 0

    def stop_nonfinite(self, e: NonFiniteLosses) -> int:
        good = ckpt.newest_complete_tag(self.run_dir)
        print(f"error: {e}; stopping without saving. Last good checkpoint: {good or 'none'} in "
              f"{ckpt.checkpoint_dir(self.run_dir)}", file=sys.stderr, flush=True)
        self.tracker.finish("FAILED")
        return ExitCode.NONFINITE

    def window_metrics(self, loss_sum: torch.Tensor, micro_count: int, meter: ThroughputMeter,
                       guard: NonFiniteGuard | NonFiniteWatch) -> dict[str, Any]:
        """The figures of one log line. Reads the device (one sync per log step, not per step): the loss sum,
        the objective's own figures (per-rank means) and the watch's counts in one all-reduce. With the
        watch's limit reached, the figures carry the NonFiniteLosses under "error"."""
        own = self.objective.train_metrics()
        watched = guard.counts if isinstance(guard, NonFiniteWatch) else torch.zeros(0)
        window = torch.cat([loss_sum.reshape(1), *(v.to(loss_sum.device, torch.float32).reshape(1)
                                                    for v in own.values()), watched.to(loss_sum.device)])
        if dist.is_initialized():
            dist.all_reduce(window)
        window = window.tolist()
        world = self.env.world_size
        error, nonfinite_total = None, float(getattr(guard, "total", 0))
        if isinstance(guard, NonFiniteWatch):  # the same on every rank: summed over them above
            try:
                nonfinite_total = guard.read([v / world for v in window[-3:]], self.step)
            except NonFiniteLosses as e:
                error, nonfinite_total = e, window[-3] / world
            window = window[:-3]
        # Grouped by prefix: MLflow's chart view groups and sorts by it (data/, eval/, perf/, train/).
        metrics = {"train/loss": window[0] / max(micro_count * world, 1),
                   **{f"train/{name}": v / world for name, v in zip(own, window[1:])},
                   "train/lr": peak_group_lr(self.optimizer.param_groups),
                   **{f"train/{k}": v for k, v in self.objective.lr_metrics(self.optimizer.param_groups).items()},
                   "train/nonfinite_skipped": nonfinite_total,
                   **{f"perf/{k}": v for k, v in meter.read().items()},
                   "data/bad_samples": float(sum(self.train_loader.bad_counts().values())),
                   **self.train_loader.source_metrics(),  # data.sources: data/<name>/... per source
                   **mirror.metrics(self.run_dir)}  # run.remote (rank 0): mirror/prunes_refused
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is not None:
            metrics["train/grad_norm"] = float(grad_norm)
        return metrics if error is None else {**metrics, "error": error}

    def finish(self, group: Any = None) -> None:
        """Export consolidated weights (collective), hand the artifacts to MLflow, end the run."""
        self.watchdog.beat("export", self.step)
        cfg, run_dir = self.cfg, self.run_dir
        # What the weights are: model.safetensors says its architecture (the exported model's ARCH_KEYS).
        metadata = {"variant": next(iter(self.objective.model_names().values())), "step": str(self.step),
                    **{k: str(v) for k, v in self.objective.exported_architecture(self.model_kwargs).items()}}
        if self.ema is not None:  # the EMA is the run's product; the checkpoints keep the raw weights
            say(f"export: model.safetensors holds the model EMA (train.ema_decay={cfg.train.ema_decay}); the "
                f"raw weights stay in {ckpt.checkpoint_dir(run_dir)}")
            state, metadata["ema_decay"] = self.ema.exported_weights(), str(cfg.train.ema_decay)
        else:
            state = self.objective.exported_weights(self.engine)  # a teacher, for DINOv2
        ckpt.export_weights(self.engine, run_dir / "model.safetensors", metadata=metadata, state=state)
        for rel, (state, own) in self.objective.extra_exports(self.engine).items():  # a distillation's students
            if self.env.is_main:
                (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            ckpt.export_weights(self.engine, run_dir / rel, metadata={"step": str(self.step), **own}, state=state)
        if self.env.is_main:  # the weights, and MLflow Models serving embeddings (config.yaml went at the start)
            log_exports(self.tracker, cfg, run_dir)
        self.tracker.finish("FINISHED")
        if self.env.is_main:
            mirror.final_files(run_dir)  # run.remote: config, metrics and weights, after every tag
        self.wait_for_mirror(group)  # every rank: retries included, the bucket catches up before the end
        mirror.raise_unless_up(run_dir, self.env.is_main, group)  # exit 1 on every rank, one line by rank 0
        say(f"done: {run_dir / 'model.safetensors'}")
