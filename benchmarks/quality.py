"""The quality benchmark: every recipe trained on a real image set and judged as a reader of the field judges it
(issue 69; docs/benchmarks.md renders the table, docs/img/quality.png the picture).

    python launch/bench.py quality                                  # every recipe, 1 seed, the CPU budget
    python launch/bench.py quality --recipes supervised,dinov2 --seeds 3
    python launch/bench.py quality --smoke --csv /tmp/q.csv         # a few steps of everything (make test)

The set is Fashion-MNIST (Debian's dataset-fashion-mnist: 60,000 train and 10,000 test images of 28 x 28,
the official split), written once as shards under --data-dir. For each recipe and seed, the commands a user
types, each a process of its own, every run in one MLflow experiment (vit-pipeline-quality):

  1. pretraining: `launch/pretrain.py --config configs/pretrain/fmnist_<recipe>.yaml`, judged during training on
     the test split (eval.sets: the k-NN top-1 over steps, a memory of 10,000 train images);
  2. `launch/evaluate.py`: the k-NN (the whole train split as the bank) and the linear probe, with all the
     train labels and with 1% of them (stratified, seeded: `make_shards.py --train-fraction 0.01`);
  3. self-supervised recipes: `launch/finetune.py --from` the pretrained run with 10% and with 100% of the
     labels (configs/finetune/fmnist.yaml), beside the same fine-tune from random weights, once per seed and per
     stem the recipes' presets have (a fine-tune takes its source's): `scratch` with the config's convolutional
     stem (DINOv2's preset), `scratch-patch` with the patchify (MAE's and DINOv3's).

Baselines measured here, once per set: a k-NN and a logistic regression on the raw pixels (the same k-NN
code and linear-probe protocol as the models'), and the presets' ViT at its random initialisation (a
1-step run at learning rate 0: the weights do not move) through evaluate.py. Each recipe and seed is one row
of results/benchmarks.csv, appended the moment it is measured, with its steps, epochs, wall time and machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = "vit-pipeline-quality"
SET_NAME = "fmnist"  # eval.sets' name: metrics eval/fmnist/knn_top1
FINETUNE = "configs/finetune/fmnist.yaml"
FINETUNE_FRACTIONS = {"ft10": "10pct", "ft100": ""}  # figure -> the labelled set it fine-tunes on
CURVE_MEMORY = 10000  # the in-training k-NN's memory: the first 10,000 train images (evaluate.py's bank is all)


@dataclass(frozen=True)
class Recipe:
    preset: str
    self_supervised: bool
    smoke: tuple[str, ...] = ()
    """Overrides of its own that make a smoke run small (its section's keys)."""


_DINO_SMOKE = ("dino.freeze_last_layer_steps=1", "dino.teacher_temp_warmup_steps=1", "dino.knn_train_samples=64")
RECIPES = {
    "supervised": Recipe("configs/pretrain/fmnist_supervised.yaml", False),
    "mae": Recipe("configs/pretrain/fmnist_mae.yaml", True, ("mae.knn_train_samples=64",)),
    "dinov2": Recipe("configs/pretrain/fmnist_dinov2.yaml", True, _DINO_SMOKE),
    "dinov3": Recipe("configs/pretrain/fmnist_dinov3.yaml", True,
                     tuple(k.replace("dino.", "dinov3.") for k in _DINO_SMOKE)),
}

BUDGETS: dict[str, tuple[str, ...]] = {
    # The presets as written: about an hour of pretraining per recipe on the 2-core machine (their headers).
    "cpu": (),
    # A lent H200 (the GPU issue runs it): a ViT-S-sized model, bf16, batches of 512, many epochs in minutes.
    # Not yet run: the steps are sized from the CPU presets' throughput per FLOP, to be corrected by the first row.
    "gpu": ("model.embed_dim=384", "model.depth=12", "model.num_heads=6", "deepspeed.bf16=true",
            "train.global_batch_size=512", "train.micro_batch_size=512", "data.num_workers=8", "train.steps=12000"),
}
SMOKE = ("train.steps=4", "train.global_batch_size=16", "train.micro_batch_size=16", "train.warmup_steps=1",
         "train.log_every=2", "train.eval_every=2", "train.ckpt_every=0", "eval.memory_samples=64")
SMOKE_PER_CLASS = (40, 20)  # images per class in the smoke set's train and val splits (the real images)


def add_quality_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated, of {', '.join(RECIPES)} "
                   f"(default: all)")
    p.add_argument("--seeds", type=int, default=1, help="seeds per recipe, 0..N-1 (the table gives the mean and "
                   "the spread; default 1)")
    p.add_argument("--first-seed", type=int, default=0, help="start the seeds here: --first-seed 1 --seeds 1 adds "
                   "seed 1 beside the rows of seed 0 already in the CSV (default 0)")
    p.add_argument("--budget", choices=list(BUDGETS), default="cpu",
                   help="cpu: the presets as written (about an hour of pretraining per recipe on 2 cores); gpu: a "
                        "ViT-S-sized model over many epochs on a lent GPU")
    p.add_argument("--stages", default="pretrain,probe,finetune",
                   help="what to run per recipe: pretrain (always, and its in-training k-NN), probe (evaluate.py's "
                        "k-NN and linear probe, all and 1%% of the labels), finetune (10%% and 100%% of the labels, "
                        "and from random weights); default all three")
    p.add_argument("--no-baselines", action="store_true", help="skip the raw-pixel and random-ViT baselines")
    p.add_argument("--set", dest="quality_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="an ablation: this override on every recipe's pretraining (repeatable; needs --ablation)")
    p.add_argument("--ablation", default=None,
                   help="the ablation's name: its rows are the table's line 'RECIPE (NAME)', beside the preset's")
    p.add_argument("--smoke", action="store_true",
                   help="a few steps of everything on 600 real images (make test runs it): the code, not a figure")
    p.add_argument("--data-dir", type=Path, default=ROOT / "data", help="where the shards are written (default data/)")
    p.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "quality",
                   help="where the run directories go (default runs/quality/<budget>/); each run starts afresh")
    p.add_argument("--quality-threads", type=int, default=None,
                   help="torch threads of each run (OMP_NUM_THREADS; default: the machine's cores)")


