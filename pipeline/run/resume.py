"""Start or resume a run: what is decided, and what is restored, in this order.

At the command, once (`start`, called by `pipeline.commands.run`; rank 0 decides, every rank learns):
  1. Join the process group, then lock the run directory (rank 0, `lock`: `pipeline.train.lock`): a
     second job on it stops here, before it has written anything. A lock left by a dead job is gone
     with its process: a requeue takes it. With run.remote, the bucket's lock too, and a newer tag in
     the bucket is restored into RUN_DIR/checkpoints first (train/mirror.py).
  2. Find the checkpoint (`plan`): the newest tag of RUN_DIR/checkpoints that is complete (complete.json
     written after every rank wrote, each file it lists present at its recorded size: `ckpt.check_tag`)
     and whose trainer_state.json reads. Each newer tag skipped is named, with why. `latest` is never read.
  3. No complete tag: a fresh start (the plan is None); but a checkpoints/ folder holding tags none of
     which is usable is refused (the first save would prune them).
  4. Refuse a checkpoint of another optimizer (train.optimizer, layer decay switched on or off): its
     state cannot be carried over.
  5. Choose how to load: same world size and ZeRO stage (or ZeRO-0 on both sides) loads the tag as
     written, bit-exact; another layout of ZeRO 1-3 goes through DeepSpeed's universal format.
The plan is the one answer to "is this a restart?": the fine-tune (`pipeline.run.finetune`) loads no
source weights when it is not None (the checkpoint has them; the source may have moved since), and the
trainer resumes it.
Once the model's shape is known, before DeepSpeed starts (`before_build`):
  6. Refuse a checkpoint of another model (the architecture keys its class declares, ARCH_KEYS), naming
     what differs.
  7. Another layout: rank 0 converts the tag to DeepSpeed's universal format, which every rank loads.
Once the model is built, before the engine (`check_same_decay_groups`): refuse a checkpoint whose
optimizer state belongs to other weight-decay groups than the model's `no_weight_decay()`.
After the engine is built (`restore`, every rank):
  8. Model, optimizer and schedule from DeepSpeed's files. If DeepSpeed cannot load a tag that passed
     step 2, its traceback goes to RUN_DIR/errors/ and the next older complete tag of the same layout is
     tried, named in the log.
  9. The hyperparameters the config changed (`optim.RESUMABLE_HPARAMS`) replace the checkpoint's, named.
 10. The client state's parts (pipeline/train/state.py), in order: the data position (layout-free: the
     same samples follow on any world size), the objective's state (a teacher, centers), and
 11. every rank's RNG, on the same world size (on another: the same samples, other dropout draws).
 12. The MLflow run: `pipeline.tracking` continues the run named in RUN_DIR/mlflow_sync.json.
A fine-tune's source is decided once, at its first start, and recorded in RUN_DIR/config.yaml; a restart
reads it from there (`pipeline.commands.recorded_finetune_source`, before the process group exists: it
chooses the config, which this plan needs) and, resuming, loads no source weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from pipeline.config import Config, to_dict
from pipeline.dist import DistEnv, init_distributed, say
from pipeline.model.vit import architecture
from pipeline.signals import exit_at_once_on_signal
from pipeline.train import checkpoint as ckpt
from pipeline.train import ds_compat, mirror
from pipeline.train.ds_compat import DeepSpeedFailed, UnsafeCheckpoint
from pipeline.train.lock import RunDirLocked, lock_run_dir
from pipeline.train.optim import RESUMABLE_HPARAMS, exempt_names
from pipeline.train.state import ClientState
from pipeline.train.storage_wait import storage_wait_s
from pipeline.train.watchdog import process_group_timeout_s


class TrainError(RuntimeError):
    """A condition the user must act on (wrong checkpoint, diverged run); the message says what."""


@dataclass
class ResumePlan:
    """What a restart loads: a tag of RUN_DIR/checkpoints, or its universal conversion (other layout)."""

    tag: str
    state: ckpt.TrainerState
    root: Path  # RUN_DIR/checkpoints, or RUN_DIR/universal when the layout changed
    universal: bool
    fallbacks: list[str]  # older complete tags of the same layout, newest first (step 8)
    layout_change: str = ""  # what differs from the tag's layout, when universal (step 7 says it)


def _on_rank0(env: DistEnv, fn) -> Any:
    """fn() on rank 0; its result, or the TrainError/RunDirLocked it raised, on every rank."""
    result: Any = None
    if env.is_main:
        try:
            result = fn()
        except (TrainError, RunDirLocked) as e:
            result = e
    if dist.is_initialized() and env.world_size > 1:
        box = [result]
        dist.broadcast_object_list(box, src=0)
        result = box[0]
    if isinstance(result, (TrainError, RunDirLocked)):
        raise result
    return result


# ----------------------------------------------------------------------------- 1-5: at the command


def start(cfg: Config) -> tuple[DistEnv, ResumePlan | None]:
    """Steps 1-5 in every process: join the process group, lock RUN_DIR (rank 0), plan. The one place a
    run decides whether it starts or resumes; the caller hands the plan to the fine-tune and the trainer."""
    with exit_at_once_on_signal("joining the process group"):  # nothing to save yet: a signal ends it here
        # A collective waits out what the watchdog allows: dist.timeout_s past a storage wait (watchdog.py).
        env = init_distributed(process_group_timeout_s(cfg.dist.timeout_s, storage_wait_s(cfg.data)))
    lock(cfg, env)  # before anything is written: a second job on this run.dir stops here
    return env, plan(cfg, env)


def lock(cfg: Config, env: DistEnv) -> None:
    """Step 1 (rank 0; its refusal raised on every rank): lock RUN_DIR, and with run.remote the bucket's
    run lock, restoring a newer tag from the bucket into RUN_DIR/checkpoints (train/mirror.py)."""
    run_dir = Path(cfg.run.dir)

    def take() -> None:
        lock_run_dir(run_dir)
        try:
            mirror.start(cfg, run_dir)
        except mirror.RemoteError as e:
            raise TrainError(str(e)) from None

    _on_rank0(env, take)


def plan(cfg: Config, env: DistEnv) -> ResumePlan | None:
    """Steps 2-5, after `lock`: the tag to resume and how to load it; None for a fresh start. Nothing
    here needs the model: a fine-tune's architecture depends on the answer."""
    run_dir = Path(cfg.run.dir)
    usable, skipped = _on_rank0(env, lambda: find_complete(run_dir))  # 2
    for line in skipped:
        say(f"resume: skipping {line}")
    if not usable:  # 3
        if skipped:
            raise TrainError(f"{ckpt.checkpoint_dir(run_dir)} holds checkpoints but none is complete ("
                             + "; ".join(skipped) + "): starting from step 0 here would delete them. Move them "
                             "away (or restore the missing files) and start again, or use a new run.dir.")
        return None
    tag = usable[0]
    state = ckpt.TrainerState.read(ckpt.checkpoint_dir(run_dir) / tag)
    check_resumable_hparams(state, cfg, ckpt.checkpoint_dir(run_dir) / tag)  # 4
    same = [t for t in usable[1:] if _layout(ckpt.TrainerState.read(ckpt.checkpoint_dir(run_dir) / t))
            == _layout(state)]
    stage = cfg.deepspeed.zero_stage  # 5
    if (state.world_size == env.world_size and state.zero_stage == stage) or (state.zero_stage == 0 == stage):
        # Without ZeRO every rank holds the whole optimizer state: DeepSpeed loads it on any world size.
        return ResumePlan(tag, state, ckpt.checkpoint_dir(run_dir), universal=False, fallbacks=same)
    if 0 in (state.zero_stage, stage):
        raise TrainError(f"{ckpt.checkpoint_dir(run_dir) / tag} was written at ZeRO-{state.zero_stage} on "
                         f"{state.world_size} ranks; this job runs ZeRO-{stage} on {env.world_size}. DeepSpeed "
                         f"converts between layouts only for ZeRO 1-3: resume with "
                         f"deepspeed.zero_stage={state.zero_stage}, or start a new run.dir.")
    why = "; ".join(x for x in (
        f"world size {state.world_size} -> {env.world_size}" if state.world_size != env.world_size else "",
        f"ZeRO-{state.zero_stage} -> ZeRO-{stage}" if state.zero_stage != stage else "") if x)
    return ResumePlan(tag, state, ckpt.universal_dir(run_dir), universal=True, fallbacks=[], layout_change=why)


