"""The two training commands, `launch/pretrain.py` and `launch/finetune.py`: a command line becomes one
run config, then one run that ends in an exit code of `pipeline.exit_codes`.

    pretrain(argv) -> int     # --config (default: the demo) + key=value overrides
    finetune(argv) -> int     # --from / --config / --res, each with a default (below) + key=value overrides

Defaults, so that the design card's commands work as typed:
  - `launch/pretrain.py` without --config trains the demo (DEFAULT_PRETRAIN_CONFIG);
  - `launch/finetune.py --res 384` without --from fine-tunes the newest finished pretraining run under
    runs/, and without --config uses the paper's recipe (the train section of FINETUNE_RECIPE and its
    dropout) on that run's config: its architecture, data set, DeepSpeed and tracking settings
    (`recipe_on_source`, built as data with `dataclasses.replace`);
  - a fine-tune restarted on its run directory (a requeue) keeps the source recorded at its first start.
The user's `key=value` overrides are applied last and win.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from pipeline.config import Config, ConfigError, ConfigFiles, FinetuneConfig, apply_overrides
from pipeline.data.pixels import COLOUR_KEYS
from pipeline.dist import PortInUse, import_deepspeed, is_rank0, say
from pipeline.errors import SourceError, add_launcher_arguments, reading_source, set_debug
from pipeline.exit_codes import ExitCode
from pipeline.objectives import RECIPES, config_files, load_or_exit
from pipeline.objectives.adapt import ADAPT_RECIPES
from pipeline.remote import StorageError
from pipeline.signals import install_signal_handlers, worker_context

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PRETRAIN_CONFIG = "configs/pretrain/demo.yaml"
# The paper's fine-tuning recipe (Appendix B.1.1); a source whose objective has a recipe of its own gets that
# (its Recipe.finetune_recipe: MAE's).
FINETUNE_RECIPE = "configs/finetune/vit_b16_384.yaml"
PROBE_RECIPE = "configs/finetune/mae_linprobe.yaml"  # --probe: MAE's linear probing (SGD in place of LARS)
RUNS = Path("runs")


def _parser(kind: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"launch/{kind}.py", description=f"{kind} a Vision Transformer")
    add_launcher_arguments(parser)  # --debug; the --local_rank=N the DeepSpeed launcher appends
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.lr=3e-4")
    return parser


def parse_pretrain_args(argv: list[str]) -> argparse.Namespace:
    parser = _parser("pretrain")
    parser.add_argument("--config", help=f"YAML run config (default: {DEFAULT_PRETRAIN_CONFIG})")
    parser.add_argument("--from", dest="source", help="a finished run this one continues (a later stage of the same "
                                                      "recipe: DINOv3's Gram and high-resolution stages), not a "
                                                      "fine-tune: its model, teachers and state are this run's start")
    parser.add_argument("--init", help="weights to start from (adapt.init; docs/adapt.md): anything finetune.py --from "
                                       "reads (Meta's DINOv2/DINOv3/MAE files, timm's, our exports, a run directory); "
                                       "the student's and teacher's backbone and the architecture are the source's, "
                                       "the heads fresh (a run directory of the same recipe brings its own)")
    args = parser.parse_args(argv)
    set_debug(args)
    return args


def parse_finetune_args(argv: list[str]) -> argparse.Namespace:
    parser = _parser("finetune")
    parser.add_argument("--config", help=f"YAML run config (default: the paper's recipe, {FINETUNE_RECIPE}, "
                                         "with the source run's architecture and data)")
    parser.add_argument("--from", dest="source", help="run directory, .safetensors, timm .pth/.bin or Meta's DINOv2 .pth "
                                                      f"(default: the newest finished pretraining run in {RUNS}/)")
    parser.add_argument("--res", help="fine-tuning resolution: 384 or 384x512 (height x width)")
    parser.add_argument("--probe", action="store_true", help="linear probe: train only a BatchNorm + linear head on "
                                                             f"the frozen encoder (default recipe: {PROBE_RECIPE})")
    args = parser.parse_args(argv)
    set_debug(args)
    return args


def parse_res(text: str) -> int | list[int]:
    """'384' -> 384, '384x512' -> [384, 512]."""
    try:
        parts = [int(p) for p in text.lower().split("x")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or min(parts, default=0) <= 0:
        _fail(f"--res '{text}': expected a size like 384 or 384x512")
    return parts[0] if len(parts) == 1 else parts


_is_main = is_rank0  # rank 0 (or a single process): the one that explains the defaults it picked
_say = say


def _fail(msg: str) -> None:
    if _is_main():
        print(f"error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(2)


# ----------------------------------------------------------------------------- pretraining


def pretrain_config(args: argparse.Namespace) -> tuple[Config, str]:
    """(the run config, the file to name in messages)."""
    config = args.config
    if config is None:
        config = DEFAULT_PRETRAIN_CONFIG if Path(DEFAULT_PRETRAIN_CONFIG).is_file() else str(
            ROOT / DEFAULT_PRETRAIN_CONFIG)
        _say(f"no --config: using {config} (the demo; e.g. --config configs/pretrain/vit_b16_i21k.yaml for ViT-B/16)")
    cfg = load_or_exit(config, args.overrides)
    if getattr(args, "init", None):  # --init: a pretraining run that starts from a foundation model's weights
        if getattr(args, "source", None):
            _fail(f"--init {args.init} with --from {args.source}: --from continues a run of this recipe, --init starts "
                  f"from weights; give one")
        if cfg.model.objective not in ADAPT_RECIPES:
            _fail(f"--init {args.init}: model.objective={cfg.model.objective} ({config}); --init starts "
                  f"{', '.join(ADAPT_RECIPES)} from a source's weights (fine-tune with launch/finetune.py --from)")
        cfg = dataclasses.replace(cfg, adapt=dataclasses.replace(cfg.adapt, init=args.init))
    if getattr(args, "source", None):  # --from: the recipe says which of its keys names the run it continues
        key = RECIPES[cfg.model.objective].continue_key
        if key is None:
            _fail(f"--from {args.source}: model.objective={cfg.model.objective} does not continue a run; fine-tune "
                  f"from one with launch/finetune.py --from")
        try:
            cfg = apply_overrides(cfg, [f"{key}={json.dumps(args.source)}"], where="--from")
        except ConfigError as e:
            _fail(str(e))
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, kind="pretrain")), config


def written_model_keys(config: str, overrides: list[str]) -> set[str]:
    """The model.* keys the config file and the command line write (what --init's source must agree with)."""
    tree = _saved_config(Path(config)) if Path(config).is_file() else {}
    model = tree.get("model") if isinstance(tree.get("model"), dict) else {}
    return set(model) | {k.partition("=")[0].strip()[len("model."):] for k in overrides
                         if k.strip().startswith("model.")}


def pretrain(argv: list[str]) -> int:
    args = parse_pretrain_args(argv)
    cfg, where = pretrain_config(args)
    return run(cfg, where, written_model_keys(where, args.overrides))


# ----------------------------------------------------------------------------- fine-tuning


def _saved_config(run_dir: Path, files: ConfigFiles | None = None) -> dict:
    """RUN_DIR/config.yaml as a plain tree ({} when missing or unreadable): what a run recorded at its start."""
    try:
        cfg = (files or config_files()).tree(run_dir / "config.yaml")
    except (OSError, ConfigError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _load(files: ConfigFiles, path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """A config file as the command reads it (once: `files`); a user error is one line and exit code 2."""
    try:
        return files.load(path, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _run_kind(cfg: dict) -> str | None:
    """The kind a saved config tree records (pretrain by default); None for no config."""
    if not cfg:
        return None
    run = cfg.get("run")
    return run.get("kind", "pretrain") if isinstance(run, dict) else "pretrain"


def finished_pretrain_runs(runs: Path = RUNS) -> list[Path]:
    """Run directories under `runs` holding a pretraining run that ran to the end (it exported
    model.safetensors, which the trainer writes last), newest first."""
    found = [d for d in runs.glob("*/")
             if (d / "model.safetensors").is_file() and _run_kind(_saved_config(d)) == "pretrain"]
    return sorted(found, key=lambda d: (d / "model.safetensors").stat().st_mtime, reverse=True)


def recorded_finetune_source(run_dir: Path | None, files: ConfigFiles | None = None) -> str | None:
    """The source a fine-tune run recorded at its first start (RUN_DIR/config.yaml's finetune.source), once
    the run has a complete checkpoint: a start that was refused or failed before its first save trained
    nothing from that source, and the next start (with a corrected --from) is a first start again.

    Not "does this start resume?": that is `resume.start`'s plan, made once in `run`, which needs the
    process group, the lock and the config. This runs before all three, to choose the config itself
    (which source, which recipe), and asks only whether a complete tag exists, by the same predicate
    (`checkpoint.newest_complete_tag`)."""
    cfg = _saved_config(run_dir, files) if run_dir is not None else {}
    if _run_kind(cfg) != "finetune" or not (run_dir / "checkpoints").is_dir():
        return None  # (no tag at all: not worth importing DeepSpeed for)
    import_deepspeed()  # pipeline.train imports DeepSpeed: without its autotuner's MLflow import (see `run`)
    from pipeline.train.checkpoint import newest_complete_tag

    if newest_complete_tag(run_dir) is None:
        return None
    return (cfg.get("finetune") or {}).get("source")


def newest_source() -> str:
    """No --from: the newest finished pretraining run under runs/, said with why."""
    runs = finished_pretrain_runs()
    if not runs:
        _fail(f"nothing to fine-tune: no finished pretraining run (with model.safetensors) in {RUNS.resolve()}/; "
              "pass --from RUN_DIR | FILE.safetensors | FILE.pth")
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime((runs[0] / "model.safetensors").stat().st_mtime))
    others = f"; {len(runs) - 1} older: {', '.join(str(r) for r in runs[1:4])}" if len(runs) > 1 else ""
    _say(f"--from {runs[0]}: the newest finished pretraining run in {RUNS}/ (model.safetensors written {stamp}{others})")
    return str(runs[0])


def recipe_on_source(source_cfg: Config, recipe: Config, res_name: str, source_name: str) -> Config:
    """The paper's recipe on a pretraining run's config: the recipe's train section as written (derived
    values such as the batch split are derived again) and its dropout; everything else (architecture,
    data set, DeepSpeed, tracking) is the source run's; the run directory runs/<source>-ft<res>."""
    model = dataclasses.replace(source_cfg.model, drop_rate=recipe.model.drop_rate,
                                drop_path_rate=recipe.model.drop_path_rate, img_size=recipe.model.img_size,
                                global_pool=recipe.model.global_pool, objective="supervised")
    run = dataclasses.replace(source_cfg.run, dir=str(RUNS / f"{source_name}-ft{res_name}"))
    # An objective's own fine-tune recipe may bring its augmentation (MAE's: RandAugment, mixup/cutmix,
    # smoothing), on the source's data.
    taken = RECIPES[source_cfg.model.objective].finetune_data
    if source_cfg.model.in_chans not in (None, 3):  # RandAugment and colour jitter are for RGB: not brought to others
        left = [k for k in taken if k in COLOUR_KEYS and getattr(recipe.data, k)]
        if left:
            _say(f"the fine-tuning recipe's data.{', data.'.join(left)} left out: colour transforms are defined for "
                 f"RGB, and the source reads {source_cfg.model.in_chans}-channel images")
        taken = tuple(k for k in taken if k not in COLOUR_KEYS)
    data = dataclasses.replace(source_cfg.data, **{k: getattr(recipe.data, k) for k in taken})
    return dataclasses.replace(source_cfg, model=model, data=data, train=recipe.train, run=run,
                               finetune=FinetuneConfig())


def finetune_config(args: argparse.Namespace, files: ConfigFiles | None = None) -> tuple[Config, str]:
    """(the run config, what to name in messages): --from, --config and --res resolved as the module says.
    Each config file is read once (`files`, which the fine-tune's preparation reads them from again)."""
    files = files or config_files()
    # The run directory as the command would make it, to find a fine-tune already started there.
    probe = _load(files, args.config, args.overrides) if args.config else None
    run_dir = Path(probe.run.dir) if probe is not None else _run_dir_override(args.overrides)
    recorded = recorded_finetune_source(run_dir, files)
    if recorded is not None:  # a restart: the source decided at the first start, its config the base
        if args.source and Path(args.source).expanduser().resolve() != Path(recorded).resolve():
            _fail(f"--from {args.source}: {run_dir} is a fine-tune of {recorded} (recorded in {run_dir}/config.yaml "
                  f"at its first start); drop --from to continue it, or use a new run.dir")
        _say(f"--from {recorded}: recorded in {run_dir}/config.yaml at this run's first start")
        args.source, where = recorded, args.config or str(run_dir / "config.yaml")
        cfg = probe or _load(files, where, args.overrides)
    else:
        args.source = args.source or newest_source()
        if args.config:
            cfg, where = probe, args.config
        else:
            cfg, where = _recipe_config(args, files)
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, kind="finetune"),
                              finetune=dataclasses.replace(cfg.finetune, source=args.source,
                                                           probe=cfg.finetune.probe or bool(getattr(args, "probe", False))))
    if args.res:
        res = parse_res(args.res)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, img_size=tuple(res) if isinstance(res, list)
                                                                  else res))
    return cfg, where


