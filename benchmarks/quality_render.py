"""The quality rows of results/benchmarks.csv as docs/benchmarks.md's table and docs/img/quality.png (k-NN top-1
against wall time): what `bench.py render` draws for `bench.py quality` (benchmarks/quality.py).

A recipe's figure is the mean over its seeds, with the spread (half the range) after it: the newest row of each
seed among the rows measured with the newest row's preset (`preset_sha`), so a preset changed since is never
averaged with the runs of the old one.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.results import figures_of

PICTURE = "img/quality.png"  # from docs/benchmarks.md: docs/img/quality.png
ORDER = ("pixels", "random-vit", "supervised", "mae", "dinov2", "dinov3", "scratch", "scratch-patch")
LABELS = {"pixels": "raw pixels", "random-vit": "ViT, random weights", "scratch": "ViT from random weights",
          "scratch-patch": "ViT from random weights, patchify stem"}
COLUMNS = (("knn", "k-NN"), ("linear", "linear"), ("knn_1pct", "k-NN 1%"), ("linear_1pct", "linear 1%"),
           ("top1", "top-1"), ("ft10", "fine-tune 10%"), ("ft100", "fine-tune 100%"))
PUBLISHED = (("2-layer conv net", 91.6), ("ResNet18", 94.9), ("WRN-28-10", 95.9), ("WRN-40-4", 96.7))
"""Fashion-MNIST's own benchmark table (github.com/zalandoresearch/fashion-mnist, README, "Benchmark"): test top-1."""
TARGETS = (  # issue 69, CPU budget: (what, recipe, figure, at least, against: (recipe, figure) + points or None)
    ("supervised ViT from scratch >= the 2-layer conv net", "supervised", "top1", 0.916, None),
    ("DINOv2 k-NN >= 85%", "dinov2", "knn", 0.85, None),
    ("DINOv2 linear >= 87%", "dinov2", "linear", 0.87, None),
    ("DINOv2 linear, 1% of the labels >= 80%", "dinov2", "linear_1pct", 0.80, None),
    ("DINOv3 k-NN >= 85%", "dinov3", "knn", 0.85, None),
    ("DINOv3 linear >= 87%", "dinov3", "linear", 0.87, None),
    ("DINOv3 linear, 1% of the labels >= 80%", "dinov3", "linear_1pct", 0.80, None),
    # each against the fine-tune from random weights of its own architecture: MAE's preset has the patchify stem
    ("MAE fine-tuned, 10% of the labels >= scratch + 3", "mae", "ft10", 0.03, ("scratch-patch", "ft10")),
    ("DINOv2 fine-tuned, 10% of the labels >= scratch + 3", "dinov2", "ft10", 0.03, ("scratch", "ft10")),
    ("DINOv3 fine-tuned, 10% of the labels >= scratch + 3", "dinov3", "ft10", 0.03, ("scratch-patch", "ft10")),
)