def before_build(p: ResumePlan | None, cfg: Config, env: DistEnv, model_class: type[nn.Module],
                 model_kwargs: dict[str, Any], ds_config: dict[str, Any]) -> dict[str, Any]:
    """Steps 6-7, once the model's shape is known and before DeepSpeed starts: refuse a checkpoint of
    another model, then (another layout) convert the tag to the universal format on rank 0. Returns the
    DeepSpeed config to build the engine with: `ds_config`, told to load the universal format when the
    layout changed."""
    if p is None:
        return ds_config
    run_dir = Path(cfg.run.dir)
    check_same_model(p.state, model_class, model_kwargs, ckpt.checkpoint_dir(run_dir) / p.tag)  # 6
    if not p.universal:
        return ds_config
    _on_rank0(env, lambda: convert(run_dir, p.tag, p.state, p.layout_change))  # 7: after 6, not worth it before
    return {**ds_config, "checkpoint": {"load_universal": True}}


def find_complete(run_dir: Path) -> tuple[list[str], list[str]]:
    """(usable tags newest first, "TAG: why not" for each tag newer than the newest usable one)."""
    usable, skipped = [], []
    for tag in ckpt.all_tags(run_dir):
        tag_dir = ckpt.checkpoint_dir(run_dir) / tag
        why = ckpt.check_tag(tag_dir)
        if why is None:
            try:
                ckpt.TrainerState.read(tag_dir)
            except ckpt.CheckpointError as e:
                why = str(e)
        if why is None:
            usable.append(tag)
        elif not usable:
            skipped.append(f"{tag_dir}: {why}")
    return usable, skipped