# ----------------------------------------------------------------------------- data


def prepare_data(data_dir: Path, smoke: bool) -> dict[str, Path]:
    """The labelled set, 10% and 1% of its train labels (the val split whole): {'' | '10pct' | '1pct': folder}.
    Written once; a folder that holds a dataset.json is reused."""
    from pipeline.data.idx import fashion_mnist_source
    from pipeline.data.shards import write_dataset
    from pipeline.data.sources import keep_train_fraction

    name = "fmnist-smoke" if smoke else "fmnist"
    folders = {"": data_dir / name, "10pct": data_dir / f"{name}-10pct", "1pct": data_dir / f"{name}-1pct"}
    if all((f / "dataset.json").exists() for f in folders.values()):
        return folders
    source = fashion_mnist_source()
    if smoke:
        source = first_per_class(source, dict(zip(("train", "val"), SMOKE_PER_CLASS)))
    for key, folder in folders.items():
        if (folder / "dataset.json").exists():
            continue
        fraction = {"": None, "10pct": 0.1, "1pct": 0.01}[key]
        subset = keep_train_fraction(source, fraction, seed=0) if fraction else source
        write_dataset(subset, folder, overwrite=True, progress=False, log=lambda line: print(f"[quality] {line}"))
    return folders


def first_per_class(source: Any, per_split: dict[str, int]) -> Any:
    """The source with the first `per_split[split]` images of each class of each split: the smoke's set."""
    import dataclasses
    from collections import Counter

    def first(items: list[Any], n: int) -> list[Any]:
        kept, seen = [], Counter()
        for it in items:
            seen[it.label] += 1
            if seen[it.label] <= n:
                kept.append(it)
        return kept

    return dataclasses.replace(source, name=f"{source.name}, first of each class",
                               splits={k: first(v, per_split[k]) for k, v in source.splits.items()})


