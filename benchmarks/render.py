"""docs/benchmarks.md from results/benchmarks.csv: the page is generated, never edited by hand.

    python launch/bench.py render     # also the last step of `make bench` (`launch/bench.py all`)

For each benchmark and each machine it shows the newest row: when, which versions, the exact command
and every figure it recorded; older rows stay in the CSV (the history) and are counted, not shown. Where one
benchmark measures different things by its arguments (`gpu`'s parts and models, `dino`'s recipe and backbone:
a lease runs each as its own row), the newest row of each subject is shown.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks import quality_render
from benchmarks.results import RESULTS_CSV, ROOT, figures_of

DOCS_PAGE = ROOT / "docs" / "benchmarks.md"
ORDER = ["model", "engine", "e2e", "loader", "preemption", "scale", "scale-mix", "gpu"]  # the page's order; others follow
ABOUT = {
    "model": "our ViT against timm's VisionTransformer: one training step (forward, backward, AdamW), "
             "images/s and MFU, same config and optimizer (`benchmarks/model.py`).",
    "engine": "the DeepSpeed engine (ZeRO 0-3) against a plain PyTorch loop on the same model, and what "
              "`train.check_finite` costs (`benchmarks/engine.py`).",
    "e2e": "JPEG shards -> train loader -> DeepSpeed step against the same step on synthetic tensors "
           "already on the device: does the data keep up (`benchmarks/e2e.py`).",
    "loader": "the train stream against torchvision's ImageFolder on the same JPEGs and the "
              "decode+transform ceiling, images/s and CPU ms per image, and (`u16x4`) the stream over 4-channel "
              "uint16 `.npy` arrays of the same size, its CPU ms per image against the RGB stream's "
              "(`benchmarks/loader.py`).",
    "preemption": "the per-step preemption agreement: one all-reduce of a flag over the ranks "
                  "(`benchmarks/preemption.py`).",
    "scale": "what 1, 2, 4, ... N nodes fetch and read per epoch and how many shards a global batch "
             "mixes, through the real order and partitions with no data (`benchmarks/scale.py`).",
    "scale-mix": "`scale --mix`: a mixture (data.sources) of several data sets, each at its weight in every "
                 "global batch: per source, its shards fetched over its own first epoch / its shard count at "
                 "1, 2, 4, ... N nodes, through the real mixture order with no data (`benchmarks/scale.py`).",
    "mae": "an MAE training step (75% of the patches masked, the 8 x 512 decoder on all tokens) against a "
           "supervised step on the same ViT: step times and the FLOP ratio `mae_flops` predicts (`benchmarks/mae.py`).",
    "dino": "a DINOv2 training step (the objective's loss and teacher EMA: 2 global + 8 local crops, iBOT masks, "
            "heads of 65,536 prototypes), or DINOv3's (`--dino-recipe dinov3`: RoPE backbone, 2 x 256 + 8 x 112 "
            "crops, heads of 262,144 and 98,304 prototypes), against a supervised step on the same backbone: step "
            "times, and the FLOPs per image the objective's `flops_per_image` predicts against those PyTorch's "
            "FlopCounterMode counts over a step (`benchmarks/dino.py`).",
    "syncs": "device-to-host reads per non-log training step of each recipe at ZeRO-1 and ZeRO-3, through the "
             "real trainer (tiny model, bf16, one process), reads of host-side tensors by design apart "
             "(`benchmarks/syncs.py`, docs/performance.md: Host reads).",
    "distill": "a distillation step (the objective's loss: the frozen teacher's forward, each student's, the "
               "feature loss) with one ViT student and with two on one teacher forward, against two runs of one: "
               "step times and the FLOP ratio `flops_per_image` predicts (`benchmarks/distill.py`).",
    "gpu": "training MFU of ViT-B/16 and L/16 on one GPU, end to end from JPEG shards, bf16 and nvjpeg "
           "checks (`benchmarks/gpu.py`).",
}


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Nested figures as (dotted key, text) pairs; lists stay one cell."""
    if isinstance(value, dict):
        out: list[tuple[str, str]] = []
        for key, sub in value.items():
            out += _flatten(sub, f"{prefix}.{key}" if prefix else str(key))
        return out
    text = json.dumps(value) if isinstance(value, list) else ("n/a" if value is None else str(value))
    return [(prefix, text)]


