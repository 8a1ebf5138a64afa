"""What the per-step preemption agreement costs (`python launch/bench.py preemption`): one all-reduce of
a flag over the ranks' CPU group, timed after a barrier. This file is also each rank's script."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # a rank started by the deepspeed launcher: the repository is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results import ROOT, print_table  # noqa: E402
from pipeline.train.preemption import Preemption  # noqa: E402


def bench_preemption(args: argparse.Namespace) -> dict[str, Any]:
    """The per-step preemption agreement (one all-reduce of a flag over a CPU group), in microseconds."""
    import subprocess

    from pipeline.dist import free_port

    deepspeed = Path(sys.executable).with_name("deepspeed")
    # A free port, not the launcher's default 29500: a training job on this machine may hold that one.
    cmd = [str(deepspeed), "--num_gpus", str(args.ranks), "--master_port", str(free_port()),
           "benchmarks/preemption.py"]
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


def measure_agreement(calls: int = 2000) -> None:
    """One rank of `deepspeed --num_gpus N benchmarks/preemption.py`: times `should_stop()` on every
    rank after a barrier, so only the all-reduce itself is counted."""
    import json
    import statistics
    import time

    import torch.distributed as dist

    from pipeline.dist import init_distributed

    env = init_distributed()
    agree = Preemption()
    for _ in range(200):  # warm-up: the gloo pair connections
        agree.should_stop()
    times = []
    for _ in range(calls):
        dist.barrier()
        t0 = time.perf_counter()
        agree.should_stop()
        times.append(time.perf_counter() - t0)
    if env.is_main:
        times.sort()
        figures = {"ranks": env.world_size, "calls": calls, "median_us": round(1e6 * statistics.median(times), 1),
                   "mean_us": round(1e6 * statistics.mean(times), 1), "p90_us": round(1e6 * times[int(0.9 * calls)], 1)}
        print(f"preemption agreement over {env.world_size} ranks: median {figures['median_us']:.0f} us, "
              f"mean {figures['mean_us']:.0f} us, p90 {figures['p90_us']:.0f} us", flush=True)
        print("FIGURES " + json.dumps(figures), flush=True)  # read by `python launch/bench.py preemption`
    dist.destroy_process_group()


if __name__ == "__main__":
    measure_agreement()
