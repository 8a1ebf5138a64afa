"""DeepSpeed checkpoints with trainer state, an atomic `latest` pointer, retention and weight export.

    RUN_DIR/checkpoints/step_0000400/   DeepSpeed's files (every rank writes its shards), with
        trainer_state.json              what the run is and where it stands (`TrainerState`, JSON, read
                                        before DeepSpeed starts); the data state (once, layout-free)
                                        and every rank's RNG go into DeepSpeed's client state
    RUN_DIR/checkpoints/latest          one line, "step_0000400"; replaced (rename) only after every
                                        rank has finished writing that tag
    RUN_DIR/universal/step_0000400/     a tag converted to DeepSpeed's universal format, made on a resume
                                        with another world size or ZeRO stage (outside checkpoints/:
                                        retention and `latest` never see it; safe to delete)
    RUN_DIR/model.safetensors           consolidated fp32 weights (timm key names), + RUN_DIR/config.yaml

A process killed while saving leaves `latest` on the previous complete checkpoint; the half-written
tag is ignored on resume and removed by retention later.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pipeline.model.weights import save_weights

STATE_VERSION = 2  # of trainer_state.json; 1 had no zero_stage (read from its config) and duplicated fields
STATE_FILE = "trainer_state.json"


@dataclass
class TrainerState:
    """The checkpoint's own state, in one place: RUN_DIR/checkpoints/<tag>/trainer_state.json."""

    step: int
    world_size: int
    zero_stage: int
    model: dict[str, Any]  # the model's shape keys: a checkpoint of another model is refused before loading
    config: dict[str, Any]  # the resolved config the checkpoint was written with
    mlflow_run_id: str | None = None
    version: int = STATE_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def write(self, tag_dir: Path) -> None:
        tag_dir.mkdir(parents=True, exist_ok=True)
        (tag_dir / STATE_FILE).write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def read(cls, tag_dir: Path) -> TrainerState:
        path = tag_dir / STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: {tag_dir} was not written by this trainer")
        d = json.loads(path.read_text())
        if d.get("version", 1) == 1:  # older layout: the stage was only in the saved config
            d["zero_stage"] = d.get("config", {}).get("deepspeed", {}).get("zero_stage", 1)
            d["version"] = STATE_VERSION
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def universal_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "universal"


def tag_for(step: int) -> str:
    return f"step_{step:07d}"


def latest_tag(run_dir: Path) -> str | None:
    """The newest complete checkpoint's tag, or None for a fresh run."""
    pointer = checkpoint_dir(run_dir) / "latest"
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    if not (checkpoint_dir(run_dir) / tag).is_dir():
        raise FileNotFoundError(f"{pointer} names '{tag}', which does not exist in {checkpoint_dir(run_dir)}: "
                                f"point it at a tag that exists there, or use a new run.dir")
    return tag


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)  # rename is atomic on POSIX: readers see the old or the new pointer, never half
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def gather_to_all(obj: Any) -> list[Any]:
    """Every rank's object, on every rank (per-rank RNG states and bad-data counts go into one checkpoint)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def save_checkpoint(engine, run_dir: Path, step: int, client_state: dict[str, Any], keep_last: int,
                    keep_every: int) -> str:
    """Collective: every rank writes its shards, then rank 0 moves `latest` and prunes old tags."""
    tag = tag_for(step)
    root = checkpoint_dir(run_dir)
    engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
    if dist.is_initialized():
        dist.barrier()  # every rank's files are on disk before the pointer moves
    if engine.global_rank == 0:
        _write_atomic(root / "latest", tag + "\n")
        prune(root, keep_last, keep_every, current=tag)
    if dist.is_initialized():
        dist.barrier()
    return tag


def prune(root: Path, keep_last: int, keep_every: int, current: str) -> None:
    """Keep the newest `keep_last` tags, every tag whose step is a multiple of `keep_every`, and `current`."""
    tags = sorted(p.name for p in root.glob("step_*") if p.is_dir())
    complete = [t for t in tags if t <= current]
    keep = set(complete[-max(keep_last, 1):]) | {current}
    if keep_every:
        keep |= {t for t in complete if int(t.split("_")[1]) % keep_every == 0}
    for t in tags:
        if t not in keep:
            shutil.rmtree(root / t, ignore_errors=True)
    # Universal conversions are only read by the resume that made them; a newer checkpoint supersedes them.
    for p in universal_dir(root.parent).glob("step_*"):
        if p.name < current:
            shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(engine, root: Path, tag: str) -> dict[str, Any]:
    """Restore model, optimizer and schedule into `engine` from root/tag (a checkpoints/ or universal/
    folder; the engine was configured for which); return the client state."""
    path, client = engine.load_checkpoint(str(root), tag=tag, load_module_strict=True,
                                          load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise FileNotFoundError(f"DeepSpeed could not load checkpoint '{tag}' from {root}")
    if engine.load_universal_checkpoint() and engine.zero_optimization_partition_weights():
        # DeepSpeed 0.19's ZeRO-3 universal load fills the fp32 master partitions but not the parameters
        # the forward uses (ZeRO-1/2 get update_lp_params()); without this the first step after the
        # resume runs on the initial weights.
        for i in range(len(engine.optimizer.fp32_partitioned_groups_flat)):
            engine.optimizer._reassign_or_swap_out_partitioned_parameters(i)
        # It also gives every group's state the same `step` tensor, which torch's Adam increments in place:
        # with G groups each optimizer step would count G steps (and get Adam's bias correction wrong).
        for state in engine.optimizer.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
    return client


def convert_to_universal(run_dir: Path, tag: str) -> Path:
    """RUN_DIR/checkpoints/<tag> -> RUN_DIR/universal/<tag> with DeepSpeed's ds_to_universal (one process,
    CPU; reads every rank's shards). Reused when a complete conversion is already there."""
    from types import SimpleNamespace

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    out = universal_dir(run_dir) / tag
    done = out / "converted"
    if done.is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    # inject_missing_state: our checkpoints carry no Megatron-style tensor-parallel info (there is none).
    args = SimpleNamespace(input_folder=str(checkpoint_dir(run_dir) / tag), output_folder=str(out),
                           num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                           inject_missing_state=True)
    ds_to_universal(args)
    # An engine looks for its own stage's file name (ZeRO-3: zero_pp_rank_0_mp_rank_00_model_states.pt,
    # else mp_rank_00_model_states.pt); universal loading reads only metadata from it, so either serves.
    z3, z12 = out / "zero_pp_rank_0_mp_rank_00_model_states.pt", out / "mp_rank_00_model_states.pt"
    if z3.is_file() and not z12.is_file():
        shutil.copy2(z3, z12)
    elif z12.is_file() and not z3.is_file():
        shutil.copy2(z12, z3)
    _bridge_zero_stages(out / "zero")
    shutil.copy2(checkpoint_dir(run_dir) / tag / STATE_FILE, out / STATE_FILE)
    _write_atomic(done, tag + "\n")
    return out