def _run_dir_override(overrides: list[str]) -> Path | None:
    """run.dir=... on the command line (the last one wins), before anything else is known."""
    found = None
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key.strip() == "run.dir":
            found = Path(value.strip())
    return found


def _recipe_config(args: argparse.Namespace, files: ConfigFiles) -> tuple[Config, str]:
    source = Path(args.source)
    source_cfg_path = source / "config.yaml" if source.is_dir() else source.parent / "config.yaml"
    if not source_cfg_path.is_file():
        _fail(f"--from {args.source} has no config.yaml beside it to take the architecture and data set from; "
              "pass --config configs/finetune/... as well")
    source_cfg = _load(files, source_cfg_path)
    recipe_file = FINETUNE_RECIPE
    own = RECIPES[source_cfg.model.objective].finetune_recipe  # the source objective's recipe, by variant
    if getattr(args, "probe", False):
        recipe_file = PROBE_RECIPE
    elif own is not None:
        recipe_file = own(source_cfg.model.variant)
    recipe = _load(files, ROOT / recipe_file)
    res_name = (args.res or str(recipe.model.img_size)).lower()
    base = recipe_on_source(source_cfg, recipe, res_name, source_cfg_path.parent.resolve().name)
    try:
        cfg = apply_overrides(base, args.overrides)
    except ConfigError as e:
        _fail(str(e))
    yours = {k.partition("=")[0].strip() for k in args.overrides}
    data_given = any(k == "data.path" or k.startswith("data.sources") for k in yours)
    if not data_given:
        check_labelled(cfg.data.path, source_cfg_path)
    _say(f"no --config: the paper's fine-tuning recipe (train section of {recipe_file}) on {source_cfg_path}: "
         f"{_taken_from_source(cfg, data_given, any(k.startswith('eval.sets') for k in yours))}; run dir {cfg.run.dir}")
    return cfg, f"the source run's config ({source_cfg_path})"


