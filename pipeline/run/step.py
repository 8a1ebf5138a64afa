"""What the Trainer (trainer.py) builds and runs each step with, usable on its own: the model and the
DeepSpeed engine as the trainer builds them (benchmarks/engine.py times them), one micro batch's backward
and step, the agreement on a finite loss, and the progress lines.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from pipeline.config import Config
from pipeline.dist import DistEnv, say
from pipeline.objectives import OBJECTIVES
from pipeline.objectives.base import Objective
from pipeline.train import ds_step
from pipeline.train.optim import build_optimizer, build_scheduler, param_groups


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
    if not cfg.train.check_finite:  # no host read per step: non-finite gradients zeroed on the device
        ds_step.read_free_steps(engine)
    apart = model.clip_apart() if hasattr(model, "clip_apart") else ()
    if cfg.train.grad_clip > 0 and apart:  # each such role's norm clipped on its own (a distillation's students)
        ds_step.clip_apart(engine, [g.get("role", "") if g.get("role") in apart else "" for g in groups])
    if cfg.train.compile:
        engine.compile(compile_kwargs=compile_kwargs(cfg.train.compile_mode))
    return engine, optimizer, groups


def compile_kwargs(mode: str) -> dict[str, Any]:
    """torch.compile's arguments for train.compile_mode ('default' passes none: torch's own default)."""
    return {} if mode == "default" else {"mode": mode}


def backward_and_step(engine: Any, loss: torch.Tensor) -> None:
    """One micro batch's backward; DeepSpeed steps the optimizer (and the schedule) at the last micro
    batch of the step and only accumulates before it. benchmarks/engine.py times this very function."""
    engine.backward(loss)
    engine.step()


def all_finite(loss: torch.Tensor) -> bool:
    """Do all ranks have a finite loss? (They must agree: one rank skipping backward alone would hang.)"""
    bad = (~torch.isfinite(loss.detach())).float().reshape(1)
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() == 0


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


class NonFiniteWatch:
    """Without train.check_finite: the optimizer steps that were not finite, counted on the device (no host
    read) and read at log steps (`Trainer.window_metrics`). A step is not finite when its global gradient
    norm is not (DeepSpeed's: the same on every rank; the step zeroed its gradients, ds_step.read_free_steps)
    or, where DeepSpeed computed none, when its loss was not finite on some rank (an all-reduce, no read)."""

    def __init__(self, limit: int, device: torch.device) -> None:
        self.limit = limit
        self.counts = torch.zeros(3, device=device)  # steps in all, in a row now, most in a row since a read

    @torch.no_grad()
    def after_step(self, engine: Any, step_loss: torch.Tensor) -> None:
        norm = engine.get_global_grad_norm()
        if torch.is_tensor(norm):
            bad = ~torch.isfinite(norm.detach().float().to(self.counts.device))
        elif norm is not None:  # a float where DeepSpeed wrote one (its overflow path): known on the host
            bad = torch.tensor(not math.isfinite(float(norm)), device=self.counts.device)
        else:
            flag = (~torch.isfinite(step_loss.detach())).float().reshape(1).to(self.counts.device)
            if dist.is_initialized():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            bad = flag[0] > 0
        total, row, worst = self.counts.unbind()
        row = torch.where(bad, row + 1, 0.0)
        self.counts = torch.stack([total + bad.float(), row, torch.maximum(worst, row)])

    def read(self, counts: list[float], step: int) -> float:
        """`counts` as read at a log step: the total; NonFiniteLosses when the most in a row reached the limit."""
        total, _, worst = counts
        if worst >= self.limit:
            raise NonFiniteLosses(f"{worst:.0f} optimizer steps in a row with a non-finite gradient norm by step "
                                  f"{step} (train.check_finite=true skips non-finite micro batches instead)")
        self.counts[2] = self.counts[1]  # the most in a row since this read
        return total


def format_log(step: int, total: int, m: dict[str, float]) -> str:
    """One log line of a window's figures (Trainer.window_metrics)."""
    parts = [f"step {step}/{total}", f"loss {m['train/loss']:.4f}", f"lr {m['train/lr']:.3e}"]
    if "train/grad_norm" in m:
        parts.append(f"gnorm {m['train/grad_norm']:.3f}")
    parts.append(f"{m['perf/images_per_s']:,.0f} img/s")
    if "perf/mfu" in m:
        parts.append(f"mfu {100 * m['perf/mfu']:.1f}%")
    parts += [f"data {100 * m['perf/data_wait']:.0f}%", f"bad {m['data/bad_samples']:.0f}"]
    return " | ".join(parts)


class ProgressLog:
    """Rank 0's progress: a tqdm bar on an interactive terminal, plain lines in batch jobs (Slurm logs)."""

    def __init__(self, env: DistEnv, start: int, total: int) -> None:
        self.is_main = env.is_main
        self.bar = None
        if env.is_main and sys.stdout.isatty():
            from tqdm import tqdm  # only on a terminal: batch jobs never import it

            self.bar = tqdm(total=total, initial=start, dynamic_ncols=True, unit="step")

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def line(self, text: str) -> None:
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


FEW_BATCHES = 4  # a pass over the training set shorter than this many global batches is worth a warning


def schedule_warnings(cfg: Config, train_samples: int, global_batch: int) -> list[str]:
    """What in the schedule is legal but rarely meant, each as one line: a warm-up that never ends (the lr
    rises to the last step, never reaching train.lr: a recipe's 500-step warm-up on a 10-step try), and a
    global batch that is most of the training set (the paper's 512 on a folder of a few hundred images)."""
    tc, lines = cfg.train, []
    if tc.warmup_steps and tc.warmup_steps >= tc.steps:
        lines.append(f"warning: train.warmup_steps={tc.warmup_steps} >= train.steps={tc.steps}: the learning rate "
                     f"rises to the last step and never reaches train.lr={tc.lr}; set train.warmup_steps below "
                     f"train.steps (e.g. train.warmup_steps={max(1, tc.steps // 10)})")
    if 0 < train_samples < FEW_BATCHES * global_batch:
        lines.append(f"warning: train.global_batch_size={global_batch} against {train_samples} training samples: "
                     f"fewer than {FEW_BATCHES} steps per pass over the data, each step sees "
                     f"{min(100, round(100 * global_batch / train_samples))}% of it; set train.global_batch_size "
                     f"to a fraction of the set (e.g. train.global_batch_size={_fraction(train_samples)} with "
                     f"train.micro_batch_size dividing it)")
    return lines


def _fraction(samples: int) -> int:
    """A power of two at most an eighth of `samples` (at least 1): a batch size a user can take as it is."""
    return 1 << max(0, (samples // 8).bit_length() - 1)