def _bridge_zero_stages(zero: Path) -> None:
    """ds_to_universal writes the optimizer's step (and version) where the source stage's loader reads
    them; put them where the other stages' loaders read them too, so that ZeRO-1/2 <-> ZeRO-3 works
    (DeepSpeed 0.19: ZeRO-3 reads optimizer_state.pt's optimizer_state_dict.state[0].step, ZeRO-1/2
    reads PARAM/step.pt and asserts on optimizer_state.pt's ds_version)."""
    params = sorted(p for p in zero.iterdir() if p.is_dir())
    global_state = zero / "optimizer_state.pt"
    sd = torch.load(global_state, map_location="cpu", weights_only=False)
    if "optimizer_state_dict" not in sd:  # from ZeRO-1/2
        step = torch.load(params[0] / "step.pt", map_location="cpu", weights_only=False)
        sd["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": sd["param_groups"]}
        torch.save(sd, global_state)
        return
    step = sd["optimizer_state_dict"]["state"][0]["step"]  # from ZeRO-3
    step = step if torch.is_tensor(step) else torch.tensor(float(step))
    # ZeRO-3 writes each state as a flat tensor; ZeRO-1/2 read {"param": tensor of the real shape}.
    model_states = torch.load(zero.parent / "zero_pp_rank_0_mp_rank_00_model_states.pt", map_location="cpu",
                              weights_only=False)
    shapes = {name: shape for group in model_states["param_shapes"] for name, shape in group.items()}
    for p in params:
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            value = torch.load(p / f"{key}.pt", map_location="cpu", weights_only=False)
            if torch.is_tensor(value):
                torch.save({"param": value.view(shapes[p.name])}, p / f"{key}.pt")
    if "ds_version" not in sd:  # ZeRO-1/2's loader asserts on it; ZeRO-3 keeps it elsewhere
        import deepspeed

        sd["ds_version"] = deepspeed.__version__
        torch.save(sd, global_state)
    for p in params:
        if not (p / "step.pt").is_file():
            torch.save(step, p / "step.pt")


def full_fp32_state_dict(engine) -> dict[str, torch.Tensor]:
    """Consolidated fp32 weights, whatever the ZeRO stage. Collective (ZeRO-3 gathers each parameter)."""
    from deepspeed.utils import safe_get_full_fp32_param

    state = {}
    for name, param in engine.module.named_parameters():
        full = safe_get_full_fp32_param(param)  # the fp32 master copy, assembled from the partitions
        state[name] = (full if full is not None else param.detach()).float().cpu()
    return state


def export_weights(engine, path: Path, metadata: dict[str, str] | None = None) -> None:
    state = full_fp32_state_dict(engine)
    if engine.global_rank == 0:
        save_weights(state, path, metadata=metadata)
    if dist.is_initialized():
        dist.barrier()


def consolidate(run_dir: Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """fp32 weights from a checkpoint on disk (any ZeRO stage, any world size), without an engine.

    Reads DeepSpeed's own pickles, which only our trainer wrote into this run directory.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag = tag or latest_tag(run_dir)
    if tag is None:
        raise FileNotFoundError(f"{checkpoint_dir(run_dir)} has no complete checkpoint (no 'latest')")
    state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir(run_dir)), tag=tag)
    return {k: v.float().contiguous() for k, v in state.items()}