def _taken_from_source(cfg: Config, data_given: bool, sets_given: bool) -> str:
    """What a fine-tune without --config took from its source's config.yaml, said in its one line: the
    data and the eval.sets above all, which the user may have meant to change."""
    data = "data.path (yours)" if data_given else f"its data.path={cfg.data.path}"
    names = ", ".join(cfg.eval.sets) or "none"
    sets = f"eval.sets {names} (yours)" if sets_given else f"its eval.sets ({names}; eval.sets={{}} leaves them out)"
    return f"its architecture, {data}, {sets}, its deepspeed and tracking sections"


def check_labelled(path: str, source_cfg_path: Path) -> None:
    """A fine-tune trains on labels: the data.path it took from a self-supervised source is often label-free
    (the pretraining pile), which one line says, asking for labelled shards. Local dataset.json only (read as
    JSON, before torch); a remote one the supervised objective checks when it reads it."""
    info = Path(path) / "dataset.json"
    try:
        classes = json.loads(info.read_text()).get("num_classes") if info.is_file() else None
    except (OSError, ValueError, AttributeError):
        return  # not ours to judge here: the run reads it and says what is wrong
    if classes == 0:
        _fail(f"data.path={path} (taken from {source_cfg_path}) has no labels ({info}: num_classes 0), and a "
              f"fine-tune trains on labels: pass data.path=LABELLED_SHARDS (written by launch/make_shards.py "
              f"--source folder:DIR with a subfolder per class, docs/data.md)")


