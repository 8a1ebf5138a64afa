"""Fetch ahead: the train loader fed from shards on local disk, over rate-limited HTTP with
`data.fetch_ahead`, and over HTTP without it: images/s and the data wait fraction.

    python launch/bench.py fetch --rate-mbps 8 --step-ms 200

The training step is simulated (`--step-ms`, a sleep: the device's time, the host's cores free for
the loader), so that the figures are about the data path even on a small CPU box where a real
model step would hide any download (`launch/bench.py e2e` has the real step). The shards are served
by a local HTTP server (a thread of this process) that sends at most `--rate-mbps` megabits per
second over all connections. Each arm builds a fresh loader with an empty cache bounded to
`--fetch-cache-shards` shards, runs `--fetch-warmup` untimed steps, then `--fetch-steps` timed
ones. One partition and a shuffle span of two shards make the reader move through the shards a
few at a time, so shard boundaries keep coming: each new shard is a download the step waits for,
unless it was fetched ahead.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


class RateLimitedServer(ThreadingHTTPServer):
    """Serves `folder` at `rate` bytes/s in all (one budget shared by every connection)."""

    daemon_threads = True

    def __init__(self, folder: Path, rate: float):
        self.rate, self.sent, self.start = rate, 0, time.monotonic()
        self.lock = threading.Lock()
        server = self

        class Handler(SimpleHTTPRequestHandler):
            def __init__(self, *a: Any, **k: Any):
                super().__init__(*a, directory=str(folder), **k)

            def copyfile(self, source: Any, outputfile: Any) -> None:
                while chunk := source.read(1 << 15):
                    with server.lock:
                        now = time.monotonic()
                        if server.sent / server.rate < now - server.start:  # idle: the budget does not pile up
                            server.start, server.sent = now, 0
                        server.sent += len(chunk)
                        due = server.start + server.sent / server.rate
                    time.sleep(max(0.0, due - time.monotonic()))
                    outputfile.write(chunk)

            def log_message(self, *a: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)


def bench_fetch(args: argparse.Namespace, print_table: Any) -> dict[str, Any]:
    from benchmarks.e2e import write_shards
    from pipeline.config import DataConfig
    from pipeline.data import build_train_loader

    rate = args.rate_mbps * 1e6 / 8
    step_s = args.step_ms / 1e3
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-fetch-", dir=args.tmp) as tmp:
        folder = Path(tmp)
        shards = write_shards(folder / "shards", args.fetch_images, args.fetch_image_size, classes=10,
                              per_shard=args.fetch_per_shard)
        info = json.loads((shards / "dataset.json").read_text())
        shard_bytes = [s["bytes"] for s in info["splits"]["train"]["shards"]]
        server = RateLimitedServer(shards, rate)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        remote = folder / "remote"
        remote.mkdir()
        for s in info["splits"]["train"]["shards"]:
            s["name"] = f"http://127.0.0.1:{server.server_address[1]}/{s['name']}"
        (remote / "dataset.json").write_text(json.dumps(info))
        arms = {"local disk": (shards, True), "HTTP, fetch ahead": (remote, True), "HTTP, no fetch ahead": (remote, False)}
        figures: dict[str, Any] = {"batch": args.fetch_batch, "crop": args.fetch_crop, "step_ms": args.step_ms,
                                   "rate_mbps": args.rate_mbps, "images": args.fetch_images,
                                   "image_size": args.fetch_image_size, "per_shard": args.fetch_per_shard,
                                   "shard_mb": round(sum(shard_bytes) / len(shard_bytes) / 1e6, 3),
                                   "cache_shards": args.fetch_cache_shards, "steps": args.fetch_steps,
                                   "warmup": args.fetch_warmup, "workers": args.fetch_workers}
        # The cache holds a few shards (as a node's holds its spans, not the data set): fetching ahead is bounded.
        limit_gb = args.fetch_cache_shards * max(shard_bytes) / 2**30
        rows = []
        for name, (path, ahead) in arms.items():
            cfg = DataConfig(path=str(path), num_workers=args.fetch_workers, cache_dir=str(folder / f"cache-{len(rows)}"),
                             partitions=1, shuffle_span=2 * args.fetch_per_shard, fetch_ahead=ahead,
                             cache_limit_gb=limit_gb)
            loader = build_train_loader(cfg, args.fetch_crop, args.fetch_batch, seed=0)
            wait = 0.0
            for i in range(args.fetch_warmup + args.fetch_steps):
                if i == args.fetch_warmup:  # worker start-up and the first shards are not part of the figures
                    wait, t0 = 0.0, time.perf_counter()
                tw = time.perf_counter()
                next(loader)
                wait += time.perf_counter() - tw
                time.sleep(step_s)  # the training step: the device busy, the host's cores free for the loader
            wall = time.perf_counter() - t0
            loader.close()
            if loader.fetcher is not None:
                loader.fetcher.stop()
            img_s, frac = args.fetch_batch * args.fetch_steps / wall, wait / wall
            rows.append([name, round(img_s, 1), f"{100 * frac:.1f}%"])
            figures[name.replace(", ", "_").replace(" ", "_")] = {"img_s": round(img_s, 1), "data_wait": round(frac, 4)}
        server.shutdown()
    print_table(f"fetch ahead: train loader, {args.fetch_workers} worker(s), batch {args.fetch_batch} at "
                f"{args.fetch_crop}px, a simulated {args.step_ms:g} ms step; {args.fetch_images} "
                f"{args.fetch_image_size}px JPEGs in shards of {args.fetch_per_shard} ({figures['shard_mb']} MB), a "
                f"cache of {args.fetch_cache_shards} shards, HTTP at {args.rate_mbps:g} Mbit/s; {args.fetch_steps} "
                f"timed steps after {args.fetch_warmup}", ["input", "images/s", "data wait"], rows)
    figures["seconds"] = round(time.perf_counter() - t_start, 1)
    return figures


def add_fetch_args(p: argparse.ArgumentParser) -> None:
    from benchmarks.cli import _add

    _add(p, "--rate-mbps", type=float, default=8.0, help="HTTP server's rate in Mbit/s, all connections (default 8)")
    _add(p, "--step-ms", type=float, default=200.0,
         help="the simulated training step in ms: a sleep, the device's time (default 200)")
    _add(p, "--fetch-images", type=int, default=4096, help="synthetic JPEGs written as shards (default 4096)")
    _add(p, "--fetch-image-size", type=int, default=64, help="JPEG size in pixels (default 64)")
    _add(p, "--fetch-per-shard", type=int, default=128, help="samples per shard (default 128)")
    _add(p, "--fetch-cache-shards", type=int, default=12, help="data.cache_limit_gb as this many shards (default 12)")
    _add(p, "--fetch-batch", type=int, default=32, help="micro batch (default 32)")
    _add(p, "--fetch-crop", type=int, default=32, help="RandomResizedCrop size (default 32)")
    _add(p, "--fetch-workers", type=int, default=1, help="DataLoader workers (default 1)")
    _add(p, "--fetch-steps", type=int, default=60, help="timed steps per arm (default 60)")
    _add(p, "--fetch-warmup", type=int, default=4, help="untimed steps first (default 4)")
    _add(p, "--tmp", default=None, help="folder for the temporary data (default: system temp)")
