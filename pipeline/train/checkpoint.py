"""DeepSpeed checkpoints with trainer state, a completion record per tag, retention and weight export.

    RUN_DIR/checkpoints/step_0000400/   DeepSpeed's files (every rank writes its shards), with
        trainer_state.json              what the run is and where it stands (`TrainerState`, JSON, read
                                        before DeepSpeed starts); the data state (once, layout-free)
                                        and every rank's RNG go into DeepSpeed's client state
        complete.json                   written by rank 0 after every rank has written: each file of the
                                        tag and its size. A tag without it, or whose files differ from
                                        it, does not exist for resume (`check_tag`)
    RUN_DIR/checkpoints/latest          one line, "step_0000400", written after complete.json: for people
                                        and tools; resume never needs it (`newest_complete_tag` scans the tags)
    RUN_DIR/universal/step_0000400/     a tag converted to DeepSpeed's universal format, made on a resume
                                        with another world size or ZeRO stage (outside checkpoints/:
                                        retention never sees it; safe to delete)
    RUN_DIR/model.safetensors           consolidated fp32 weights (timm key names), + RUN_DIR/config.yaml

A process killed while saving leaves no complete.json in the tag it was writing: resume skips that tag
and retention removes it later. Retention never removes a tag newer than the one being saved.
Which tag a start resumes from, and what it restores, is decided in `pipeline.run.resume`.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import random
import re
import shutil
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pipeline import atomic
from pipeline.model.weights import save_weights
from pipeline.remote.names import UnsafeName, relative_name
from pipeline.train import ds_compat

TRAINER_STATE_VERSION = 3  # of trainer_state.json
STATE_FILE = "trainer_state.json"
COMPLETE_FILE = "complete.json"
TAG_PREFIX = "step_"
# The parts of the client state the trainer can write (pipeline/train/state.py); DeepSpeed stores its own
# keys beside them (ds_config, ds_version, param_shapes, ...), which are never parts.
CLIENT_PARTS = ("data", "objective", "ema", "rng")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used or written; the message names the file and what to do."""


class DiskFull(CheckpointError):
    """No space left while writing a checkpoint (the previous complete checkpoint is untouched)."""


@dataclass
class TrainerState:
    """What a tag is, readable before DeepSpeed starts: RUN_DIR/checkpoints/<tag>/trainer_state.json.
    Everything else about the run is in `config` (the resolved config this tag was written with)."""

    step: int
    world_size: int
    model: dict[str, Any]  # the model's resolved constructor arguments (num_classes may come from the data)
    config: dict[str, Any]
    version: int = TRAINER_STATE_VERSION
    # The trainable parameters of more than one dimension that the optimizer does not decay (the model's
    # no_weight_decay()): the parameter groups the saved optimizer state belongs to. None: a tag written
    # before it was recorded, when the ViT's rule (position embedding, class token) applied to every model.
    no_weight_decay: list[str] | None = None

    @property
    def zero_stage(self) -> int:
        return int(self.config["deepspeed"]["zero_stage"])

    def write(self, tag_dir: Path) -> None:
        tag_dir.mkdir(parents=True, exist_ok=True)
        (tag_dir / STATE_FILE).write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def read(cls, tag_dir: Path) -> TrainerState:
        path = tag_dir / STATE_FILE
        try:
            d = json.loads(path.read_text())
            if d.get("version") != TRAINER_STATE_VERSION:
                raise CheckpointError(f"{path}: trainer state version {d.get('version')}, this trainer reads "
                                      f"version {TRAINER_STATE_VERSION}")
            return cls(**{f.name: d[f.name] if f.default is dataclasses.MISSING else d.get(f.name, f.default)
                          for f in dataclasses.fields(cls)})
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing: {tag_dir} was not written by this trainer") from None
        except (ValueError, KeyError, TypeError) as e:  # truncated or hand-edited JSON
            raise CheckpointError(f"{path} is not a trainer state ({type(e).__name__}: {e})") from None


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def universal_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "universal"


def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step:07d}"


def tag_step(tag: str) -> int:
    return int(tag[len(TAG_PREFIX):])


def is_tag(name: str) -> bool:
    """Is `name` (a folder here, or one a bucket lists) a tag: step_ and ASCII digits only."""
    return re.fullmatch(TAG_PREFIX + "[0-9]+", name) is not None


