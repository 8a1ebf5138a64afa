"""The train stream against torchvision's ImageFolder and the decode+transform ceiling, images/s and
CPU ms per image (`python launch/bench.py loader`); and the stream over 16-bit 4-channel arrays of the same size
(issue 62: `.npy` members, pipeline/data/pixels.py), its CPU ms per image against the 8-bit RGB stream's."""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.results import print_table


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


def _write_array_data(folder: Path, images: int, size: int, classes: int) -> Path:
    """`images` 4-channel uint16 arrays of size x size (uniform noise: nothing to compress, as none is), written
    by make_shards' folder source as `.npy` members (dataset.json with their statistics)."""
    import numpy as np

    from pipeline.data.shards import folder_source, write_dataset

    rng, src = np.random.default_rng(0), folder / "arrays"
    for i in range(images):
        (src / f"class_{i % classes:03d}").mkdir(parents=True, exist_ok=True)
        np.save(src / f"class_{i % classes:03d}" / f"{i:05d}.npy", rng.integers(0, 65536, (size, size, 4), np.uint16))
    shards = folder / "array_shards"
    write_dataset(folder_source(str(src), val_fraction=0.0), shards, max_samples_per_shard=64,
                  workers=min(2, os.cpu_count() or 1), progress=False, log=lambda _: None)
    return shards


def _worker_pids(dl_iter: Any) -> list[int]:
    return [w.pid for w in getattr(dl_iter, "_workers", [])]  # torch's multi-process iterator


def _rate(it: Any, n_batches: int, pids: list[int], ready: int) -> tuple[float, float]:
    """(images/s, CPU ms per image) over n_batches of an already started iterator.

    Workers fill their prefetch queue (`ready` batches) while another loader is being timed;
    those are taken first, untimed, so that timing starts when the workers start afresh.
    """
    from benchmarks.common import cpu_seconds

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
        t0 = time.perf_counter()
        arrays = _write_array_data(Path(tmp), args.array_images, args.size, args.classes)
        print(f"wrote {args.array_images} {args.size}x{args.size}x4 uint16 arrays as shards in "
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
        rows, array_rows, figures = [], [], {"images": args.images, "array_images": args.array_images, "size": args.size, "crop": crop, "batch": batch,
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
            # The same stream over the arrays: ArrayCrop (RandomResizedCrop + flip on float32 C-channel tensors),
            # normalised by dataset.json's statistics.
            array_train = build_train_loader(dataclasses.replace(cfg, path=str(arrays), mean=None, std=None), crop,
                                             batch, seed=0)
            stream_it, folder_it, array_it = iter(train), _repeat(folder_loader), iter(array_train)
            for it in (stream_it, folder_it, array_it):  # worker start-up is not part of the figures
                for _ in range(args.warmup):
                    next(it)
            stream_pids = _worker_pids(train._it)
            folder_pids = _worker_pids(folder_loader._iterator)
            array_pids = _worker_pids(array_train._it)
            best = {k: (0.0, 1e9) for k in ("stream", "folder", "single", "single_same_path", "u16x4")}
            for _ in range(args.rounds):
                ready = args.prefetch * max(1, w)
                for name, fig in (("stream", _rate(stream_it, n_batches, stream_pids, ready)),
                                  ("folder", _rate(folder_it, n_batches, folder_pids, ready)),
                                  ("single", _ceiling(blobs, transform)),
                                  ("single_same_path", _ceiling(blobs, same_path)),
                                  ("u16x4", _rate(array_it, n_batches, array_pids, ready))):
                    best[name] = (max(best[name][0], fig[0]), min(best[name][1], fig[1]))
            amplification = train.read_amplification()  # all batches since the start, warmup included
            train.close()
            array_train.close()
            del stream_it, folder_it, folder_loader, array_it
            stream, folder = best["stream"][0], best["folder"][0]
            ceiling = best["single"][0] * max(1, w)
            ceiling_same = best["single_same_path"][0] * max(1, w)
            cpu = {k: v[1] for k, v in best.items() if k != "u16x4"}
            u16 = {"stream_img_s": round(best["u16x4"][0], 1), "cpu_ms_per_img": round(best["u16x4"][1], 3),
                   "cpu_vs_rgb_stream": round(best["u16x4"][1] / cpu["stream"], 3)}
            array_rows.append([w, u16["stream_img_s"], f"{u16['cpu_ms_per_img']:.2f}", f"{cpu['stream']:.2f}",
                               f"{u16['cpu_vs_rgb_stream']:.2f}"])
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
                "cpu_ms_per_img": {k: round(v, 3) for k, v in cpu.items()}, "u16x4": u16}
    print_table(f"train stream, {args.size}px JPEG -> RandomResizedCrop {crop} + flip + normalise, "
                f"batch {batch}, images/s (best of {args.rounds})",
                ["workers", "stream", "ImageFolder", "ceiling", "ceiling*", "stream/ceiling", "stream/ceiling*",
                 "stream/ImageFolder", "read ampl.", "cpu ms/img: stream", "ImageFolder", "ceiling", "ceiling*"],
                [[*r[:5], *(f"{x:.2f}" for x in r[5:])] for r in rows])
    print_table(f"train stream, {args.size}px 4-channel uint16 .npy -> RandomResizedCrop {crop} + flip + normalise "
                f"(float32), batch {batch} (best of {args.rounds})",
                ["workers", "images/s", "cpu ms/img: uint16 x4", "8-bit RGB JPEG", "ratio"], array_rows)
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
    p.add_argument("--array-images", type=int, default=384,
                   help="4-channel uint16 arrays of --size written for the 16-bit row (default 384: 192 MB at 256 px)")
    p.add_argument("--tmp", default=None, help="folder for the temporary data (default: system temp)")
