"""Every use of DeepSpeed's private API and on-disk internals, in one place, for the versions tested.

What lives here, and why it cannot use a public API:
  - `load_checkpoint`: DeepSpeed 0.19's ZeRO-3 universal load leaves the forward's parameters on their
    initial values and shares one `step` tensor between Adam's groups; we call
    `optimizer._reassign_or_swap_out_partitioned_parameters` and read `fp32_partitioned_groups_flat`.
  - `convert_to_universal`: runs `ds_to_universal` and rewrites its output (`_bridge_zero_stages`) so
    that ZeRO-1/2 and ZeRO-3 each find the optimizer step where their loader looks for it.
  - `consolidate`, `full_fp32_param`: DeepSpeed's helpers that read its pickles and partitions.
  - (A ZeRO-3 parameter's own attributes, `ds_id`, `ds_shape` and its partition `ds_tensor`, are read in
    `pipeline/zero3.py`: the model reads them, and model/ does not import train/ or DeepSpeed.)
  - `gathered`: a ZeRO-3 module's full parameters for a forward, a save or a load outside the engine (the
    DINOv2 teacher, the model EMA: pipeline/train/ema.py).
  - The optimizer's step, changed (pipeline/train/ds_step.py, the same rule: DeepSpeed's private API there
    and here only): `read_free_steps`, the ZeRO optimizers' step without its host reads of the gradient norm;
    `clip_apart`, train.grad_clip on each set of parameter groups by that set's own norm.
  - `no_code_from_pickles`: DeepSpeed reads its checkpoint files with `torch.load(weights_only=False)`,
    which runs whatever a pickle in a tag says; every DeepSpeed call here that reads files runs with
    `torch.load` forced to `weights_only=True`, allowing only the few classes DeepSpeed stores
    (`DEEPSPEED_SAFE_GLOBALS`). A file that needs anything else is refused (`UnsafeCheckpoint`).

Importing this module checks the DeepSpeed version: another one may move any of the above without a
word, so it is refused with one line (pyproject.toml accepts the same range). DeepSpeed's own exceptions
are caught only around DeepSpeed's calls (`DeepSpeedFailed`), never around our bridging code, so a bug of
ours never reads as "DeepSpeed could not load"; the full traceback goes to a file in the run directory.
"""

from __future__ import annotations

import pickle
import re
import shutil
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import deepspeed
import numpy as np
import torch
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from pipeline.model.weights import WeightsError, refused_global
from pipeline.zero3 import is_partitioned

TESTED = ((0, 19, 8), (0, 20, 0))  # [low, high): the range pyproject.toml accepts
ERRORS_DIR = "errors"  # RUN_DIR/errors/<what>-<time>.txt: DeepSpeed's tracebacks behind a one-line message


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


@contextmanager
def gathered(module: torch.nn.Module, modifier_rank: int | None = None) -> Iterator[None]:
    """Within: a ZeRO-3 partitioned module's full parameters (collective: every rank enters); with
    `modifier_rank`, what that rank writes into them is partitioned again on exit. A plain module as it is."""
    params = [p for p in module.parameters() if is_partitioned(p)]
    if not params:
        yield
        return
    with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank):
        yield


def check_version(version: str = deepspeed.__version__) -> None:
    low, high = TESTED
    if not low <= _version(version) < high:
        raise ImportError(f"DeepSpeed {version} is not a tested version: pipeline.train.ds_compat uses its "
                          f"checkpoint internals as of >={'.'.join(map(str, low))},<{'.'.join(map(str, high))}; "
                          f"install one (pip install -c constraints.txt -e .)")


check_version()


# What a tag of ours holds besides tensors and plain containers (found with
# torch.serialization.get_unsafe_globals_in_checkpoint on tags of every ZeRO stage): DeepSpeed's loss scaler,
# ZeRO stage enum and fragment addresses, and NumPy arrays (the RNG state in the client state). Each is
# rebuilt from data; none runs code of the file's choosing.
DEEPSPEED_SAFE_GLOBALS = [LossScaler, ZeroStageEnum, fragment_address, np.ndarray, np.dtype,
                          np._core.multiarray._reconstruct, type(np.dtype(np.uint32))]


class UnsafeCheckpoint(WeightsError):
    """A checkpoint file that only a full unpickler reads: loading it could run code from the file."""