def finetune(argv: list[str]) -> int:
    args = parse_finetune_args(argv)
    files = config_files()  # every config file this command reads, read once
    cfg, where = finetune_config(args, files)
    # model.* keys typed on the command line: a fine-tune refuses those its source decides (not ignored).
    cli_model_keys = {k.partition("=")[0].strip()[len("model."):] for k in args.overrides
                      if k.strip().startswith("model.")}
    return run(cfg, where, cli_model_keys, files)


# ----------------------------------------------------------------------------- checks and the run


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


def check_variant(cfg: Config) -> None:
    """An unknown model.variant is a config error: say so before distributed init, with the valid ones."""
    # here, not at the top: the command reads its config before torch (variants.py is torch-free)
    from pipeline.model.variants import DINOV3_VARIANTS, VARIANTS  # the ViT's and DINOv3's

    if cfg.model.variant not in VARIANTS:
        _fail(f"model.variant='{cfg.model.variant}' is not a known variant; choose one of: {', '.join(VARIANTS)}")
    if cfg.model.variant in DINOV3_VARIANTS and cfg.model.objective not in ("supervised", "dinov3"):
        _fail(f"model.variant='{cfg.model.variant}' with model.objective={cfg.model.objective}: a DINOv3 ViT trains "
              f"with the supervised or the dinov3 objective and fine-tunes (--from); MAE and DINOv2 build the ViT of "
              f"vit.py")


