"""Parameter groups, optimizer and learning-rate schedule, all measured in optimizer steps."""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import nn

from pipeline.config import TrainConfig
from pipeline.zero3 import real_shape

# Hyperparameters a resumed run takes from its config, not from the checkpoint (see `apply_hparams`).
RESUMABLE_HPARAMS = ("lr", "min_lr", "weight_decay", "layer_decay", "betas", "momentum", "warmup_steps",
                     "schedule", "steps")


def no_weight_decay(model: nn.Module, name: str, param: torch.Tensor) -> bool:
    """Biases and 1-D parameters (norm weights) are never decayed, as in timm's `param_groups_weight_decay`;
    past those, the model says which (its `no_weight_decay()`, timm's convention)."""
    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
    return len(real_shape(param)) <= 1 or name.endswith(".bias") or name in skip


def exempt_names(model: nn.Module) -> list[str]:
    """The trainable parameters the model exempts from weight decay by name (its `no_weight_decay()`),
    sorted: what a checkpoint records of its parameter groups beyond the shape rule."""
    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
    return sorted(n for n, p in model.named_parameters() if p.requires_grad and n in skip)


def layer_id(name: str, matcher: dict[str, str], depth: int) -> int:
    """0 for the stem, i + 1 for block i, depth + 1 for the rest (the final norm, the head): BEiT numbering,
    from the model's `group_matcher()` (a stem pattern and a blocks pattern capturing the block index)."""
    if re.match(matcher["stem"], name):
        return 0
    block = re.match(matcher["blocks"], name)
    if block:
        return int(block.group(1)) + 1
    return depth + 1


def lr_scale(cfg: TrainConfig, layer: int, depth: int) -> float:
    return cfg.layer_decay ** (depth + 1 - layer) if cfg.layer_decay is not None else 1.0


def param_roles(model: nn.Module) -> tuple[dict[str, str], dict[str, float]]:
    """What the model says of parameters that a recipe treats apart (DINOv2's patch embedding and
    prototypes): its `param_roles()`, role -> regular expression over parameter names (the first role
    that matches wins), and its `lr_multipliers()`, role -> factor on the group's lr. A model with
    neither (the ViT, MAE) has no roles. A multiplier for a role the model does not declare is its bug."""
    roles = model.param_roles() if hasattr(model, "param_roles") else {}
    mults = model.lr_multipliers() if hasattr(model, "lr_multipliers") else {}
    unknown = sorted(set(mults) - set(roles))
    if unknown:
        raise ValueError(f"{type(model).__name__}.lr_multipliers() names role(s) {unknown} that its "
                         f"param_roles() does not declare ({sorted(roles)})")
    return roles, mults


def role_of(name: str, roles: dict[str, str]) -> str:
    """The first role whose pattern matches `name`; '' for none."""
    return next((role for role, pattern in roles.items() if re.match(pattern, name)), "")


def param_groups(model: nn.Module, cfg: TrainConfig, depth: int) -> list[dict[str, Any]]:
    """Groups keyed by (decay?, layer, role): weight decay where it belongs, and with `layer_decay` a
    learning rate scale of decay ** (depth + 1 - layer) so that early layers move less (BEiT/DeiT
    fine-tuning), times the model's multiplier for the parameter's role (`param_roles`; DINOv2's patch
    embedding x0.2). A role is a group of its own whatever its multiplier, so that the groups, and so a
    checkpoint's optimizer state, do not depend on the multiplier's value (it may change on resume), and
    an objective can find the group at each step (DINOv2's prototypes, at lr 0 while frozen).
    Each group carries `decay` and `layer` (and `role` and `lr_mult` where it has a role) so that a
    resumed run can re-derive its hyperparameters. Without roles the groups are what they were before
    roles existed: same keys, same order."""
    groups: dict[tuple[bool, int, str], dict[str, Any]] = {}
    if cfg.layer_decay is not None and not hasattr(model, "group_matcher"):
        raise ValueError(f"train.layer_decay is set but {type(model).__name__} has no group_matcher() "
                         "to say which layer each parameter is in")
    matcher = model.group_matcher() if cfg.layer_decay is not None else {}
    roles, mults = param_roles(model)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decay = not no_weight_decay(model, name, param)
        layer = layer_id(name, matcher, depth) if cfg.layer_decay is not None else 0
        role = role_of(name, roles)
        key = (decay, layer, role)
        if key not in groups:
            mult = mults.get(role, 1.0)
            scale = lr_scale(cfg, layer, depth) * mult
            groups[key] = {"params": [], "weight_decay": cfg.weight_decay if decay else 0.0, "lr_scale": scale,
                           "lr": cfg.lr * scale, "decay": decay, "layer": layer,
                           "name": f"{'decay' if decay else 'no_decay'}_layer{layer}" + (f"_{role}" if role else "")}
            if role:  # only here: a model without roles keeps its groups' keys as they were
                groups[key].update(role=role, lr_mult=mult)
        groups[key]["params"].append(param)
    return [groups[k] for k in sorted(groups)]