def all_tags(run_dir: Path) -> list[str]:
    """Every tag folder in RUN_DIR/checkpoints, complete or not, newest first."""
    root = checkpoint_dir(run_dir)
    found = [p.name for p in root.glob(f"{TAG_PREFIX}*") if p.is_dir() and is_tag(p.name)]
    return sorted(found, key=tag_step, reverse=True)


def _tag_files(tag_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(tag_dir)): p.stat().st_size for p in sorted(tag_dir.rglob("*"))
            if p.is_file() and p.name != COMPLETE_FILE}


def recorded_files(tag_dir: Path) -> dict[str, int]:
    """The files complete.json records (name -> size), every name checked to stay inside the tag's folder
    (a tag restored from a bucket, or copied from elsewhere, is read the same way). FileNotFoundError when
    there is none; ValueError (UnsafeName among them) when it is not a record of ours."""
    record = json.loads((tag_dir / COMPLETE_FILE).read_text())
    files = record["files"] if isinstance(record, dict) else None
    if not isinstance(files, dict):
        raise ValueError(f"{tag_dir / COMPLETE_FILE}: no 'files' object")
    for name in files:
        relative_name(name, str(tag_dir / COMPLETE_FILE))
    return files


def check_tag(tag_dir: Path) -> str | None:
    """None if tag_dir is complete (complete.json there, every file it lists present with its size);
    else why not, in a few words."""
    if not (tag_dir / COMPLETE_FILE).is_file():
        return f"no {COMPLETE_FILE} (its save did not finish)"
    try:
        files = recorded_files(tag_dir)
    except UnsafeName as e:
        return f"{COMPLETE_FILE} names a file outside the tag ({str(e).split(': ', 1)[1]})"
    except (ValueError, KeyError, TypeError, OSError) as e:
        return f"{COMPLETE_FILE} unreadable ({type(e).__name__})"
    for name, size in files.items():
        path = tag_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size} bytes, {COMPLETE_FILE} recorded {size}"
    return None


def tag_bytes(tag_dir: Path) -> int:
    """The size of a complete tag, from its record (0 if unknown)."""
    try:
        return sum(recorded_files(tag_dir).values())
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def newest_complete_tag(run_dir: Path) -> str | None:
    """The newest complete tag in RUN_DIR/checkpoints, or None. Never reads `latest` (a convenience that
    a sync or a cleanup may have lost); `pipeline.run.resume` also checks that the tag loads."""
    for tag in all_tags(run_dir):
        if check_tag(checkpoint_dir(run_dir) / tag) is None:
            return tag
    return None


def _write_atomic(path: Path, text: str) -> None:
    atomic.write_text(path, text)  # readers see the old or the new file, never half


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


