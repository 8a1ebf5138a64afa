"""A DINOv3 stage that continues a finished run (dinov3.continue_from, `launch/pretrain.py --from RUN_DIR`): Meta's
Gram-anchoring and high-resolution stages start from the previous stage's student, EMA teacher, Gram teacher and
loss centres, with their own optimizer, schedules and crops. Not a fine-tune (no head is replaced, nothing
resized: RoPE takes the new crop sizes as they come) and not a resume (this run starts at step 0 in its own run
directory).

What is read: the source's newest complete checkpoint, on any ZeRO stage and world size: its student (DeepSpeed's
module, consolidated to fp32) and its objective's client state (teacher, Gram teacher, centres), the files
read with `weights_only=True`. The architecture must be the source's (its recorded model arguments, compared as
a resume compares them, model.img_size aside); anything else may change. A source that cannot be used is a
WeightsError: one line and exit 1, as in every launcher (pipeline/errors.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.dist import say
from pipeline.model.layers import init_param
from pipeline.model.vit import architecture
from pipeline.model.weights import WeightsError
from pipeline.train import checkpoint as ckpt


def source_checkpoint(source: str, model_class: type[nn.Module], model_kwargs: dict[str, Any]) -> tuple[Path, str]:
    """The source run directory and its newest complete tag, checked to hold a model of this architecture."""
    run_dir = Path(source).expanduser()
    tag = ckpt.newest_complete_tag(run_dir) if run_dir.is_dir() else None
    if tag is None:
        raise WeightsError(f"dinov3.continue_from={source}: not a run directory with a complete checkpoint "
                          f"(checkpoints/<tag>/ with its completion mark)")
    saved = ckpt.TrainerState.read(ckpt.checkpoint_dir(run_dir) / tag)
    objective = saved.config.get("model", {}).get("objective")
    if objective != "dinov3":
        raise WeightsError(f"dinov3.continue_from={source}: its checkpoint {tag} is of a model.objective={objective} "
                          f"run; a DINOv3 stage continues a dinov3 run (fine-tune others: launch/finetune.py --from)")
    was, now = architecture(model_class, saved.model), architecture(model_class, model_kwargs)
    # Compared as they read back from JSON (a recorded tuple is a list). Not img_size: the RoPE backbone has no
    # position table, and the high-resolution stage trains at other sizes than the stage it continues.
    diff = [f"{k}: {was[k]} there, {now[k]} here" for k in model_class.ARCH_KEYS
            if k != "img_size" and json.dumps(was[k]) != json.dumps(now[k])]
    if diff:
        raise WeightsError(f"dinov3.continue_from={source}: another model ({'; '.join(diff)}); a later stage keeps "
                          f"the architecture")
    return run_dir, tag


def _copier(value: torch.Tensor) -> Callable[[torch.Tensor], object]:
    return lambda target: target.copy_(value.to(target.dtype))


@torch.no_grad()
def load_student(model: nn.Module, run_dir: Path, tag: str) -> None:
    """The source's student into `model` (built, not yet wrapped by DeepSpeed; ZeRO-3 partitioned or not)."""
    state = ckpt.consolidate(run_dir, tag)
    params = dict(model.named_parameters())
    if state.keys() != params.keys():
        missing, unexpected = sorted(params.keys() - state.keys()), sorted(state.keys() - params.keys())
        raise WeightsError(f"dinov3.continue_from={run_dir}: its student has other parameters (missing "
                          f"{missing[:3]}, unexpected {unexpected[:3]})")
    for name, param in params.items():
        init_param(param, _copier(state[name]))  # gathered and re-partitioned under ZeRO-3


def objective_state(run_dir: Path, tag: str) -> dict[str, Any]:
    state = ckpt.read_client_state(run_dir, tag).get("objective") or {}
    if "teacher" not in state:
        raise WeightsError(f"dinov3.continue_from={run_dir}: checkpoint {tag} holds no DINOv3 teacher")
    return state


def starts_here(run_dir: Path) -> bool:
    """Whether this start of `run_dir` is its first (no complete checkpoint: nothing to resume), the one a
    continuation loads its source at; a restart resumes its own checkpoint, which holds what the source gave."""
    if ckpt.newest_complete_tag(run_dir) is None:
        return True
    say(f"dinov3.continue_from: {run_dir} has a checkpoint; resuming it, the source is not read again")
    return False