def _layout(state: ckpt.TrainerState) -> tuple[int, int]:
    return state.world_size, state.zero_stage


def check_same_model(state: ckpt.TrainerState, model_class: type[nn.Module], model_kwargs: dict[str, Any],
                     tag_dir: Path) -> None:
    """Refuse a checkpoint whose model differs in an architecture key the model declares (`ARCH_KEYS`: the
    weights' names and shapes), each compared as built (a key not recorded: the constructor's default)."""
    saved, now = architecture(model_class, state.model), architecture(model_class, model_kwargs)
    diff = [f"{k}: {saved[k]} (checkpoint) vs {plain(now[k])} (config)"
            for k in model_class.ARCH_KEYS if plain(saved[k]) != plain(now[k])]
    if diff:
        raise TrainError(f"{tag_dir} was trained with a different model; refusing to resume: " + "; ".join(diff)
                         + ". Use a new run.dir or the matching config.")


# What every model exempted from weight decay before models said so themselves (see TrainerState).
LEGACY_NO_WEIGHT_DECAY = ("cls_token", "pos_embed")


def check_same_decay_groups(p: ResumePlan | None, model: nn.Module) -> None:
    """Refuse, in one line, a checkpoint whose optimizer state belongs to other parameter groups than
    this model's (a pre-change MAE run decayed no class token; official MAE, and this trainer, do)."""
    if p is None:
        return
    now = exempt_names(model)
    trainable = {n for n, q in model.named_parameters() if q.requires_grad}
    saved = p.state.no_weight_decay
    if saved is None:
        saved = sorted(n for n in LEGACY_NO_WEIGHT_DECAY if n in trainable)
    if sorted(saved) != now:
        path = ckpt.checkpoint_dir(p.root.parent) / p.tag / ckpt.STATE_FILE  # root: checkpoints/ or universal/
        raise TrainError(f"{path}: its optimizer state was saved with no weight decay on "
                         f"{', '.join(saved) or 'nothing'} beyond biases and norms; this model exempts "
                         f"{', '.join(now) or 'nothing'} (its no_weight_decay()), so the parameter groups differ "
                         "and the optimizer state cannot be loaded. Start a new run.dir (or fine-tune from "
                         "its model.safetensors).")


def check_resumable_hparams(state: ckpt.TrainerState, cfg: Config, tag_dir: Path) -> None:
    """What a resumed optimizer cannot follow is refused: another optimizer, or layer decay switched on
    or off (the parameter groups, and so the saved optimizer state, differ)."""
    saved = state.config["train"]
    if saved["optimizer"] != cfg.train.optimizer:
        raise TrainError(f"{tag_dir} was trained with train.optimizer={saved['optimizer']}, the config says "
                         f"{cfg.train.optimizer}: its optimizer state cannot be carried over. Resume with "
                         f"train.optimizer={saved['optimizer']} or start a new run.dir.")
    if (saved["layer_decay"] is None) != (cfg.train.layer_decay is None):
        raise TrainError(f"{tag_dir} was trained with train.layer_decay={_yaml(saved['layer_decay'])}, the "
                         f"config says {_yaml(cfg.train.layer_decay)}: switching layer decay on or off changes the "
                         f"parameter groups of the saved optimizer. Resume with train.layer_decay="
                         f"{_yaml(saved['layer_decay'])} or start a new run.dir.")