def save_checkpoint(engine, run_dir: Path, state: TrainerState, client_state: dict[str, Any], keep_last: int,
                    keep_every: int, protect: Callable[[], set[str]] = set) -> str:
    """Collective: every rank writes its shards; after a barrier rank 0 records the tag complete
    (complete.json), then moves `latest` and prunes older tags but those `protect()` names (run.remote's:
    train/mirror.py). A full disk is `DiskFull` on every rank, and the tag it was writing is removed (the
    previous complete tag is not touched)."""
    tag = tag_for(state.step)
    root = checkpoint_dir(run_dir)
    error = None
    if engine.global_rank == 0 and (root / tag).exists():
        shutil.rmtree(root / tag)  # an incomplete tag of an earlier attempt: none of its files may remain
    if dist.is_initialized():
        dist.barrier()
    try:
        if engine.global_rank == 0:
            state.write(root / tag)
        engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
    except (OSError, RuntimeError) as e:
        if not _disk_full(e):
            raise
        error = f"{type(e).__name__}: {_first_line(e)}"
    errors = [e for e in gather_to_all(error) if e]  # every rank learns whether any rank ran out of space
    if errors:
        raise _disk_full_error(engine, run_dir, tag, errors[0])
    if dist.is_initialized():
        dist.barrier()  # every rank's files are on disk before the tag counts as complete
    if engine.global_rank == 0:
        try:
            _write_atomic(root / tag / COMPLETE_FILE, json.dumps({"tag": tag, "files": _tag_files(root / tag)}))
            _write_atomic(root / "latest", tag + "\n")
        except OSError as e:
            if not _disk_full(e):
                raise
            error = f"{type(e).__name__}: {_first_line(e)}"
    errors = [e for e in gather_to_all(error) if e]
    if errors:
        raise _disk_full_error(engine, run_dir, tag, errors[0])
    if engine.global_rank == 0:
        prune(root, keep_last, keep_every, current=tag, protect=protect())
    if dist.is_initialized():
        dist.barrier()
    return tag


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _disk_full(e: BaseException | None) -> bool:
    """ENOSPC/EDQUOT, or torch's zip writer failing on a short write ("unexpected pos N vs M")."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(e, RuntimeError) and any(s in str(e) for s in ("unexpected pos", "No space left",
                                                                     "file write failed")):
            return True
        e = e.__cause__ or e.__context__
    return False


def _disk_full_error(engine, run_dir: Path, tag: str, what: str) -> DiskFull:
    root = checkpoint_dir(run_dir)
    if engine.global_rank == 0:
        shutil.rmtree(root / tag, ignore_errors=True)  # half a tag: give the space back
    if dist.is_initialized():
        dist.barrier()
    previous = newest_complete_tag(run_dir)
    need = tag_bytes(root / previous) if previous else 0
    if not need:  # no earlier tag to measure: bf16 weights + fp32 master + two Adam moments, roughly
        need = sum(p.numel() for p in engine.module.parameters()) * 14
    free = shutil.disk_usage(root if root.exists() else run_dir).free
    kept = (f"the previous checkpoint {root / previous} is intact" if previous
            else "there is no earlier checkpoint")
    return DiskFull(f"no space left on the device of {root} while writing checkpoint {tag} ({what}): it needs "
                    f"about {need / 2**20:.1f} MiB, {free / 2**20:.1f} MiB are free; {kept}. Free space (or set "
                    f"run.dir elsewhere) and start the same command again.")


def prune(root: Path, keep_last: int, keep_every: int, current: str, protect: set[str] = frozenset()) -> None:
    """Keep the newest `keep_last` complete tags up to `current`, every complete tag whose step is a
    multiple of `keep_every`, `current`, and the tags in `protect`. Never touches a tag newer than `current`
    (another start may have written it; only an operator removes those)."""
    older = [t for t in all_tags(root.parent) if tag_step(t) < tag_step(current)]  # newest first
    complete = [t for t in older if check_tag(root / t) is None]
    keep = set(complete[:max(keep_last, 1) - 1]) | set(protect)
    if keep_every:
        keep |= {t for t in complete if tag_step(t) % keep_every == 0}
    for t in older:
        if t not in keep:
            shutil.rmtree(root / t, ignore_errors=True)
    # Universal conversions are only read by the resume that made them; a newer checkpoint supersedes them.
    for p in universal_dir(root.parent).glob(f"{TAG_PREFIX}*"):
        if is_tag(p.name) and tag_step(p.name) < tag_step(current):
            shutil.rmtree(p, ignore_errors=True)


def convert_to_universal(run_dir: Path, tag: str) -> Path:
    """RUN_DIR/checkpoints/<tag> -> RUN_DIR/universal/<tag> (DeepSpeed's ds_to_universal, through
    ds_compat). Once per tag: reused when a complete conversion is already there (an elastic job's next
    restart on the same tag converts nothing). Built in a folder of its own and renamed into place, so two
    converters at once (a restart racing its previous attempt) never write into one folder: the first
    rename wins, the other's copy is dropped."""
    out = universal_dir(run_dir) / tag
    done = out / "converted"
    if done.is_file():
        return out
    tmp = universal_dir(run_dir) / f".{tag}.{socket.gethostname()}.{os.getpid()}"
    ds_compat.convert_to_universal(checkpoint_dir(run_dir) / tag, tmp, run_dir)
    shutil.copy2(checkpoint_dir(run_dir) / tag / STATE_FILE, tmp / STATE_FILE)
    _write_atomic(tmp / "converted", tag + "\n")
    if out.exists() and not done.is_file():
        shutil.rmtree(out, ignore_errors=True)  # an interrupted conversion from before this change
    try:
        os.rename(tmp, out)
    except OSError:  # another converter's copy got there first (rename onto a non-empty folder fails)
        shutil.rmtree(tmp, ignore_errors=True)
        if not done.is_file():
            raise
    return out


