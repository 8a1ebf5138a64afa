"""results/benchmarks.csv: one row per benchmark run, with the machine, the versions and the command.

The columns are date, hardware, torch, deepspeed, command, bench, figures (a JSON object), so rows from
different machines and versions can be compared; `benchmarks.render` turns them into docs/benchmarks.md.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_CSV = ROOT / "results" / "benchmarks.csv"
CSV_COLUMNS = ["date", "hardware", "torch", "deepspeed", "command", "bench", "figures"]


def hardware() -> str:
    """'2x Intel Xeon ... / 24 GiB' plus the GPU when there is one."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        text = f"{cores}x {cpu} / {mem:.0f} GiB"
    except (ValueError, OSError):
        text = f"{cores}x {cpu}"
    import torch
    if torch.cuda.is_available():
        text += f" / {torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return text


def versions() -> tuple[str, str]:
    import torch
    try:
        from importlib.metadata import version
        ds = version("deepspeed")
    except Exception:
        ds = "n/a"
    return torch.__version__, ds


def append_result(bench: str, figures: dict[str, Any], path: Path = RESULTS_CSV) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    torch_v, ds_v = versions()
    row = {"date": dt.datetime.now().isoformat(timespec="seconds"), "hardware": hardware(), "torch": torch_v,
           "deepspeed": ds_v, "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
           "bench": bench, "figures": json.dumps(figures, sort_keys=False)}
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        if new:
            writer.writeheader()
        writer.writerow(row)
    print(f"appended to {path}")


def merge_results(sources: list[Path], path: Path = RESULTS_CSV) -> int:
    """Append the rows of other copies of the CSV (one that came back from a GPU machine, say) that `path`
    lacks; a row is the same row when every column matches. Returns how many were appended."""
    def read(p: Path) -> list[dict[str, str]]:
        with open(p, newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames != CSV_COLUMNS:
                raise ValueError(f"{p}: columns {reader.fieldnames}, expected {CSV_COLUMNS}")
            return list(reader)

    have = {tuple(r[c] for c in CSV_COLUMNS) for r in read(path)} if path.exists() else set()
    new = not path.exists() or path.stat().st_size == 0
    added = 0
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        if new:
            writer.writeheader()
        for source in sources:
            for row in read(source):
                key = tuple(row[c] for c in CSV_COLUMNS)
                if key not in have:
                    writer.writerow(row)
                    have.add(key)
                    added += 1
    return added


def print_table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    cells = [header] + [[f"{c:.1f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for i, r in enumerate(cells):
        print("  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def figures_of(row: dict[str, str]) -> dict[str, Any]:
    """A row's figures as a dict (a value that is not a JSON object is kept under one key, shown as it is)."""
    try:
        figures = json.loads(row["figures"])
    except ValueError:
        return {"figures (not JSON)": row["figures"]}
    return figures if isinstance(figures, dict) else {"figures": figures}