def convert(run_dir: Path, tag: str, state: ckpt.TrainerState, why: str) -> None:
    """Rank 0: the tag to a universal checkpoint (DeepSpeed's converter; its traceback to RUN_DIR/errors/)."""
    t0 = time.perf_counter()
    try:
        out = ckpt.convert_to_universal(run_dir, tag)
    except UnsafeCheckpoint as e:
        raise TrainError(f"{ckpt.checkpoint_dir(run_dir) / tag} is not resumed: {e}") from None
    except DeepSpeedFailed as e:
        raise TrainError(f"{ckpt.checkpoint_dir(run_dir) / tag}: DeepSpeed could not convert it to its universal "
                         f"format for the new layout ({why}): {e.first_line} (traceback: {e.traceback_file}). "
                         f"Resume with {state.world_size} ranks and deepspeed.zero_stage={state.zero_stage}, or "
                         f"start a new run.dir.") from None
    say(f"resume: layout changed ({why}): converted {ckpt.checkpoint_dir(run_dir) / tag} to a universal "
        f"checkpoint in {out} ({time.perf_counter() - t0:.1f} s); model and optimizer state are "
        f"re-partitioned from it")


# ----------------------------------------------------------------------------- 8-11: into the engine


def restore(p: ResumePlan | None, cfg: Config, engine: Any, client_state: ClientState,
            reapply_hparams: Callable[[], None]) -> int:
    """Load the planned checkpoint into the built engine (DeepSpeed's files) and the client state's parts
    (pipeline/train/state.py); return the step to continue from. `reapply_hparams` puts the config's lr,
    weight decay and schedule on the resumed optimizer."""
    if p is None:
        return 0
    run_dir = Path(cfg.run.dir)
    client, state, tag, failure = None, p.state, p.tag, None
    for tag in [p.tag, *p.fallbacks]:  # 8
        state = ckpt.TrainerState.read(ckpt.checkpoint_dir(run_dir) / tag) if tag != p.tag else p.state
        try:
            client = ds_compat.load_checkpoint(engine, p.root, tag, run_dir)
            break
        except UnsafeCheckpoint as e:  # not a checkpoint our trainer wrote: nothing older is trusted more
            raise TrainError(f"{p.root / tag} is not resumed: {e}") from None
        except DeepSpeedFailed as e:
            say(f"resume: DeepSpeed could not load {p.root / tag}: {e.first_line} (traceback: "
                f"{e.traceback_file}); trying an older checkpoint")
            failure = e
    if client is None:
        raise TrainError(f"{p.root / p.tag}: DeepSpeed could not load this checkpoint ({failure.first_line}; "
                         f"traceback: {failure.traceback_file}), nor an older one of its layout "
                         f"({state.world_size} ranks, ZeRO-{state.zero_stage}). Start a new run.dir.")
    changed = changed_hparams(state, cfg)  # 9
    if changed or p.universal:
        reapply_hparams()  # the checkpoint restored its own lr, weight decay and schedule; the config's win
    if changed:
        say("resume: overrides applied to the resumed optimizer and schedule: " + ", ".join(changed))
    try:  # 10-11: the data position, the objective's state, every rank's RNG (on the same world size)
        client_state.load_state_dict(client, where=str(p.root / tag))
    except KeyError as e:
        raise TrainError(f"{e.args[0]}: not a checkpoint of this trainer; start a new run.dir") from None
    say(f"resumed from {ckpt.checkpoint_dir(run_dir) / tag} at step {state.step}")
    return state.step


def changed_hparams(state: ckpt.TrainerState, cfg: Config) -> list[str]:
    saved, now = state.config["train"], to_dict(cfg)["train"]
    return [f"train.{k} {saved.get(k)} -> {now[k]}" for k in RESUMABLE_HPARAMS if plain(saved.get(k)) != now[k]]


def plain(v: Any) -> Any:
    """Tuples as lists, within dicts and lists too (a distillation's students): a value as it reads back from JSON."""
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    return [plain(x) for x in v] if isinstance(v, (tuple, list)) else v


def _yaml(v: Any) -> str:
    return "null" if v is None else str(v)
