#!/usr/bin/env python
"""Benchmarks: print a table and append one row per benchmark to results/benchmarks.csv.

    python launch/bench.py loader          # train stream vs ImageFolder vs the decode+transform ceiling
    python launch/bench.py {model,engine,e2e}
    python launch/bench.py gpu             # the GPU figures (B/16, L/16, B/16@384; e2e; checks); needs a GPU
    python launch/bench.py preemption      # the per-step preemption agreement (2 ranks, one all-reduce)
    python launch/bench.py scale --nodes 512   # what 1..512 nodes fetch and read per epoch (order only, no data)
    python launch/bench.py fetch           # local disk vs rate-limited HTTP, with and without fetch ahead
    python launch/bench.py mae             # an MAE step against a supervised one on the same ViT-B/16
    python launch/bench.py all             # every benchmark (gpu only where there is a GPU), then render
    python launch/bench.py render          # docs/benchmarks.md from results/benchmarks.csv

This file is the entry point; the benchmarks live in benchmarks/, outside the installed package.
The CSV has the columns date, hardware, torch, deepspeed, command, bench, figures (a JSON
object), so rows from different machines and versions can be compared.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.render import DOCS_PAGE, render_page  # noqa: E402
from benchmarks.results import RESULTS_CSV, ROOT, append_result, print_table  # noqa: E402

# ----------------------------------------------------------------------------- the benchmarks
# Each lives in benchmarks/ (flags, presets and tables of model/engine/e2e/gpu in benchmarks/cli.py);
# each `bench_<name>(args) -> dict` returns the figures and `main` appends the row.


def bench_loader(args: argparse.Namespace) -> dict[str, Any]:
    """Train stream vs torchvision ImageFolder vs the decode+transform ceiling, images/s."""
    from benchmarks.loader import bench_loader as run

    return run(args)


def bench_scale(args: argparse.Namespace) -> dict[str, Any]:
    """What 1, 2, 4, ... N nodes fetch and read per epoch: the real order and partitions, no data."""
    from benchmarks.scale import bench_scale as run

    return run(args)


def bench_fetch(args: argparse.Namespace) -> dict[str, Any]:
    """Training steps fed from local disk vs rate-limited HTTP with and without fetch ahead: images/s, data wait."""
    from benchmarks.fetch import bench_fetch as run

    return run(args, print_table)


def bench_preemption(args: argparse.Namespace) -> dict[str, Any]:
    """The per-step preemption agreement (one all-reduce of a flag over a CPU group), in microseconds."""
    from benchmarks.preemption import bench_preemption as run

    return run(args)


def bench_mae(args: argparse.Namespace) -> dict[str, Any]:
    """An MAE training step (75% masked, 8 x 512 decoder) against a supervised one on the same ViT."""
    from benchmarks.mae import bench_mae as run

    return run(args)


def bench_model(args: argparse.Namespace) -> dict[str, Any]:
    """Training step images/s and MFU, ours vs timm's VisionTransformer (same config and optimizer)."""
    from benchmarks.cli import run_model

    return run_model(args, print_table)


def bench_engine(args: argparse.Namespace) -> dict[str, Any]:
    """DeepSpeed ZeRO 0-3 step vs a plain PyTorch loop (same model, optimizer, dtype); check_finite cost."""
    from benchmarks.cli import run_engine

    return run_engine(args, print_table)


def bench_e2e(args: argparse.Namespace) -> dict[str, Any]:
    """Shards -> train loader -> DeepSpeed step vs synthetic tensors on the device: does data keep up?"""
    from benchmarks.cli import run_e2e

    return run_e2e(args, print_table)


def bench_gpu(args: argparse.Namespace) -> dict[str, Any]:
    """GPU figures: training MFU of B/16 and L/16, end to end from JPEG shards, bf16 and nvjpeg checks."""
    from benchmarks.cli import run_gpu

    return run_gpu(args, print_table)


# ----------------------------------------------------------------------------- dispatcher

BENCHES: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "loader": bench_loader, "model": bench_model, "engine": bench_engine, "e2e": bench_e2e, "gpu": bench_gpu,
    "preemption": bench_preemption, "scale": bench_scale, "fetch": bench_fetch, "mae": bench_mae,
}


def _bench_args(module: str, name: str) -> Callable[[argparse.ArgumentParser], None]:
    def add(p: argparse.ArgumentParser) -> None:
        import importlib

        getattr(importlib.import_module(f"benchmarks.{module}"), f"add_{name}_args")(p)
    return add


ARGS: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "loader": _bench_args("loader", "loader"), "preemption": _bench_args("preemption", "preemption"),
    "scale": _bench_args("scale", "scale"), "fetch": _bench_args("fetch", "fetch"), "mae": _bench_args("mae", "mae"),
    **{name: _bench_args("cli", name) for name in ("model", "engine", "e2e", "gpu")}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-csv", action="store_true", help=f"do not append to {RESULTS_CSV.relative_to(ROOT)}")
    sub = p.add_subparsers(dest="bench", required=True)
    for name in BENCHES:
        sp = sub.add_parser(name, help=(BENCHES[name].__doc__ or name).strip().splitlines()[0])
        if name in ARGS:
            ARGS[name](sp)
    sp = sub.add_parser("all", help="every implemented benchmark with its defaults, then `render`")
    for add in ARGS.values():
        add(sp)
    sub.add_parser("render", help=f"write {DOCS_PAGE.relative_to(ROOT)} from {RESULTS_CSV.relative_to(ROOT)}")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.bench == "render":
        return render_page()
    names = list(BENCHES) if args.bench == "all" else [args.bench]
    status = 0
    for name in names:
        print(f"== bench {name}")
        try:
            figures = BENCHES[name](args)
        except NotImplementedError as e:
            print(f"skipped: {e}")
            if args.bench != "all":
                status = 2
            continue
        if not args.no_csv:
            append_result(name, figures)
    if args.bench == "all" and not args.no_csv:
        render_page()
    return status


if __name__ == "__main__":
    sys.exit(main())