def _weights_only(load):
    def torch_load_weights_only(f, *args, weights_only=None, **kwargs):  # noqa: ARG001 - torch.load's, always True here
        try:
            return load(f, *args, weights_only=True, **kwargs)
        except pickle.UnpicklingError as e:
            why = refused_global(e)
            raise UnsafeCheckpoint(
                f"'{f}' holds pickled objects beyond tensors and DeepSpeed's own types ({why}); not loaded: "
                f"loading it could run code from the file. Only if you trust whoever wrote it: `python -m "
                f"deepspeed.utils.zero_to_fp32 CHECKPOINTS_DIR OUT_DIR --safe_serialization` (DeepSpeed's full "
                f"unpickler) makes OUT_DIR/model.safetensors of it to fine-tune --from") from None
    return torch_load_weights_only


@contextmanager
def no_code_from_pickles() -> Iterator[None]:
    """Within: every `torch.load` (DeepSpeed's included, whatever it asks for) is `weights_only=True`
    with `DEEPSPEED_SAFE_GLOBALS`; a file needing more raises UnsafeCheckpoint."""
    original = torch.load
    torch.load = _weights_only(original)
    try:
        with torch.serialization.safe_globals(DEEPSPEED_SAFE_GLOBALS):
            yield
    finally:
        torch.load = original


class DeepSpeedFailed(RuntimeError):
    """A DeepSpeed call raised. `first_line` is what it said; `traceback_file` holds the whole of it."""

    def __init__(self, what: str, error: BaseException, traceback_file: Path | None):
        text = str(error).strip()
        self.first_line = text.splitlines()[0] if text else type(error).__name__
        self.traceback_file = traceback_file
        super().__init__(f"{what}: {self.first_line}")


def save_traceback(run_dir: Path | None, what: str, error: BaseException) -> Path | None:
    """Write the whole traceback of `error` beside the one-line message (None if it cannot be written)."""
    if run_dir is None:
        return None
    import time

    try:
        folder = Path(run_dir) / ERRORS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{what}-{time.strftime('%Y%m%d-%H%M%S')}.txt"
        path.write_text("".join(traceback.format_exception(type(error), error, error.__traceback__)))
        return path
    except OSError:
        return None  # a full disk must not hide the message itself


def _deepspeed_call(what: str, run_dir: Path | None, fn, *args, **kwargs):
    """fn(*args, **kwargs), a DeepSpeed function; what it raises becomes DeepSpeedFailed (KeyboardInterrupt,
    SystemExit pass)."""
    try:
        with no_code_from_pickles():
            return fn(*args, **kwargs)
    except UnsafeCheckpoint:
        raise  # not DeepSpeed failing: a file we refuse to unpickle
    except Exception as e:  # noqa: BLE001 - anything DeepSpeed raises on files it cannot use
        raise DeepSpeedFailed(what, e, save_traceback(run_dir, what, e)) from e


def load_checkpoint(engine, root: Path, tag: str, run_dir: Path | None = None) -> dict[str, Any]:
    """Restore model, optimizer and schedule into `engine` from root/tag (a checkpoints/ or universal/
    folder; the engine was configured for which); return the client state."""
    path, client = _deepspeed_call("load", run_dir, engine.load_checkpoint, str(root), tag=tag,
                                   load_module_strict=True, load_optimizer_states=True,
                                   load_lr_scheduler_states=True)
    if path is None:  # DeepSpeed logs a warning and returns None for a tag it does not find
        raise DeepSpeedFailed("load", FileNotFoundError(f"no checkpoint '{tag}' in {root}"), None)
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
    if engine.load_universal_checkpoint():
        restore_buffers(engine.module, root / tag)
    return client


def restore_buffers(module: torch.nn.Module, folder: Path) -> None:
    """DeepSpeed 0.19's universal load takes the parameters from the universal files and skips the module's
    state dict, and with it the buffers (a BatchNorm's running statistics restarted at 0 and 1 on a layout
    change): the persistent buffers back from the model states file the converter copied beside them."""
    params = {name for name, _ in module.named_parameters()}
    buffers = {k: v for k, v in module.state_dict(keep_vars=True).items() if k not in params}
    if not buffers:
        return
    with no_code_from_pickles():
        saved = torch.load(folder / "mp_rank_00_model_states.pt", map_location="cpu")["module"]
    missing = sorted(set(buffers) - set(saved))
    if missing:
        raise DeepSpeedFailed("load", KeyError(f"{folder}: the model states hold no {', '.join(missing[:3])}"), None)
    with torch.no_grad():
        for k, buf in buffers.items():
            buf.copy_(saved[k])