# ----------------------------------------------------------------------------- running the commands


SHOWN = ("step ", "eval ", "pretrain:", "finetune:", "done", "error", "warning", "Traceback")


@dataclass
class Progress:
    """Commands run of those planned, and since when: the line before each command."""
    total: int
    done: int = 0
    t0: float = 0.0

    def next(self) -> str:
        self.done += 1
        elapsed = time.perf_counter() - self.t0
        return f"[quality] command {self.done}/{self.total}, {elapsed / 60:.0f} min so far"


def run_command(argv: list[str], log: Path, threads: int, progress: Progress | None = None) -> float:
    """Run one command (cwd the repository), its output into `log` and its progress lines to the terminal;
    its wall time in seconds. A failure raises with the log's last lines."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    log.parent.mkdir(parents=True, exist_ok=True)
    shown = " ".join(str(a) for a in argv).replace(f"{sys.executable} ", "python ")
    if progress is not None:
        print(progress.next(), flush=True)
    print(f"[quality] $ {shown}", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write(f"$ {shown}\n")
        proc = subprocess.Popen([str(a) for a in argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            f.write(line)
            f.flush()  # the log follows the run (tail -f), not the end of its buffer
            if line.startswith(SHOWN):
                print(f"    {line.rstrip()}", flush=True)
        code = proc.wait()
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise RuntimeError(f"exit {code}: {shown}\n(log: {log})\n{tail}")
    return time.perf_counter() - t0


def fresh(run_dir: Path) -> Path:
    """A run directory emptied first: a run dir that holds a checkpoint would resume instead of starting."""
    shutil.rmtree(run_dir, ignore_errors=True)
    return run_dir


def metrics_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def last_metric(run_dir: Path, key: str) -> float | None:
    found = [r["metrics"][key] for r in metrics_rows(run_dir) if key in r["metrics"]]
    return float(found[-1]) if found else None


def curve(run_dir: Path, key: str) -> list[list[float]]:
    """[[step, seconds since the run's first record, value]] of metric `key` (eval/fmnist/knn_top1)."""
    rows = metrics_rows(run_dir)
    t0 = rows[0]["time"]
    return [[r["step"], round(r["time"] - t0, 1), round(r["metrics"][key], 4)] for r in rows if key in r["metrics"]]


def evaluate(run_dir: Path, data: Path, name: str, plan: Plan) -> dict[str, float]:
    """evaluate.py's k-NN (k=20) and linear probe of the run's export: {knn, linear}."""
    out = run_dir / f"evaluate-{name}.json"
    plan.run([sys.executable, "launch/evaluate.py", "--from", run_dir, "--data", data, "--name", name, "--json", out],
             run_dir.parent / f"{run_dir.name}.evaluate-{name}.log")
    metrics = json.loads(out.read_text())[-1]["metrics"]
    return {"knn": round(metrics["knn_top1"], 4), "linear": round(metrics["linear_top1"], 4)}


# ----------------------------------------------------------------------------- one recipe


@dataclass
class Plan:
    budget: str
    smoke: bool
    stages: tuple[str, ...]
    data: dict[str, Path]
    runs: Path
    threads: int
    ablation: str | None = None
    ablation_overrides: tuple[str, ...] = ()
    progress: Progress | None = None

    def run(self, argv: list[Any], log: Path) -> float:
        """run_command with the plan's threads and progress line."""
        return run_command(argv, log, self.threads, self.progress)

    def overrides(self, seed: int, run_dir: Path, extra: tuple[str, ...] = ()) -> list[str]:
        out = [f"train.seed={seed}", f"run.dir={run_dir}", f"tracking.experiment={EXPERIMENT}", *BUDGETS[self.budget]]
        return out + ([*SMOKE, *extra] if self.smoke else [])



def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(path.read_text())


def preset_sha(*paths: str, overrides: tuple[str, ...] = ()) -> str:
    """What a row was measured with: the first 12 hex digits of the sha256 of the config files' settings (their
    YAML as sorted JSON: a comment edited in a header changes nothing) and an ablation's overrides; the table
    averages only the seeds of one preset."""
    import hashlib

    digest = hashlib.sha256()
    for path in paths:
        digest.update(json.dumps(_read_yaml(ROOT / path), sort_keys=True).encode())
    digest.update("\n".join(overrides).encode())
    return digest.hexdigest()[:12]


def recipe_sha(recipe: Recipe, overrides: tuple[str, ...] = ()) -> str:
    """A recipe row's preset_sha: its preset, and the fine-tune config where it is fine-tuned."""
    return preset_sha(recipe.preset, *([FINETUNE] if recipe.self_supervised else []), overrides=overrides)


def train_images(folder: Path) -> int:
    return int(json.loads((folder / "dataset.json").read_text())["splits"]["train"]["num_samples"])


def bench_recipe(name: str, seed: int, plan: Plan) -> dict[str, Any]:
    """Pretrain one recipe, judge it, fine-tune from it: its figures (one CSV row)."""
    recipe, data = RECIPES[name], plan.data[""]
    tag = f"{name}-{plan.ablation}" if plan.ablation else name
    run_dir = fresh(plan.runs / f"{tag}-s{seed}")
    argv = [sys.executable, "launch/pretrain.py", "--config", recipe.preset, f"data.path={data}",
            f"eval.sets.{SET_NAME}={data}", f"eval.memory_samples={CURVE_MEMORY}",
            *plan.overrides(seed, run_dir, recipe.smoke), *plan.ablation_overrides]
    seconds = plan.run(argv, plan.runs / f"{tag}-s{seed}.log")
    knn_key = f"eval/{SET_NAME}/knn_top1"
    train = _read_yaml(run_dir / "config.yaml")["train"]  # the run's resolved steps and global batch
    figures: dict[str, Any] = {
        "recipe": name, "seed": seed, "budget": plan.budget, "smoke": plan.smoke, "preset": recipe.preset,
        "preset_sha": recipe_sha(recipe, plan.ablation_overrides),
        **({"ablation": plan.ablation, "overrides": list(plan.ablation_overrides)} if plan.ablation else {}),
        "run_dir": str(run_dir.relative_to(ROOT) if run_dir.is_relative_to(ROOT) else run_dir),
        "steps": train["steps"], "epochs": round(train["steps"] * train["global_batch_size"] / train_images(data), 2),
        "pretrain_s": round(seconds, 1),
        "images_per_s": round(last_metric(run_dir, "perf/images_per_s") or 0.0, 1),
        "curve": curve(run_dir, knn_key), "knn_curve_memory": CURVE_MEMORY,
    }
    if not recipe.self_supervised:
        figures["top1"] = last_metric(run_dir, "eval/top1")
    if "probe" in plan.stages:
        for key, folder in (("", plan.data[""]), ("_1pct", plan.data["1pct"])):
            found = evaluate(run_dir, folder, SET_NAME + key.replace("_", "-"), plan)
            figures.update({f"{k}{key}": v for k, v in found.items()})
    if "finetune" in plan.stages and recipe.self_supervised:
        for figure, labels in FINETUNE_FRACTIONS.items():
            ft_dir = fresh(plan.runs / f"{tag}-s{seed}-{figure}")
            argv = [sys.executable, "launch/finetune.py", "--config", FINETUNE, "--from", run_dir, "--res", "28",
                    f"data.path={plan.data[labels]}", "finetune.head_init=model", *plan.overrides(seed, ft_dir)]
            figures[f"{figure}_s"] = round(plan.run(argv, plan.runs / f"{ft_dir.name}.log"), 1)
            figures[figure] = last_metric(ft_dir, "eval/top1")
    return figures


def preset_stem(preset: str) -> str:
    """The model.stem a preset writes ('patch' where it writes none): the architecture a fine-tune from its run has."""
    return (_read_yaml(ROOT / preset).get("model") or {}).get("stem", "patch")


def scratch_name(stem: str) -> str:
    """The baseline's recipe name for the fine-tunes of a backbone with `stem`: 'scratch' for the fine-tune
    config's own (the convolutional stem), 'scratch-patch' for the patchify (MAE's, DINOv3's presets)."""
    return "scratch" if stem == preset_stem(FINETUNE) else f"scratch-{stem}"


def bench_scratch(seed: int, plan: Plan, stem: str) -> dict[str, Any]:
    """The fine-tune config from random weights with 10% and 100% of the labels, with `stem`: what a pretrained
    backbone of that stem is judged against (the same architecture, steps, seed and head init)."""
    name = scratch_name(stem)
    own = () if name == "scratch" else (f"model.stem={stem}",)
    figures: dict[str, Any] = {"recipe": name, "seed": seed, "budget": plan.budget, "smoke": plan.smoke,
                               "preset": FINETUNE, "preset_sha": preset_sha(FINETUNE, overrides=own)}
    for figure, labels in FINETUNE_FRACTIONS.items():
        run_dir = fresh(plan.runs / f"{name}-s{seed}-{figure}")
        argv = [sys.executable, "launch/pretrain.py", "--config", FINETUNE, f"data.path={plan.data[labels]}",
                *plan.overrides(seed, run_dir), *own]
        figures[f"{figure}_s"] = round(plan.run(argv, plan.runs / f"{run_dir.name}.log"), 1)
        figures[figure] = last_metric(run_dir, "eval/top1")
    figures["steps"] = _read_yaml(run_dir / "config.yaml")["train"]["steps"]
    return figures


# ----------------------------------------------------------------------------- baselines


def bench_pixels(plan: Plan) -> dict[str, Any]:
    """k-NN (cosine, k=20, T=0.07 votes: the models' code) and the linear probe's logistic regression (the models'
    protocol) on the raw pixels, with all and with 1% of the train labels."""
    import numpy as np
    import torch

    from pipeline.data import read_dataset_info, tario
    from pipeline.eval.knn import knn_accuracy
    from pipeline.eval.linear import linear_probe

    def load(folder: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = [], []
        for shard in read_dataset_info(folder).splits[split].shards:
            for raw in tario.iter_raw_samples(shard):
                xs.append(tario.decode_array(tario.image_member(raw)[1]).reshape(-1))
                ys.append(tario.parse_label(raw, "cls"))
        return torch.from_numpy(np.stack(xs).astype(np.float32) / 255.0), torch.tensor(ys)

    t0 = time.perf_counter()
    figures: dict[str, Any] = {"recipe": "pixels", "budget": plan.budget, "smoke": plan.smoke}
    vx, vy = load(plan.data[""], "val")
    for key, folder in (("", plan.data[""]), ("_1pct", plan.data["1pct"])):
        tx, ty = load(folder, "train")
        unit = torch.nn.functional.normalize
        figures[f"knn{key}"] = round(knn_accuracy(unit(vx, dim=1), vy, unit(tx, dim=1), ty, (20,))[20][0], 4)
        mean, std = tx.mean(0), tx.std(0).clamp_min(1e-3)  # standardised per pixel, as a logistic regression wants
        figures[f"linear{key}"] = round(linear_probe((tx - mean) / std, ty, (vx - mean) / std, vy).top1, 4)
        print(f"[quality] raw pixels{key.replace('_', ', ')}: k-NN {100 * figures[f'knn{key}']:.2f}%, "
              f"linear {100 * figures[f'linear{key}']:.2f}%", flush=True)
    figures["seconds"] = round(time.perf_counter() - t0, 1)
    return figures


def bench_random_vit(plan: Plan) -> dict[str, Any]:
    """The presets' ViT at its random initialisation (train.seed 0), judged as the recipes are: a 1-step run at
    learning rate 0 exports the weights as drawn (AdamW's step and decoupled decay both scale with the lr)."""
    run_dir = fresh(plan.runs / "random-vit")
    argv = [sys.executable, "launch/pretrain.py", "--config", RECIPES["supervised"].preset,
            f"data.path={plan.data['']}", *plan.overrides(0, run_dir),
            "train.steps=1", "train.lr=0", "train.min_lr=0", "train.warmup_steps=0", "train.eval_every=0"]
    plan.run(argv, plan.runs / "random-vit.log")
    figures: dict[str, Any] = {"recipe": "random-vit", "budget": plan.budget, "smoke": plan.smoke,
                               "preset": RECIPES["supervised"].preset,
                               "preset_sha": preset_sha(RECIPES["supervised"].preset)}
    for key, folder in (("", plan.data[""]), ("_1pct", plan.data["1pct"])):
        found = evaluate(run_dir, folder, SET_NAME + key.replace("_", "-"), plan)
        figures.update({f"{k}{key}": v for k, v in found.items()})
    return figures


# ----------------------------------------------------------------------------- the benchmark


def bench_quality(args: argparse.Namespace) -> None:
    """Run the plan, appending each row to the CSV as it is measured (rows already written survive a failure
    later on); then render docs/benchmarks.md and the picture unless --csv names another file."""
    from benchmarks.results import RESULTS_CSV, append_result

    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in RECIPES]
    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
    if unknown or not recipes:
        raise SystemExit(f"error: --recipes {args.recipes}: expected a comma-separated list of {', '.join(RECIPES)}")
    if set(stages) - {"pretrain", "probe", "finetune"}:
        raise SystemExit(f"error: --stages {args.stages}: expected pretrain, probe, finetune")
    if args.seeds < 1 or args.first_seed < 0:
        raise SystemExit("error: --seeds must be at least 1 and --first-seed at least 0")
    if bool(args.quality_overrides) != bool(args.ablation):
        raise SystemExit("error: --set and --ablation go together: an ablation's rows are named by --ablation")
    if args.ablation and not args.ablation.replace("-", "").replace("_", "").isalnum():
        raise SystemExit(f"error: --ablation {args.ablation!r}: letters, digits, - and _ (it names run directories)")
    threads = args.quality_threads or os.cpu_count() or 1
    runs = args.runs_dir / (f"{args.budget}-smoke" if args.smoke else args.budget)
    baselines = not args.no_baselines and not args.ablation
    # One baseline per architecture the self-supervised recipes' fine-tunes have (their presets' stems)
    scratch = [] if "finetune" not in stages or args.ablation else list(dict.fromkeys(
        preset_stem(RECIPES[r].preset) for r in recipes if RECIPES[r].self_supervised))
    per_seed = 2 * len(scratch) + sum(1 + 2 * ("probe" in stages) + 2 * ("finetune" in stages and RECIPES[r].self_supervised)
                                 for r in recipes)
    progress = Progress(3 * baselines + args.seeds * per_seed, t0=time.perf_counter())
    plan = Plan(args.budget, args.smoke, stages, prepare_data(args.data_dir, args.smoke), runs, threads,
                args.ablation, tuple(args.quality_overrides), progress)
    command = "python launch/bench.py " + " ".join(sys.argv[1:])

    def record(figures: dict[str, Any]) -> None:
        figures["command"] = command
        if not args.no_csv:
            append_result("quality", figures, args.csv)
        print(f"[quality] row: {json.dumps({k: v for k, v in figures.items() if k != 'curve'})}", flush=True)

    t0 = progress.t0
    if baselines:
        record(bench_pixels(plan))
        record(bench_random_vit(plan))
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for stem in scratch:
            record(bench_scratch(seed, plan, stem))
        for name in recipes:
            print(f"[quality] {name}, seed {seed} ({time.perf_counter() - t0:.0f} s so far)", flush=True)
            record(bench_recipe(name, seed, plan))
    print(f"[quality] took {time.perf_counter() - t0:.0f} s; runs in {runs}, MLflow experiment {EXPERIMENT}")
    if not args.no_csv and Path(args.csv).resolve() == RESULTS_CSV.resolve():
        from benchmarks.render import render_page

        render_page()  # docs/benchmarks.md's table and docs/img/quality.png from the rows just written
