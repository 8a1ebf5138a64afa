#!/usr/bin/env python
"""Benchmarks: print a table and append one row per benchmark to results/benchmarks.csv.

    python launch/bench.py loader          # train stream vs ImageFolder vs the decode+transform ceiling
    python launch/bench.py {model,engine,e2e}
    python launch/bench.py gpu             # the GPU figures (B/16, L/16, B/16@384; e2e; checks); needs a GPU
    python launch/bench.py preemption      # the per-step preemption agreement (2 ranks, one all-reduce)
    python launch/bench.py scale --nodes 512   # what 1..512 nodes fetch and read per epoch (order only, no data)
    python launch/bench.py all             # every benchmark (gpu only where there is a GPU)

The CSV has the columns date, hardware, torch, deepspeed, command, bench, figures (a JSON
object), so rows from different machines and versions can be compared.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import io
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent
RESULTS_CSV = ROOT / "results" / "benchmarks.csv"
CSV_COLUMNS = ["date", "hardware", "torch", "deepspeed", "command", "bench", "figures"]


# ----------------------------------------------------------------------------- shared helpers


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


def print_table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    cells = [header] + [[f"{c:.1f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for i, r in enumerate(cells):
        print("  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


# ----------------------------------------------------------------------------- loader


def _write_bench_data(folder: Path, images: int, size: int, classes: int) -> tuple[Path, Path]:
    """Synthetic JPEG shards and the very same JPEG files as an ImageFolder tree."""
    from pipeline.data import read_dataset_info, tario
    from pipeline.data.shards import synthetic_source, write_dataset

    shards = folder / "shards"
    write_dataset(synthetic_source(images, classes, size, val_fraction=0.0), shards,
                  max_samples_per_shard=128, workers=min(2, os.cpu_count() or 1), progress=False)
    files = folder / "files"
    for shard in read_dataset_info(shards).splits["train"].shards:
        for raw in tario.iter_raw_samples(shard):
            label = tario.parse_label(raw, "cls")
            (files / f"class_{label:03d}").mkdir(parents=True, exist_ok=True)
            (files / f"class_{label:03d}" / f"{raw.key}.jpg").write_bytes(raw.members["jpg"])
    return shards, files


def _worker_pids(dl_iter: Any) -> list[int]:
    return [w.pid for w in getattr(dl_iter, "_workers", [])]  # torch's multi-process iterator


def _rate(it: Any, n_batches: int, pids: list[int], ready: int) -> tuple[float, float]:
    """(images/s, CPU ms per image) over n_batches of an already started iterator.

    Workers fill their prefetch queue (`ready` batches) while another loader is being timed;
    those are taken first, untimed, so that timing starts when the workers start afresh.
    """
    from pipeline.bench.common import cpu_seconds

    for _ in range(ready):
        next(it)
    c0, t0 = cpu_seconds(pids), time.perf_counter()
    n = 0
    for _ in range(n_batches):
        n += len(next(it)[0])
    wall, cpu = time.perf_counter() - t0, cpu_seconds(pids) - c0
    return n / wall, 1e3 * cpu / n


def _ceiling(blobs: list[bytes], transform: Callable[[Any], Any]) -> tuple[float, float]:
    """Decode + transform in a tight loop in this process, one thread (as in a DataLoader worker)."""
    import torch
    from PIL import Image

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        c0, t0 = time.process_time(), time.perf_counter()
        for b in blobs:
            transform(Image.open(io.BytesIO(b)).convert("RGB"))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return len(blobs) / wall, 1e3 * cpu / len(blobs)
    finally:
        torch.set_num_threads(threads)


def bench_loader(args: argparse.Namespace) -> dict[str, Any]:
    """Train stream vs torchvision ImageFolder vs the decode+transform ceiling, images/s.

    Each figure is the best of --rounds interleaved measurements (stream, ImageFolder, ceiling,
    stream, ...), so that load from other processes on a shared machine hits all three alike.
    """
    import torch
    import torchvision

    from pipeline.config import DataConfig
    from pipeline.data import build_train_loader
    from pipeline.data.transforms import BatchNormalizer, train_transform

    t_start = time.perf_counter()
    workers = [int(w) for w in args.workers.split(",")]
    batch, crop = args.batch_size, args.crop
    n_batches = max(1, args.images_measured // batch)
    with tempfile.TemporaryDirectory(prefix="bench-loader-", dir=args.tmp) as tmp:
        t0 = time.perf_counter()
        shards, files = _write_bench_data(Path(tmp), args.images, args.size, args.classes)
        print(f"wrote {args.images} {args.size}x{args.size} JPEGs as shards and as files in "
              f"{time.perf_counter() - t0:.1f} s")
        # The reference transform: timm's, per image, ending in ToTensor + Normalize (float32).
        transform = train_transform(DataConfig(), (crop, crop), to_float=True)
        print(f"transform: {transform}".replace("\n", " "))
        # The stream's own per-image work: timm's transform to uint8, then the fused normalisation.
        to_uint8, normalize = train_transform(DataConfig(), (crop, crop)), BatchNormalizer((0.5,) * 3, (0.5,) * 3)
        buffer = torch.empty(3, crop, crop)

        def same_path(img: Any) -> Any:
            return normalize(to_uint8(img), out=buffer)

        blobs = [p.read_bytes() for p in sorted(files.rglob("*.jpg"))[:args.ceiling_images]]
        _ceiling(blobs[:8], transform)  # lazy imports, caches
        _ceiling(blobs[:8], same_path)
        rows, figures = [], {"images": args.images, "size": args.size, "crop": crop, "batch": batch,
                             "measured_images": n_batches * batch, "rounds": args.rounds}
        for w in workers:
            cfg = DataConfig(path=str(shards), num_workers=w, shuffle_span=args.shuffle_span,
                             prefetch_factor=args.prefetch)
            train = build_train_loader(cfg, crop, batch, seed=0)
            folder_loader = torch.utils.data.DataLoader(
                torchvision.datasets.ImageFolder(str(files), transform=transform), batch_size=batch,
                shuffle=True, num_workers=w, drop_last=True, persistent_workers=w > 0,
                prefetch_factor=args.prefetch if w > 0 else None,
                generator=torch.Generator().manual_seed(0))
            stream_it, folder_it = iter(train), _repeat(folder_loader)
            for it in (stream_it, folder_it):  # worker start-up is not part of the figures
                for _ in range(args.warmup):
                    next(it)
            stream_pids = _worker_pids(train._it)
            folder_pids = _worker_pids(folder_loader._iterator)
            best = {k: (0.0, 1e9) for k in ("stream", "folder", "single", "single_same_path")}
            for _ in range(args.rounds):
                ready = args.prefetch * max(1, w)
                for name, fig in (("stream", _rate(stream_it, n_batches, stream_pids, ready)),
                                  ("folder", _rate(folder_it, n_batches, folder_pids, ready)),
                                  ("single", _ceiling(blobs, transform)),
                                  ("single_same_path", _ceiling(blobs, same_path))):
                    best[name] = (max(best[name][0], fig[0]), min(best[name][1], fig[1]))
            amplification = train.read_amplification()  # all batches since the start, warmup included
            train.close()
            del stream_it, folder_it, folder_loader
            stream, folder = best["stream"][0], best["folder"][0]
            ceiling = best["single"][0] * max(1, w)
            ceiling_same = best["single_same_path"][0] * max(1, w)
            cpu = {k: v[1] for k, v in best.items()}
            rows.append([w, stream, folder, ceiling, ceiling_same, stream / ceiling, stream / ceiling_same,
                         stream / folder, amplification, cpu["stream"], cpu["folder"], cpu["single"],
                         cpu["single_same_path"]])
            figures[f"w{w}"] = {
                "stream_img_s": round(stream, 1), "imagefolder_img_s": round(folder, 1),
                "ceiling_img_s": round(ceiling, 1), "ceiling_same_path_img_s": round(ceiling_same, 1),
                "stream_vs_ceiling": round(stream / ceiling, 3),
                "stream_vs_ceiling_same_path": round(stream / ceiling_same, 3),
                "stream_vs_imagefolder": round(stream / folder, 3),
                "read_amplification": round(amplification, 3),
                "cpu_ms_per_img": {k: round(v, 3) for k, v in cpu.items()}}
    print_table(f"train stream, {args.size}px JPEG -> RandomResizedCrop {crop} + flip + normalise, "
                f"batch {batch}, images/s (best of {args.rounds})",
                ["workers", "stream", "ImageFolder", "ceiling", "ceiling*", "stream/ceiling", "stream/ceiling*",
                 "stream/ImageFolder", "read ampl.", "cpu ms/img: stream", "ImageFolder", "ceiling", "ceiling*"],
                [[*r[:5], *(f"{x:.2f}" for x in r[5:])] for r in rows])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    figures["load_avg_1min"] = round(load, 2)
    print("ceiling: decode + timm's transform (per-image ToTensor + Normalize, as ImageFolder gets) in a tight "
          "loop in one process, x workers; ceiling*: the same with the stream's own per-image work (uint8 "
          "transform + fused normalisation); cpu ms/img: "
          "CPU time of all processes involved (workers + main) per image, which load from other "
          f"processes does not inflate (1-min load average at the end: {load:.1f} on {os.cpu_count()} cores); "
          "read ampl.: bytes the stream read from the shards (tar headers + member data) per byte of the "
          "samples it handed out")
    figures["seconds"] = round(time.perf_counter() - t_start, 1)
    print(f"loader benchmark took {figures['seconds']:.0f} s")
    return figures


def _repeat(loader: Any) -> Any:
    while True:
        yield from loader


def add_loader_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", type=int, default=1536, help="synthetic images written (default 1536)")
    p.add_argument("--size", type=int, default=256, help="their size in pixels (default 256)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--crop", type=int, default=224, help="RandomResizedCrop output (default 224)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", default="1,2", help="DataLoader worker counts to compare (default 1,2)")
    p.add_argument("--images-measured", type=int, default=640, help="images timed per round and configuration")
    p.add_argument("--rounds", type=int, default=3, help="interleaved measurements; the best counts (default 3)")
    p.add_argument("--warmup", type=int, default=2, help="batches before timing starts")
    p.add_argument("--ceiling-images", type=int, default=256, help="images per ceiling measurement")
    p.add_argument("--shuffle-span", type=int, default=1000, help="data.shuffle_span (default 1000)")
    p.add_argument("--prefetch", type=int, default=2, help="DataLoader prefetch_factor of both loaders")
    p.add_argument("--tmp", default=None, help="folder for the temporary data (default: system temp)")


# ----------------------------------------------------------------------------- scale


def bench_scale(args: argparse.Namespace) -> dict[str, Any]:
    """What 1, 2, 4, ... N nodes fetch and read per epoch: the real order and partitions, no data."""
    from pipeline.data.scale import ScaleRow, project

    counts = [2**i for i in range(args.nodes.bit_length()) if 2**i <= args.nodes]
    t0 = time.perf_counter()
    order, rows = project(args.shards, args.samples_per_shard, args.global_batch, counts, args.gpus_per_node,
                          getattr(args, "scale_workers", 8), args.sample_bytes, args.partitions)
    print(f"{args.shards} shards x {args.samples_per_shard} samples of {args.sample_bytes} bytes, global batch "
          f"{args.global_batch}, {args.gpus_per_node} GPUs and {getattr(args, 'scale_workers', 8)} loader workers "
          f"per node: {order.partitions} partitions (sizes {order.sizes.min()}-{order.sizes.max()}), shuffle span "
          f"{order.span}")
    for row in rows:
        print(row.line() if isinstance(row, ScaleRow) else row)
    figures: dict[str, Any] = {"shards": args.shards, "samples_per_shard": args.samples_per_shard,
                               "sample_bytes": args.sample_bytes, "global_batch": args.global_batch,
                               "gpus_per_node": args.gpus_per_node, "workers": getattr(args, "scale_workers", 8),
                               "partitions": order.partitions, "shuffle_span": order.span}
    for row in rows:
        if isinstance(row, ScaleRow):
            figures[f"nodes{row.nodes}"] = {"fetched_per_dataset": round(row.fetched, 4),
                                            "index_reads_per_dataset": round(row.index_reads, 6),
                                            "distinct_shards_per_batch": round(row.distinct_shards, 1),
                                            "partitions_shared": row.shared_partitions}
    figures["seconds"] = round(time.perf_counter() - t0, 1)
    return figures


def add_scale_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=512, help="largest node count: 1, 2, 4, ... up to it (default 512)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node (default 8)")
    if "--workers" not in p._option_string_actions:  # `all`: the loader benchmark's flag; scale keeps 8
        p.add_argument("--workers", dest="scale_workers", type=int, default=8,
                       help="DataLoader workers per rank (default 8)")
    p.add_argument("--shards", type=int, default=10_000, help="shards in the data set (default 10000)")
    p.add_argument("--samples-per-shard", type=int, default=1000, help="samples per shard (default 1000)")
    p.add_argument("--global-batch", type=int, default=4096, help="train.global_batch_size (default 4096)")
    p.add_argument("--sample-bytes", type=int, default=110_000,
                   help="mean sample size in bytes (default 110000, ImageNet's mean JPEG)")
    p.add_argument("--partitions", type=int, default=None, help="data.partitions (default: automatic)")


# ----------------------------------------------------------------------------- preemption


def bench_preemption(args: argparse.Namespace) -> dict[str, Any]:
    """The per-step preemption agreement (one all-reduce of a flag over a CPU group), in microseconds."""
    import subprocess

    from pipeline.dist import free_port

    deepspeed = Path(sys.executable).with_name("deepspeed")
    # A free port, not the launcher's default 29500: a training job on this machine may hold that one.
    cmd = [str(deepspeed), "--num_gpus", str(args.ranks), "--master_port", str(free_port()),
           "pipeline/train/preemption.py"]
    print(" ".join(cmd))
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("FIGURES ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} exited with {out.returncode}:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    figures = json.loads(lines[-1].removeprefix("FIGURES "))
    print_table(f"preemption agreement over {figures['ranks']} ranks ({figures['calls']} calls, each after a barrier)",
                ["median us", "mean us", "p90 us"], [[figures["median_us"], figures["mean_us"], figures["p90_us"]]])
    return figures


def add_preemption_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=2, help="processes (GPUs on a GPU machine) to agree over (default 2)")


# ----------------------------------------------------------------------------- other benchmarks
# model, engine and e2e live in pipeline/bench (flags, presets and tables in pipeline/bench/cli.py);
# each `bench_<name>(args) -> dict` returns the figures and `main` appends the row.


def bench_model(args: argparse.Namespace) -> dict[str, Any]:
    """Training step images/s and MFU, ours vs timm's VisionTransformer (same config and optimizer)."""
    from pipeline.bench.cli import run_model

    return run_model(args, print_table)


