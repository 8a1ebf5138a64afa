#!/usr/bin/env python
"""Benchmarks: print a table and append one row per benchmark to results/benchmarks.csv.

    python launch/bench.py loader          # train stream vs ImageFolder vs the decode+transform ceiling
    python launch/bench.py {model,engine,e2e}
    python launch/bench.py gpu             # the GPU figures (B/16, L/16, B/16@384; e2e; checks); needs a GPU
    python launch/bench.py preemption      # the per-step preemption agreement (2 ranks, one all-reduce)
    python launch/bench.py scale --nodes 512   # what 1..512 nodes fetch and read per epoch (order only, no data)
    python launch/bench.py scale --mix web=0.5:6000,books=0.3:3000,rare=0.2:1000   # a mixture, per source
    python launch/bench.py fetch           # local disk vs rate-limited HTTP, with and without fetch ahead
    python launch/bench.py mae             # an MAE step against a supervised one on the same ViT-B/16
    python launch/bench.py dino            # a DINOv2 step against a supervised one on the same backbone
    python launch/bench.py syncs           # host reads per training step, per recipe and ZeRO stage
    python launch/bench.py dino-ops        # aten ops per DINOv2/DINOv3 micro step, per-crop and fused
    python launch/bench.py distill         # distillation: 1 and 2 students on one teacher forward vs 2 runs of one
    python launch/bench.py quality         # every recipe trained on Fashion-MNIST and judged (about an hour each on CPU)
    python launch/bench.py all             # every benchmark (gpu only where there is a GPU), then render
    python launch/bench.py render          # docs/benchmarks.md from results/benchmarks.csv
    python launch/bench.py merge FILE.csv  # the rows of a copy from another machine, then render

This file is the entry point; the benchmarks live in benchmarks/, outside the installed package.
The CSV has the columns date, hardware, torch, deepspeed, command, bench, figures (a JSON
object), so rows from different machines and versions can be compared.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.render import DOCS_PAGE, render_page  # noqa: E402
from benchmarks.results import RESULTS_CSV, ROOT, append_result, merge_results, print_table  # noqa: E402

# ----------------------------------------------------------------------------- the benchmarks
# Each lives in benchmarks/ and is imported only when it runs: name -> (module, function, flags
# function, one-line help). The function takes the parsed flags (and `print_table` where it prints
# a table) and returns the figures; `main` appends the row. model/engine/e2e/gpu share benchmarks/cli.py.


class Bench(NamedTuple):
    module: str
    function: str
    add_args: str
    help: str
    prints_table: bool = False  # the function takes `print_table` as its second argument
    in_all: bool = True  # `all` runs it (quality takes hours: `make bench-quality` alone)


BENCHES: dict[str, Bench] = {
    "loader": Bench("loader", "bench_loader", "add_loader_args",
                    "Train stream vs torchvision ImageFolder vs the decode+transform ceiling, images/s."),
    "model": Bench("cli", "run_model", "add_model_args", "Training step images/s and MFU, ours vs timm's "
                   "VisionTransformer (same config and optimizer).", prints_table=True),
    "engine": Bench("cli", "run_engine", "add_engine_args", "DeepSpeed ZeRO 0-3 step vs a plain PyTorch loop "
                    "(same model, optimizer, dtype); check_finite cost.", prints_table=True),
    "e2e": Bench("cli", "run_e2e", "add_e2e_args", "Shards -> train loader -> DeepSpeed step vs synthetic tensors "
                 "on the device: does data keep up?", prints_table=True),
    "gpu": Bench("cli", "run_gpu", "add_gpu_args", "GPU figures: training MFU of B/16 and L/16, end to end from "
                 "JPEG shards, bf16 and nvjpeg checks.", prints_table=True),
    "preemption": Bench("preemption", "bench_preemption", "add_preemption_args", "The per-step preemption "
                        "agreement (one all-reduce of a flag over a CPU group), in microseconds."),
    "scale": Bench("scale", "bench_scale", "add_scale_args", "What 1, 2, 4, ... N nodes fetch and read per "
                   "epoch: the real order and partitions, no data."),
    "fetch": Bench("fetch", "bench_fetch", "add_fetch_args", "Training steps fed from local disk vs "
                   "rate-limited HTTP with and without fetch ahead: images/s, data wait.", prints_table=True),
    "mae": Bench("mae", "bench_mae", "add_mae_args", "An MAE training step (75%% masked, 8 x 512 decoder) against "
                 "a supervised one on the same ViT."),
    "dino": Bench("dino", "bench_dino", "add_dino_args", "A DINOv2 training step (2 global + 8 local crops, "
                  "teacher, heads) against a supervised one on the same backbone; FLOPs predicted vs counted."),
    "syncs": Bench("syncs", "bench_syncs", "add_syncs_args", "Device-to-host reads per non-log training step, "
                   "per recipe at ZeRO-1 and ZeRO-3 (host-side reads by design apart)."),
    "dino-ops": Bench("dino_ops", "bench_dino_ops", "add_dino_ops_args", "aten ops dispatched per DINOv2/DINOv3 "
                      "micro step, per-crop (before issue 58) and fused."),
    "distill": Bench("distill", "bench_distill", "add_distill_args", "A distillation step with 1 and with 2 "
                     "students on one teacher forward, against 2 runs of one."),
    "quality": Bench("quality", "bench_quality", "add_quality_args", "Every recipe trained on Fashion-MNIST and "
                     "judged: k-NN over time, k-NN and linear probe (all and 1%% of the labels), fine-tunes with 10%% "
                     "and 100%%, against raw pixels and a random ViT; a row per recipe and seed.", in_all=False),
}


def _function(name: str, attr: str) -> Callable[..., Any]:
    return getattr(importlib.import_module(f"benchmarks.{BENCHES[name].module}"), attr)


def run_bench(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run benchmark `name` with the parsed flags; its figures."""
    fn = _function(name, BENCHES[name].function)
    return fn(args, print_table) if BENCHES[name].prints_table else fn(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-csv", action="store_true", help=f"do not append to {RESULTS_CSV.relative_to(ROOT)}")
    p.add_argument("--csv", type=Path, default=RESULTS_CSV, help="append the row to this file instead (SMOKE=1 "
                   "bash launch/gpu_bench.sh: the CPU smoke's rows go to its DEST, not to the repository's CSV)")
    sub = p.add_subparsers(dest="bench", required=True)
    for name, bench in BENCHES.items():
        _function(name, bench.add_args)(sub.add_parser(name, help=bench.help))
    sp = sub.add_parser("all", help="every implemented benchmark with its defaults, then `render`")
    for name, bench in BENCHES.items():
        if bench.in_all:
            _function(name, bench.add_args)(sp)
    sub.add_parser("render", help=f"write {DOCS_PAGE.relative_to(ROOT)} from {RESULTS_CSV.relative_to(ROOT)}")
    mp = sub.add_parser("merge", help=f"append the rows of other copies of the CSV (from a GPU machine, say) that "
                        f"{RESULTS_CSV.relative_to(ROOT)} lacks, then `render`")
    mp.add_argument("files", nargs="+", type=Path, metavar="FILE.csv")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.bench == "render":
        return render_page()
    if args.bench == "merge":
        try:
            added = merge_results(args.files)
        except (OSError, ValueError) as e:
            print(f"bench merge: {e}", file=sys.stderr)
            return 2
        print(f"merged {added} new row(s) into {RESULTS_CSV.relative_to(ROOT)}")
        return render_page()
    names = [n for n, b in BENCHES.items() if b.in_all] if args.bench == "all" else [args.bench]
    status = 0
    for name in names:
        print(f"== bench {name}")
        try:
            figures = run_bench(name, args)
        except NotImplementedError as e:
            print(f"skipped: {e}")
            if args.bench != "all":
                status = 2
            continue
        if figures is None:  # the benchmark appended its own rows as it measured them (quality)
            continue
        row = figures.pop("bench", name)  # a variant files its rows under its own name (scale --mix: scale-mix)
        if not args.no_csv:
            append_result(row, figures, args.csv)
    if args.bench == "all" and not args.no_csv:
        render_page()
    return status


if __name__ == "__main__":
    sys.exit(main())
