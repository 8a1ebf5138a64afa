"""Shared command-line handling of launch/pretrain.py and launch/finetune.py.

Defaults, so that the design card's commands work as typed:
  - `launch/pretrain.py` without --config trains the demo (DEFAULT_PRETRAIN_CONFIG);
  - `launch/finetune.py --res 384` without --from fine-tunes the newest finished pretraining run under
    runs/, and without --config uses the paper's recipe (the train section of FINETUNE_RECIPE) with
    that run's architecture, data set, DeepSpeed and tracking settings (`resolve_finetune_defaults`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import yaml

from pipeline.config import ConfigError, flatten, load_or_exit
from pipeline.train.preemption import install_signal_handlers

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PRETRAIN_CONFIG = "configs/pretrain/demo.yaml"
FINETUNE_RECIPE = "configs/finetune/vit_b16_384.yaml"  # the paper's fine-tuning recipe (Appendix B.1.1)
RUNS = Path("runs")
RECIPE_MODEL_KEYS = ("drop_rate", "drop_path_rate")  # what the recipe sets besides the architecture


def parse_args(kind: str, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"launch/{kind}.py", description=f"{kind} a Vision Transformer")
    if kind == "finetune":
        parser.add_argument("--config", help=f"YAML run config (default: the paper's recipe, {FINETUNE_RECIPE}, "
                                             "with the source run's architecture and data)")
        parser.add_argument("--from", dest="source", help="run directory, .safetensors, or timm .pth/.bin "
                                                          f"(default: the newest finished pretraining run in {RUNS}/)")
        parser.add_argument("--res", help="fine-tuning resolution: 384 or 384x512 (height x width)")
    else:
        parser.add_argument("--config", help=f"YAML run config (default: {DEFAULT_PRETRAIN_CONFIG})")
    # The DeepSpeed launcher appends --local_rank=N; LOCAL_RANK in the environment says the same.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.lr=3e-4")
    return parser.parse_args(argv)


def parse_res(text: str) -> int | list[int]:
    """'384' -> 384, '384x512' -> [384, 512]."""
    try:
        parts = [int(p) for p in text.lower().split("x")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or min(parts, default=0) <= 0:
        print(f"error: --res '{text}': expected a size like 384 or 384x512", file=sys.stderr)
        raise SystemExit(2)
    return parts[0] if len(parts) == 1 else parts


def _is_main() -> bool:
    """Rank 0 (or a single process): the one that explains the defaults it picked."""
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def _say(msg: str) -> None:
    if _is_main():
        print(msg, flush=True)


def _fail(msg: str) -> None:
    if _is_main():
        print(f"error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(2)


# ----------------------------------------------------------------------------- fine-tune defaults


def _run_kind(run_dir: Path) -> str | None:
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        return (cfg.get("run") or {}).get("kind", "pretrain")
    except (OSError, yaml.YAMLError, AttributeError):
        return None


def finished_pretrain_runs(runs: Path = RUNS) -> list[Path]:
    """Run directories under `runs` holding a pretraining run that ran to the end (it exported
    model.safetensors, which the trainer writes last), newest first."""
    found = [d for d in runs.glob("*/") if (d / "model.safetensors").is_file() and _run_kind(d) == "pretrain"]
    return sorted(found, key=lambda d: (d / "model.safetensors").stat().st_mtime, reverse=True)


def override_value(overrides: list[str], key: str) -> str | None:
    """The last `key=value` among command-line overrides (None if the key is not overridden)."""
    found = None
    for item in overrides:
        k, sep, v = item.partition("=")
        if sep and k.strip() == key:
            found = v.strip()
    return found


def _run_dir_of(args: argparse.Namespace) -> Path | None:
    """The run directory this command will write, if it can be known before the source is decided."""
    given = override_value(args.overrides, "run.dir")
    if given is None and args.config and Path(args.config).is_file():
        with contextlib.suppress(yaml.YAMLError, AttributeError, OSError):
            given = ((yaml.safe_load(Path(args.config).read_text()) or {}).get("run") or {}).get("dir")
    return Path(given) if given else None


def recorded_finetune_source(run_dir: Path | None) -> str | None:
    """The source a fine-tune run recorded at its first start (RUN_DIR/config.yaml's finetune.source)."""
    if run_dir is None or _run_kind(run_dir) != "finetune":
        return None
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    return (cfg.get("finetune") or {}).get("source")


def resolve_finetune_defaults(args: argparse.Namespace) -> list[str]:
    """Fill in --from and --config when they are missing; return the overrides to apply first.

    A run directory that already holds a fine-tune (a restart, a requeue) keeps the source it recorded
    at its first start, and its config.yaml is the base config: the newest pretraining run may have
    changed since. Otherwise, without --from, the newest finished pretraining run under runs/; without
    --config the run is the paper's recipe (the train section of FINETUNE_RECIPE, plus its dropout
    settings) on the source run's resolved config.yaml: same architecture, data set, DeepSpeed and
    tracking settings, in run directory runs/<source>-ft<res>. The user's overrides win.
    """
    run_dir = _run_dir_of(args)
    recorded = recorded_finetune_source(run_dir)
    if recorded is not None:
        if args.source and Path(args.source).expanduser().resolve() != Path(recorded).resolve():
            _fail(f"--from {args.source}: {run_dir} is a fine-tune of {recorded} (recorded in {run_dir}/config.yaml "
                  f"at its first start); drop --from to continue it, or use a new run.dir")
        args.source = recorded
        _say(f"--from {recorded}: recorded in {run_dir}/config.yaml at this run's first start")
        if not args.config:
            args.config = str(run_dir / "config.yaml")  # the run as it was started; overrides still apply
        return []
    if not args.source:
        runs = finished_pretrain_runs()
        if not runs:
            _fail(f"nothing to fine-tune: no finished pretraining run (with model.safetensors) in {RUNS.resolve()}/; "
                  "pass --from RUN_DIR | FILE.safetensors | FILE.pth")
        args.source = str(runs[0])
        stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime((runs[0] / "model.safetensors").stat().st_mtime))
        others = f"; {len(runs) - 1} older: {', '.join(str(r) for r in runs[1:4])}" if len(runs) > 1 else ""
        _say(f"--from {args.source}: the newest finished pretraining run in {RUNS}/ "
             f"(model.safetensors written {stamp}{others})")
    if args.config:
        return []
    source = Path(args.source)
    source_cfg = source / "config.yaml" if source.is_dir() else source.parent / "config.yaml"
    if not source_cfg.is_file():
        _fail(f"--from {args.source} has no config.yaml beside it to take the architecture and data set from; "
              "pass --config configs/finetune/... as well")
    tree = yaml.safe_load(source_cfg.read_text()) or {}
    recipe = yaml.safe_load((ROOT / FINETUNE_RECIPE).read_text())
    tree["train"] = recipe["train"]  # the recipe as written: derived values (batch split) are re-derived
    tree["model"] = {**tree.get("model", {}), **{k: recipe["model"][k] for k in RECIPE_MODEL_KEYS
                                                if k in recipe["model"]}}
    if not args.res:
        tree["model"]["img_size"] = recipe["model"]["img_size"]
    res_name = (args.res or str(recipe["model"]["img_size"])).lower()
    tree["run"] = {**tree.get("run", {}), "dir": str(RUNS / f"{source_cfg.parent.resolve().name}-ft{res_name}")}
    tree.pop("finetune", None)
    _say(f"no --config: the paper's fine-tuning recipe (train section of {FINETUNE_RECIPE}) with the "
         f"architecture and data of {source_cfg} (data.path={tree.get('data', {}).get('path')}), "
         f"run dir {tree['run']['dir']}")
    return [f"{k}={json.dumps(v)}" for k, v in flatten(tree).items()]