def full_fp32_state_dict(engine) -> dict[str, torch.Tensor]:
    """Consolidated fp32 weights, whatever the ZeRO stage. Collective (ZeRO-3 gathers each parameter)."""
    return fp32_state_dict(engine.module, ds_compat.full_fp32_param)


def persistent_buffers(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(state-dict name, buffer) of each buffer `module.state_dict()` holds, module by module: what an
    export carries besides the parameters and what a weights average walks (pipeline/train/ema.py)."""
    for mod_name, mod in module.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), buf


def fp32_state_dict(module: torch.nn.Module, master: Callable[[torch.Tensor], torch.Tensor | None] = lambda _p: None
                    ) -> dict[str, torch.Tensor]:
    """`module`'s weights as they are exported, fp32 on the CPU. `master(param)`: the parameter's fp32 master
    copy (DeepSpeed's, assembled from the partitions), or None to read the parameter itself (a module outside
    DeepSpeed's optimizer, such as the model EMA, which its caller gathers under ZeRO-3)."""
    state = {}
    for name, param in module.named_parameters():
        full = master(param)
        state[name] = (full if full is not None else param.detach()).float().cpu()
    # Fixed (untrained) tensors that belong to the weights: MAE's sin-cos tables, under Meta's names.
    if hasattr(module, "fp32_buffers"):
        state.update(module.fp32_buffers())
    # Other persistent buffers as the module holds them (never partitioned, even at ZeRO-3): the linear
    # probe's BatchNorm statistics, without which its exported head would normalise with (0, 1).
    for key, buf in persistent_buffers(module):
        state.setdefault(key, (buf.float() if buf.is_floating_point() else buf).detach().cpu().clone())
    return state


def export_weights(engine, path: Path, metadata: dict[str, str] | None = None,
                   state: dict[str, torch.Tensor] | None = None) -> None:
    """Collective: rank 0 writes `state` (by default the engine's consolidated fp32 weights) to `path`."""
    state = full_fp32_state_dict(engine) if state is None else state
    if engine.global_rank == 0:
        save_weights(state, path, metadata=metadata)
    if dist.is_initialized():
        dist.barrier()


def read_client_state(run_dir: Path, tag: str) -> dict[str, Any]:
    """The client state (trainer_state's parts: data, objective, ema, rng) of checkpoints/tag on disk, without
    an engine. DeepSpeed writes it into every model-states file (every part is gathered on every rank before
    the save, pipeline/train/state.py), so the first rank's file holds all of it whatever the ZeRO stage:
    mp_rank_00_model_states.pt at ZeRO 0-2, zero_pp_rank_0_mp_rank_00_model_states.pt at ZeRO-3. Read with
    `weights_only=True` and DeepSpeed's own few types (ds_compat.no_code_from_pickles), memory-mapped: the
    module's weights beside it at ZeRO 0-2 are not read."""
    tag_dir = checkpoint_dir(run_dir) / tag
    files = [tag_dir / name for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")]
    found = [f for f in files if f.is_file()]
    if not found:
        raise CheckpointError(f"{tag_dir}: no {files[0].name} or {files[1].name} (DeepSpeed's model states, "
                              f"which hold the client state)")
    with ds_compat.no_code_from_pickles():
        state = torch.load(found[0], map_location="cpu", mmap=True)
    # DeepSpeed puts the client state's entries beside its own keys (engine._save_checkpoint: state.update).
    return {k: state[k] for k in CLIENT_PARTS if k in state}


def consolidate(run_dir: Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """fp32 weights from a complete checkpoint on disk (any ZeRO stage, any world size), without an engine.

    DeepSpeed's pickles are read with `weights_only=True` (ds_compat.no_code_from_pickles): a tag from
    another group's run directory that carries code is refused (UnsafeCheckpoint), never run.
    """
    tag = tag or newest_complete_tag(run_dir)
    if tag is None:
        raise CheckpointError(f"{checkpoint_dir(run_dir)} has no complete checkpoint (no tag with {COMPLETE_FILE})")
    return ds_compat.consolidate(checkpoint_dir(run_dir), tag)