def convert_to_universal(source: Path, out: Path, run_dir: Path | None = None) -> None:
    """source (a tag folder) -> out in DeepSpeed's universal format (one process, CPU; reads every rank's
    shards), made loadable by every ZeRO stage."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    check_param_names(source)  # before the converter makes a folder of each
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    # inject_missing_state: our checkpoints carry no Megatron-style tensor-parallel info (there is none).
    args = SimpleNamespace(input_folder=str(source), output_folder=str(out), num_extract_workers=1,
                           num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    _deepspeed_call("convert", run_dir, ds_to_universal, args)
    with no_code_from_pickles():  # reads what the converter wrote from a tag that may not be ours
        _finish_universal(out)


PARAM_NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")  # a module's dotted attribute path


def _names(value: Any) -> Iterator[Any]:
    """The parameter names in one of DeepSpeed's records: a dict's keys, a list of dicts' keys, a list."""
    for item in value if isinstance(value, (list, tuple)) else [value]:
        yield from (item.keys() if isinstance(item, dict) else [item])


def check_param_names(tag_dir: Path) -> None:
    """ds_to_universal makes a folder per parameter, named as the tag's files name it (`param_shapes` of the
    model states at ZeRO-3, `param_slice_mappings` of the optimizer states at ZeRO-1/2): a tag from a bucket
    or another group could name one '../../x' and have files written outside the run directory. Every name
    must be a module's dotted attribute path; UnsafeCheckpoint naming the file otherwise. Read memory-mapped,
    weights only."""
    with no_code_from_pickles():
        for path in sorted(tag_dir.glob("*_states.pt")):
            try:
                sd = torch.load(path, map_location="cpu", mmap=True)
            except (RuntimeError, OSError, EOFError):
                continue  # not a file the converter reads either: it says so itself
            if not isinstance(sd, dict):
                continue
            optim = sd.get("optimizer_state_dict")
            records = [sd.get(k) for k in ("param_shapes", "frozen_param_shapes", "shared_params", "buffer_names")]
            records.append(optim.get("param_slice_mappings") if isinstance(optim, dict) else None)
            for name in (n for r in records if r is not None for n in _names(r)):
                if not (isinstance(name, str) and PARAM_NAME.fullmatch(name)):
                    raise UnsafeCheckpoint(f"'{path}' names a parameter {str(name)[:120]!r}, not a module's dotted "
                                           f"attribute path; DeepSpeed's conversion would make a folder of that "
                                           f"name: refused, nothing converted")


def _finish_universal(out: Path) -> None:
    # An engine looks for its own stage's file name (ZeRO-3: zero_pp_rank_0_mp_rank_00_model_states.pt,
    # else mp_rank_00_model_states.pt); universal loading reads only metadata from it, so either serves.
    z3, z12 = out / "zero_pp_rank_0_mp_rank_00_model_states.pt", out / "mp_rank_00_model_states.pt"
    if z3.is_file() and not z12.is_file():
        shutil.copy2(z3, z12)
    elif z12.is_file() and not z3.is_file():
        shutil.copy2(z12, z3)
    _bridge_zero_stages(out / "zero")


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
        sd["ds_version"] = deepspeed.__version__
        torch.save(sd, global_state)
    for p in params:
        if not (p / "step.pt").is_file():
            torch.save(step, p / "step.pt")


def full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The fp32 master copy of `param`, assembled from the partitions (collective under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return safe_get_full_fp32_param(param)


def consolidate(checkpoints: Path, tag: str) -> dict[str, torch.Tensor]:
    """fp32 weights of checkpoints/tag on disk (any ZeRO stage, any world size), without an engine."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = _deepspeed_call("consolidate", None, get_fp32_state_dict_from_zero_checkpoint, str(checkpoints),
                            tag=tag)
    return {k: v.float().contiguous() for k, v in state.items()}