def run(cfg: Config, where: str, cli_model_keys: set[str] | None = None, files: ConfigFiles | None = None) -> int:
    """Train `cfg` (a fine-tune when cfg.run.kind says so); a user error is one line and its exit code.
    Whether this start resumes is decided here, once (`resume.start`: process group, lock, plan), and the
    plan handed to the fine-tune's preparation and to the trainer."""
    install_signal_handlers()  # before anything slow (the launch scripts already did; idempotent)
    check_variant(cfg)
    for path in [s.path for s in cfg.data.sources] or [cfg.data.path]:  # data.sources: each of them
        check_data(path, where)
    # Imported after the config is read: a typo is reported at once, not after torch's and DeepSpeed's import.
    from pipeline.data import BadDataError, DataError, EvalFailed
    from pipeline.model.weights import WeightsError

    import_deepspeed()  # before pipeline.train imports it: without its autotuner's MLflow import
    from pipeline.run import resume
    from pipeline.run.finetune import prepare_finetune
    from pipeline.run.resume import TrainError
    from pipeline.run.trainer import fit
    from pipeline.train.checkpoint import CheckpointError
    from pipeline.train.lock import RunDirLocked, remove_if_unused

    together = False  # every rank leaves at the same point (set when fit returns normally)
    run_dir = Path(cfg.run.dir)
    try:
        # Once: the process group, the run directory's lock, and whether this start resumes (the plan).
        env, plan = resume.start(cfg)
        prepare = None
        if cfg.run.kind == "finetune":
            with reading_source(f"--from {cfg.finetune.source}"):  # whatever a reader raises: one line, exit 1
                cfg, prepare = prepare_finetune(cfg, plan, cli_model_keys or set(), files)
        elif cfg.model.objective in ADAPT_RECIPES:  # --init (adapt.init): the source's backbone, or its record
            from pipeline.run.init_source import prepare_init

            with reading_source(f"--init {cfg.adapt.init}"):
                cfg, prepare = prepare_init(cfg, plan, cli_model_keys or set())
        if cfg.data.num_workers > 0:
            # The loaders' fork server imports the data modules (torch, torchvision, timm: about 4 s of CPU) in
            # its own process. Started here, it does so while this rank builds the model and the engine and
            # loads its checkpoint; started by the first loader, the first batch waited for it. Not earlier:
            # it holds this rank's stdout until its imports are done, so a start refused above would leave
            # whoever reads that output waiting for them.
            worker_context()
        code = fit(cfg, env, plan, prepare)
        together = code in (ExitCode.OK, ExitCode.PREEMPTED)
        return code
    except (ConfigError, RunDirLocked, PortInUse) as e:  # e.g. fine-tuning without --from
        _error(e, shared=not isinstance(e, PortInUse))
        return ExitCode.USAGE
    except (DataError, BadDataError, StorageError, WeightsError, TrainError, CheckpointError, SourceError,
            FileNotFoundError) as e:
        _error(e, shared=isinstance(e, (TrainError, CheckpointError, EvalFailed)))
        return ExitCode.ERROR
    finally:
        if not together:  # a start refused before it wrote anything (a bad --from) leaves no run directory
            remove_if_unused(run_dir)
        _shutdown(together)


def _error(e: BaseException, shared: bool) -> None:
    """One line on stderr. An error every rank reached together (decided on rank 0 and broadcast, or
    about files all ranks share) is said once, by rank 0; another rank's own error by that rank."""
    if _is_main() or not shared:
        print(f"error: {e}", file=sys.stderr, flush=True)


def _shutdown(together: bool) -> None:
    """Leave the process group. Ranks that stop together (done, preempted) first meet at a barrier: a rank
    that tears its gloo connections down while a peer still uses them can make that peer abort at exit
    ("terminate called without an active exception")."""
    import torch.distributed as dist

    if dist.is_initialized():
        if together:
            dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