# ----------------------------------------------------------------------------- data check


def check_data(path: str, config: str) -> None:
    """Missing shards are the first thing a new user meets: one line with the command that makes them."""
    if "://" in path or path.startswith("pipe:"):
        return
    p = Path(path)
    if p.is_file() or (p / "dataset.json").is_file() or (p / "_info.json").is_file():
        return
    source = "digits" if p.name == "digits" else "folder:/path/to/images"
    _fail(f"data.path '{path}' ({config}) has no shards (no dataset.json in {p.resolve()}); write them with: "
          f"python launch/make_shards.py --source {source} --out {path}")


def check_variant(cfg) -> None:
    """An unknown model.variant is a config error: say so before distributed init, with the valid ones."""
    from pipeline.model.vit import VARIANTS

    if cfg.model.variant not in VARIANTS:
        _fail(f"model.variant='{cfg.model.variant}' is not a known variant; choose one of: {', '.join(VARIANTS)}")


def run(kind: str, args: argparse.Namespace) -> int:
    install_signal_handlers()  # before anything slow (the launch scripts already did; idempotent)
    defaults: list[str] = []
    config = args.config
    if kind == "finetune":
        defaults = resolve_finetune_defaults(args)
        config = args.config  # None: built from the source run and the recipe (defaults)
    elif config is None:
        config = DEFAULT_PRETRAIN_CONFIG if Path(DEFAULT_PRETRAIN_CONFIG).is_file() else str(
            ROOT / DEFAULT_PRETRAIN_CONFIG)
        _say(f"no --config: using {config} (the demo; e.g. --config configs/pretrain/vit_b16_i21k.yaml for ViT-B/16)")
    overrides = [*defaults, *args.overrides, f"run.kind={kind}"]
    prepare = None
    if kind == "finetune":
        overrides.append(f"finetune.source={args.source}")
        if args.res:
            res = parse_res(args.res)
            overrides.append(f"model.img_size={res}")
    cfg = load_or_exit(config, overrides)
    check_variant(cfg)
    check_data(cfg.data.path, config or f"the source run's config ({args.source})")
    # Imported after the config is read: a typo is reported at once, not after DeepSpeed's import.
    from pipeline.data import BadDataError, DataError
    from pipeline.dist import PortInUse
    from pipeline.model.weights import WeightsError
    from pipeline.train.checkpoint import CheckpointError
    from pipeline.train.exit_codes import ExitCode
    from pipeline.train.lock import RunDirLocked
    from pipeline.train.resume import TrainError
    from pipeline.train.trainer import fit

    try:
        if kind == "finetune":
            from pipeline.train.finetune import prepare_finetune

            cli_model_keys = {k.partition("=")[0].strip()[len("model."):] for k in args.overrides
                              if k.strip().startswith("model.")}
            cfg, prepare = prepare_finetune(cfg, cli_model_keys)
        return fit(cfg, prepare)
    except (ConfigError, RunDirLocked, PortInUse) as e:  # e.g. fine-tuning without --from
        print(f"error: {e}", file=sys.stderr, flush=True)
        return ExitCode.USAGE
    except (DataError, BadDataError, WeightsError, TrainError, CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return ExitCode.ERROR
    finally:
        _shutdown()


def _shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