def latest(rows: list[dict[str, str]]) -> dict[tuple[str, bool], dict[str, list[dict[str, Any]]]]:
    """{(budget, smoke): {recipe: the figures of its newest preset, one per seed}} of the quality rows."""
    grouped: dict[tuple[str, bool], dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row["bench"] == "quality" and (f := figures_of(row)).get("recipe"):
            name = f["recipe"] + (f" ({f['ablation']})" if f.get("ablation") else "")  # an ablation: a line apart
            grouped[(f.get("budget", "cpu"), bool(f.get("smoke")))][name].append(dict(f, date=row["date"],
                                                                                   hardware=row["hardware"]))
    out: dict[tuple[str, bool], dict[str, list[dict[str, Any]]]] = {}
    for key, recipes in grouped.items():
        out[key] = {}
        for recipe, found in recipes.items():
            newest = found[-1].get("preset_sha")
            seeds: dict[Any, dict[str, Any]] = {}
            for f in found:
                if f.get("preset_sha") == newest:
                    seeds[f.get("seed", 0)] = f  # file order: the newest row of each seed wins
            out[key][recipe] = list(seeds.values())
    return out


def values_of(runs: list[dict[str, Any]], key: str) -> list[float]:
    """The figure `key` of each run that has it."""
    return [float(r[key]) for r in runs if r.get(key) is not None]


def mean_spread(values: list[float]) -> tuple[float, float]:
    return sum(values) / len(values), (max(values) - min(values)) / 2


def cell(runs: list[dict[str, Any]], key: str) -> str:
    values = values_of(runs, key)
    if not values:
        return ""
    mean, spread = mean_spread(values)
    return f"{100 * mean:.1f}" + (f" ± {100 * spread:.1f}" if len(values) > 1 else "")


def _minutes(runs: list[dict[str, Any]], key: str) -> str:
    values = values_of(runs, key)
    return f"{sum(values) / len(values) / 60:.0f} min" if values else ""


def table(recipes: dict[str, list[dict[str, Any]]]) -> list[str]:
    # The baselines and recipes in ORDER, each recipe's ablations after it ("dinov2 (no-ibot)").
    names = sorted(recipes, key=lambda n: (ORDER.index(n.split(" ")[0]) if n.split(" ")[0] in ORDER else len(ORDER),
                                           n))
    out = ["| recipe | seeds | steps (epochs) | pretraining | " + " | ".join(t for _, t in COLUMNS) + " |",
           "| --- | --- | --- | --- | " + " | ".join("---" for _ in COLUMNS) + " |"]
    for name in names:
        runs = recipes[name]
        first = runs[-1]
        steps = f"{first['steps']} ({first['epochs']})" if "epochs" in first else str(first.get("steps", ""))
        seeds = str(len(runs)) if "seed" in first else ""
        out.append(f"| {LABELS.get(name, name)} | {seeds} | {steps} | {_minutes(runs, 'pretrain_s')} | "
                   + " | ".join(cell(runs, k) for k, _ in COLUMNS) + " |")
    return out


def targets(recipes: dict[str, list[dict[str, Any]]]) -> list[str]:
    out = ["| target | measured | met |", "| --- | --- | --- |"]
    for what, recipe, key, at_least, against in TARGETS:
        values = values_of(recipes.get(recipe, []), key)
        if not values:
            out.append(f"| {what} | not measured | |")
            continue
        mean = sum(values) / len(values)
        if against is None:
            out.append(f"| {what} | {100 * mean:.1f}% | {'yes' if mean >= at_least else 'no'} |")
            continue
        base = values_of(recipes.get(against[0], []), against[1])
        if not base:
            out.append(f"| {what} | {100 * mean:.1f}%, no {against[0]} row | |")
            continue
        gain = mean - sum(base) / len(base)
        out.append(f"| {what} | {100 * gain:+.1f} points | {'yes' if gain >= at_least else 'no'} |")
    return out


def curves(rows: list[dict[str, str]], budget: str = "cpu") -> list[tuple[str, dict[str, Any]]]:
    """(recipe, figures) of every run with a k-NN curve in the table's rows of `budget` (not smoke): the picture's."""
    recipes = latest(rows).get((budget, False), {})
    return [(name, r) for name, found in recipes.items() for r in found if r.get("curve")]


def section(rows: list[dict[str, str]]) -> list[str]:
    """docs/benchmarks.md's quality section ([] without quality rows); it shows PICTURE where there are curves."""
    groups = latest(rows)
    if not groups:
        return []
    out = ["", "## quality", "",
           "Every recipe trained on Fashion-MNIST (60,000 train images, judged on the 10,000 test images, never "
           "trained on) and judged as the field judges it (`benchmarks/quality.py`): k-NN (k=20, the whole train "
           "split as the bank) and linear probe on the frozen features, with all and with 1% of the labels; "
           "fine-tuned with 10% and 100% of the labels against the same fine-tune from random weights; beside "
           "them the raw pixels and the same ViT at its random initialisation, measured by the same code. "
           "Figures are top-1 %, the mean over seeds ± half their range.", ""]
    for (budget, smoke), recipes in sorted(groups.items()):
        newest = max((r for runs in recipes.values() for r in runs), key=lambda r: r["date"])
        out += [f"### {budget} budget" + (" (smoke: a few steps, the code and not a figure)" if smoke else ""), "",
                f"{newest['hardware']}, {newest['date']}; the command of the newest row:", "", "```",
                newest.get("command", ""), "```", ""]
        out += table(recipes) + [""]
        ablations = {n: runs[-1]["overrides"] for n, runs in recipes.items() if runs[-1].get("overrides")}
        if ablations:
            out += ["Ablations (the preset with these overrides; `bench.py quality --ablation NAME --set KEY=VALUE`):",
                    ""] + [f"- {n}: " + ", ".join(f"`{o}`" for o in ov) for n, ov in sorted(ablations.items())] + [""]
        if not smoke and budget == "cpu":
            out += ["Targets (issue 69, CPU budget):", ""] + targets(recipes) + [""]
    out += ["Published (Fashion-MNIST's benchmark table, test top-1): "
            + ", ".join(f"{name} {acc}%" for name, acc in PUBLISHED) + ".", ""]
    if curves(rows):
        out += [f"![k-NN top-1 against wall time]({PICTURE})", "",
                "k-NN top-1 on the test images against pretraining wall time: during training the memory is the "
                "first 10,000 train images (eval.sets), the last point of each run (a dot) is evaluate.py's on "
                "all 60,000; the raw pixels' k-NN is the dashed line.", ""]
    return out


def draw(rows: list[dict[str, str]], path: Path, budget: str = "cpu") -> bool:
    """docs/img/quality.png: every run's k-NN curve against minutes of pretraining; False without curves."""
    recipes = latest(rows).get((budget, False), {})
    runs = curves(rows, budget)
    if not runs:
        return False
    try:
        import matplotlib
    except ImportError:  # a GPU lease's image may lack it: the committed picture stays as it is
        print(f"warning: no matplotlib here: {path} not redrawn (pip install matplotlib)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    colours: dict[str, Any] = {}
    for name, r in runs:
        xs = [p[1] / 60 for p in r["curve"]]
        ys = [100 * p[2] for p in r["curve"]]
        line = ax.plot(xs, ys, marker=".", color=colours.get(name), label=None if name in colours else name)[0]
        colours[name] = line.get_color()
        if r.get("knn") is not None and r.get("pretrain_s"):
            ax.plot([r["pretrain_s"] / 60], [100 * r["knn"]], "o", color=colours[name])
    for name, style in (("pixels", "--"), ("random-vit", ":")):
        for r in recipes.get(name, [])[-1:]:
            ax.axhline(100 * r["knn"], linestyle=style, color="grey", label=f"{LABELS[name]} (k-NN)")
    ax.set_xlabel("pretraining wall time (minutes)")
    ax.set_ylabel("k-NN top-1 on the test images (%)")
    hardware = runs[-1][1].get("hardware", "")
    ax.set_title(f"Fashion-MNIST, {budget} budget ({hardware})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True