def bench_engine(args: argparse.Namespace) -> dict[str, Any]:
    """DeepSpeed ZeRO 0-3 step vs a plain PyTorch loop (same model, optimizer, dtype); check_finite cost."""
    from pipeline.bench.cli import run_engine

    return run_engine(args, print_table)


def bench_e2e(args: argparse.Namespace) -> dict[str, Any]:
    """Shards -> train loader -> DeepSpeed step vs synthetic tensors on the device: does data keep up?"""
    from pipeline.bench.cli import run_e2e

    return run_e2e(args, print_table)


def bench_gpu(args: argparse.Namespace) -> dict[str, Any]:
    """GPU figures: training MFU of B/16 and L/16, end to end from JPEG shards, bf16 and nvjpeg checks."""
    from pipeline.bench.cli import run_gpu

    return run_gpu(args, print_table)


# ----------------------------------------------------------------------------- dispatcher

BENCHES: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "loader": bench_loader, "model": bench_model, "engine": bench_engine, "e2e": bench_e2e, "gpu": bench_gpu,
    "preemption": bench_preemption, "scale": bench_scale,
}
ARGS: dict[str, Callable[[argparse.ArgumentParser], None]] = {"loader": add_loader_args,
                                                              "preemption": add_preemption_args,
                                                              "scale": add_scale_args}


def _bench_args(name: str) -> Callable[[argparse.ArgumentParser], None]:
    def add(p: argparse.ArgumentParser) -> None:
        from pipeline.bench import cli

        getattr(cli, f"add_{name}_args")(p)
    return add


ARGS.update({name: _bench_args(name) for name in ("model", "engine", "e2e", "gpu")})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-csv", action="store_true", help=f"do not append to {RESULTS_CSV.relative_to(ROOT)}")
    sub = p.add_subparsers(dest="bench", required=True)
    for name in BENCHES:
        sp = sub.add_parser(name, help=(BENCHES[name].__doc__ or name).strip().splitlines()[0])
        if name in ARGS:
            ARGS[name](sp)
    sp = sub.add_parser("all", help="every implemented benchmark with its defaults")
    for add in ARGS.values():
        add(sp)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
    return status


if __name__ == "__main__":
    sys.exit(main())
