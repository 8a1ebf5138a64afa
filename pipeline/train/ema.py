"""Exponential moving averages of a model's weights: one machinery for the DINOv2 teacher and for the
model EMA any other objective can keep (`train.ema_decay`).

`Ema` keeps a second module of the model's structure, the shadow, and moves it toward the model parameter by
parameter: shadow = decay x shadow + (1 - decay) x model. Under ZeRO-3 the shadow is built under
deepspeed.zero.Init as the model is, so each rank holds the same slices of both (`zero3.local_tensor`)
and the update runs on those slices alone, without communication; evaluating, saving and loading gather it
(collectively). Its saved state is the full fp32 tensors, which any world size loads.

Two users, each with its reference's arithmetic (the two round differently in the last bit):

- the DINOv2 teacher (pipeline/objectives/dino/objective.py), `Ema(teacher, "scale_add")`: Meta's
  teacher x m + student x (1 - m) (`_foreach_mul_` then `_foreach_add_` in dinov2's ssl_meta_arch.py),
  parameters only;
- `ModelEma` (`train.ema_decay`), `Ema(shadow, "lerp")`: timm's ModelEmaV3 (timm/utils/model_ema.py):
  shadow.lerp_(model, 1 - decay), floating buffers averaged too and the others copied, the decay of each
  step from `timm_decay` (first step, warm-up, minimum). Equal to timm's, step by step (tests/unit/test_ema.py).

`ModelEma` is one of the trainer's stateful parts (pipeline/train/state.py). The trainer updates it after
each optimizer step, evaluates it beside the model at every evaluation (the objective's own evaluation, its
metrics named with an `_ema` suffix) and exports it to model.safetensors in place of the raw weights, which
the checkpoints keep. The shadow is float32 whatever the model's dtype: in bf16 an update of (1 - decay) x
the difference is far below the resolution at decays near 1 and rounds away (timm's note on low precision).
It averages the weights the forward uses (bf16 under deepspeed.bf16), as the teacher does, not the
optimizer's fp32 master copy: ZeRO-1/2 hold that in flat per-rank partitions, which no parameter maps onto.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal, Protocol

import deepspeed
import torch
from torch import nn

from pipeline import zero3
from pipeline.config import Config, TrainConfig
from pipeline.dist import say
from pipeline.train import ds_compat
from pipeline.train.checkpoint import fp32_state_dict, persistent_buffers

Arithmetic = Literal["lerp", "scale_add"]


class Ema:
    """`shadow`, kept as an exponential moving average of a model of the same structure.

    `arithmetic`: "lerp" (timm's) or "scale_add" (Meta's); `buffers`: average the model's floating buffers
    too (and copy its others), as timm does, or leave them alone, as Meta's teacher does."""

    def __init__(self, shadow: nn.Module, arithmetic: Arithmetic, buffers: bool) -> None:
        self.shadow, self.arithmetic, self.buffers = shadow, arithmetic, buffers

    @torch.no_grad()
    def update(self, model: nn.Module, decay: float) -> None:
        """shadow = decay x shadow + (1 - decay) x model, on this rank's partitions; decay 0 copies."""
        pairs = [(zero3.local_tensor(s), zero3.local_tensor(m))
                 for s, m in zip(self.shadow.parameters(), model.parameters(), strict=True)]
        if self.buffers:  # never partitioned, even at ZeRO-3: every rank holds them whole
            # The buffers the state dict holds (timm's EMA walks the state dict).
            for (_, s), (_, m) in zip(persistent_buffers(self.shadow), persistent_buffers(model), strict=True):
                if s.is_floating_point():
                    pairs.append((s, m))
                else:
                    s.copy_(m)  # counters (BatchNorm's num_batches_tracked), as timm
        if decay == 0.0:  # what both formulas give (lerp's weight 1 returns the end point), without rounding
            for dst, src in pairs:
                dst.copy_(src)
        elif self.arithmetic == "lerp":
            # The model's values in the shadow's dtype and device, then one foreach lerp: timm's foreach path.
            srcs = [src.to(device=dst.device, dtype=dst.dtype) for dst, src in pairs]
            torch._foreach_lerp_([dst for dst, _ in pairs], srcs, 1.0 - decay)
        else:
            # Tensor by tensor, as the teacher always was: its runs stay bit-identical to those before.
            for dst, src in pairs:
                dst.mul_(decay).add_(src.to(device=dst.device, dtype=dst.dtype), alpha=1.0 - decay)

    def to(self, device: torch.device) -> None:
        """The shadow onto `device`; a ZeRO-3 partitioned one is there already (its slices live on the device)."""
        if not any(zero3.is_partitioned(p) for p in self.shadow.parameters()):
            self.shadow.to(device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The shadow's whole state dict on the CPU, floating tensors as fp32 (collective under ZeRO-3)."""
        with ds_compat.gathered(self.shadow):
            return {k: (v.float() if v.is_floating_point() else v).detach().cpu().clone()
                    for k, v in self.shadow.state_dict().items()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what `state_dict` returned, on any world size and ZeRO stage (collective under ZeRO-3)."""
        own = dict(self.shadow.named_parameters()) | dict(persistent_buffers(self.shadow))
        if own.keys() != state.keys():
            missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
            raise ValueError(f"the saved moving average is of another model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        with ds_compat.gathered(self.shadow, modifier_rank=0):  # every rank holds the same full tensors
            for name, value in state.items():
                own[name].data.copy_(value.to(own[name].dtype))


def timm_decay(step: int, tc: TrainConfig) -> float:
    """The decay of the update after optimizer step `step` (1 for the first): timm's ModelEmaV3.get_decay.
    0 (a copy) through step ema_update_after_step + 1; then ema_decay, or with ema_warmup
    1 - (1 + t / gamma) ** -power for t steps after that, within [ema_min_decay, ema_decay]."""
    step = max(0, step - tc.ema_update_after_step - 1)
    if step <= 0:
        return 0.0
    if not tc.ema_warmup:
        return tc.ema_decay
    decay = 1 - (1 + step / tc.ema_warmup_gamma) ** -tc.ema_warmup_power
    return max(min(decay, tc.ema_decay), tc.ema_min_decay)


class _EmaForward:
    """What an objective's `evaluate` asks of the DeepSpeed engine (`device`, `module`, a forward, eval() and
    train()), for the shadow. eval() and train() do nothing: the shadow is never trained, always in eval mode."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.module, self.device = module, device

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def eval(self) -> _EmaForward:
        return self

    def train(self, mode: bool = True) -> _EmaForward:  # noqa: ARG002 - nn.Module.train's signature
        return self


class Evaluates(Protocol):
    """What `ModelEma.evaluate` asks of an objective (pipeline.objectives.base.Objective): its evaluation of
    an engine, whose result is a dataclass with `metrics`, `line` and `artifacts` (EvalResult)."""

    def evaluate(self, engine: Any, dtype: torch.dtype, run_dir: Any, step: int) -> Any: ...


class ModelEma:
    """`train.ema_decay`: the model EMA, a stateful part of the trainer (see the module doc). `model` is the
    module DeepSpeed trains (the engine's), `shadow` a float32 module of its structure (`build_model_ema`)."""

    def __init__(self, model: nn.Module, shadow: nn.Module, tc: TrainConfig) -> None:
        self.model, self.tc = model, tc
        shadow.requires_grad_(False)
        shadow.eval()
        self.ema = Ema(shadow, "lerp", buffers=True)
        self.device = zero3.local_tensor(next(shadow.parameters())).device
        self.ema.update(model, 0.0)  # the model as it starts (timm's deepcopy at construction)

    @property
    def shadow(self) -> nn.Module:
        return self.ema.shadow

    def to(self, device: torch.device) -> None:
        """Where the evaluation runs (the engine's device); a partitioned shadow is on it already."""
        self.device = device
        self.ema.to(device)

    def update(self, step: int) -> None:
        """After optimizer step `step` (1 for the first)."""
        self.ema.update(self.model, timm_decay(step, self.tc))

    @torch.no_grad()
    def evaluate(self, objective: Evaluates, step: int) -> Any:
        """The objective's own evaluation of the shadow (collective), in its float32, without figures; the
        metrics under the model's names with `_ema` appended (eval/top1 -> eval/top1_ema)."""
        with ds_compat.gathered(self.shadow):
            result = objective.evaluate(_EmaForward(self.shadow, self.device), torch.float32, None, step)
        head, _, rest = result.line.partition(" | ")  # "eval step N | loss ..." -> "eval step N | EMA | loss ..."
        return dataclasses.replace(result, metrics={f"{k}_ema": v for k, v in result.metrics.items()},
                                   line=f"{head} | EMA" + (f" | {rest}" if rest else ""), artifacts=[])

    def exported_weights(self) -> dict[str, torch.Tensor]:
        """The shadow as model.safetensors holds weights (as `checkpoint.full_fp32_state_dict`; collective)."""
        with ds_compat.gathered(self.shadow):
            return fp32_state_dict(self.shadow)

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.ema.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:  # a tag written without train.ema_decay (the part is optional): start from the model
            say("note: the checkpoint holds no model EMA (train.ema_decay was not set when it was written): the "
                "EMA starts from the resumed weights")
            self.ema.update(self.model, 0.0)
            return
        self.ema.load_state_dict(state["weights"])


def float32_init(cfg: Config, ds_config: dict[str, Any]) -> Callable[[], AbstractContextManager[Any]]:
    """The context a model that follows the trained one (an EMA shadow, a teacher) is built in: under ZeRO-3
    deepspeed.zero.Init with bf16 and fp16 off, so its parameters are float32 and partitioned as the trained
    model's (each rank holds the same slices of both); otherwise nothing (a module is built in float32, and
    DeepSpeed casts only the module it wraps)."""
    if cfg.deepspeed.zero_stage != 3:
        return nullcontext
    # zero.Init takes the parameters' dtype from the config's bf16/fp16 sections: both off is float32.
    fp32 = {**ds_config, "bf16": {"enabled": False}, "fp16": {"enabled": False}}
    return lambda: deepspeed.zero.Init(config_dict_or_path=fp32)


def build_model_ema(cfg: Config, model: nn.Module, rebuild: Callable[[], nn.Module],
                    ds_config: dict[str, Any]) -> ModelEma | None:
    """The model EMA of `model` (after any fine-tune source was loaded into it), or None without
    train.ema_decay. At ZeRO 0-2 its shadow is a float32 copy of `model`; at ZeRO-3 `rebuild()` builds one of
    the same structure in `float32_init` (float32, partitioned as `model` is)."""
    if cfg.train.ema_decay is None:
        return None
    if cfg.deepspeed.zero_stage != 3:
        return ModelEma(model, copy.deepcopy(model).float(), cfg.train)
    # The shadow's initial values are overwritten by the model's; forking the RNG leaves the model's
    # dropout draws those of a run without EMA.
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices), float32_init(cfg, ds_config)():
        shadow = rebuild()
    return ModelEma(model, shadow, cfg.train)