def build_optimizer(groups: list[dict[str, Any]], cfg: TrainConfig, offload: bool = False) -> torch.optim.Optimizer:
    """AdamW/Adam (decoupled weight decay: the paper's 'Adam with weight decay 0.1') or SGD with momentum.
    On a GPU the fused kernels are used: one launch for all parameters instead of one per tensor.
    With ZeRO-Offload (`offload`) the optimizer step runs on the CPU, and DeepSpeed accepts only its own
    vectorised CPU Adam there (DeepSpeedCPUAdam, built on first use); it is the same AdamW update."""
    opt_groups = [{k: v for k, v in g.items() if k != "name"} for g in groups]
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(opt_groups, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                                adamw_mode=True)
    fused = torch.cuda.is_available()
    if cfg.optimizer in ("adamw", "adam"):
        return torch.optim.AdamW(opt_groups, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused)
    return torch.optim.SGD(opt_groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                           fused=fused or None)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak lr at `step`: linear warmup from 0, then cosine/linear decay to min_lr."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    floor = cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1.0 - progress
    return floor + (1.0 - floor) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR (its state is saved with DeepSpeed checkpoints). Each group keeps its layer-decay scale
    because LambdaLR multiplies each group's initial lr, which already carries the scale."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))


def peak_group_lr(groups: list[dict[str, Any]]) -> float:
    """The current lr of a group with scale 1 (the head under layer decay): the schedule's own value.
    Group 0 is the most-decayed group under layer decay (0.65 ** 13 of the peak for B/16). Groups with a
    role are passed over: an objective may set theirs apart (DINOv2's frozen prototypes, lr 0)."""
    peak = [g["lr"] for g in groups if g.get("lr_scale", 1.0) == 1.0 and not g.get("role")]
    return peak[0] if peak else max(g["lr"] for g in groups)


def role_lr(groups: list[dict[str, Any]], role: str) -> float:
    """The current lr of a role's parameters: the largest of its groups' (lr_scale 1, the head's, under layer decay)."""
    return max(g["lr"] for g in groups if g.get("role") == role)


def apply_hparams(groups: list[dict[str, Any]], built: list[dict[str, Any]], scheduler: Any, cfg: TrainConfig,
                  depth: int) -> None:
    """Make a resumed optimizer and schedule follow `cfg`: a checkpoint restores every group's lr, weight
    decay and betas and the schedule's base lrs as they were saved (DeepSpeed's ZeRO-3 universal load even
    gives every group group 0's values); an override on resume must win. `built` are the groups as
    `param_groups` made them (same order), which say what each group is, its role's lr multiplier
    included (the model's, from this run's config). The schedule's position (last_epoch) is kept; the
    current lr is recomputed from it."""
    base_lrs = []
    for g, b in zip(groups, built, strict=True):
        mult = b.get("lr_mult", 1.0)
        g.update(decay=b["decay"], layer=b["layer"], lr_scale=lr_scale(cfg, b["layer"], depth) * mult)
        for key in ("role", "lr_mult"):  # a universal load may have copied group 0's role into every group
            if key in b:
                g[key] = b[key]
            else:
                g.pop(key, None)
        g["weight_decay"] = cfg.weight_decay if b["decay"] else 0.0
        if "betas" in g:
            g["betas"] = tuple(cfg.betas)
        if "momentum" in g:
            g["momentum"] = cfg.momentum
        g["initial_lr"] = cfg.lr * g["lr_scale"]
        base_lrs.append(g["initial_lr"])
    scheduler.base_lrs = base_lrs
    factor = lr_factor(scheduler.last_epoch, cfg)
    for g, base in zip(groups, base_lrs):
        g["lr"] = base * factor