def _subject(bench: str, figures: dict[str, Any]) -> str:
    """What a row measured where one benchmark measures different things: '' for the others."""
    if bench == "gpu":
        models = sorted({m for part in ("training", "e2e") for m in figures.get(part) or {}
                         if "@" in m} | {f"{f['variant']}@{f['res']}" for f in (figures.get("e2e") or {}).values()
                                          if isinstance(f, dict) and "variant" in f})
        return " ".join(["parts " + ",".join(figures.get("parts") or []), *models]).strip()
    if bench == "dino":
        return f"{figures.get('recipe', 'dinov2')} {figures.get('variant', '')}".strip()
    return ""


def render(rows: list[dict[str, str]]) -> str:
    """The page's text for these CSV rows (in file order: the last row of a machine is its newest); the quality
    rows are one table of their own and a picture (benchmarks/quality_render.py)."""
    by_bench: dict[str, dict[str, list[dict[str, str]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row["bench"] == "quality":
            continue
        subject = _subject(row["bench"], figures_of(row))
        by_bench[row["bench"]][row["hardware"] + (f": {subject}" if subject else "")].append(row)
    names = [n for n in ORDER if n in by_bench] + sorted(n for n in by_bench if n not in ORDER)
    out = ["# Benchmarks", "",
           f"Generated by `python launch/bench.py render` from `{RESULTS_CSV.relative_to(ROOT)}` "
           "(`make bench` runs every benchmark, appends its rows and renders this page): do not edit it by "
           "hand. For each benchmark and machine, the newest row; the CSV keeps every earlier one.", ""]
    out += ["| benchmark | machine | date | rows |", "| --- | --- | --- | --- |"]
    quality = [r for r in rows if r["bench"] == "quality"]
    if quality:
        out.append(f"| [quality](#quality) | {quality[-1]['hardware'].replace('|', '/')} | {quality[-1]['date']} | "
                   f"{len(quality)} |")
    for name in names:
        for hardware, runs in by_bench[name].items():
            out.append(f"| [{name}](#{name}) | {hardware.replace('|', '/')} | {runs[-1]['date']} | {len(runs)} |")
    for name in names:
        out += ["", f"## {name}", ""]
        if name in ABOUT:
            out += [ABOUT[name][0].upper() + ABOUT[name][1:], ""]
        for hardware, runs in by_bench[name].items():
            row = runs[-1]
            out += [f"### {hardware}", "",
                    f"{row['date']}, torch {row['torch']}, DeepSpeed {row['deepspeed']}"
                    + (f" ({len(runs) - 1} earlier row(s) in the CSV)" if len(runs) > 1 else ""), "",
                    "```", row["command"], "```", "", "| figure | value |", "| --- | --- |"]
            out += [f"| `{key}` | {text.replace('|', '/')} |" for key, text in _flatten(figures_of(row))]
    out += quality_render.section(rows)
    return "\n".join(out) + "\n"


def render_page(csv_path: Path = RESULTS_CSV, page: Path = DOCS_PAGE) -> int:
    """Write the page; 0, or 1 with one line when the CSV is missing or not the expected columns."""
    try:
        with open(csv_path, newline="") as f:
            rows = list(csv.DictReader(f))
    except FileNotFoundError:
        print(f"error: {csv_path} does not exist: run a benchmark first (python launch/bench.py loader)")
        return 1
    missing = {"date", "hardware", "torch", "deepspeed", "command", "bench", "figures"} - set(rows[0] if rows else {})
    if missing:
        print(f"error: {csv_path} lacks the column(s) {', '.join(sorted(missing))}")
        return 1
    page.parent.mkdir(parents=True, exist_ok=True)
    quality_render.draw(rows, page.parent / quality_render.PICTURE)
    page.write_text(render(rows))
    print(f"wrote {page} ({len(rows)} rows of {csv_path})")
    return 0
