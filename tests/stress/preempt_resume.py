"""Stress: the preempt-then-resume scenario, N rounds on 2 ranks with evaluation on; counts hangs.

    .venv/bin/python tests/stress/preempt_resume.py --rounds 20
    .venv/bin/python tests/stress/preempt_resume.py --rounds 5 --eval-every 2 --zero 3

Each round is tests/integration/test_pretrain.py's preemption test: a 2-rank run gets SIGUSR1 on rank 1
at step 4, checkpoints and exits 75, then the same command resumes it to the end; the resumed weights
must equal one uninterrupted reference run's. A run still going after --hang-s is a hang: the stacks of
its processes (py-spy, when installed) are written to the round's folder, the run is killed, and the
round counts as hung. Not part of `make test` (it is a loop for finding races, minutes long).

Runs go through DeepSpeed's launcher, as the preemption test's (`launch`). What the loop measured, before
and after the fix of the evaluation hang: docs/testing.md (Stress).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.integration.runs import (  # noqa: E402 (after the path)
    TINY,
    WORKERS,
    command,
    env,
    make_synthetic_shards,
    rank_proc,
    weights,
)

CONFIG = "configs/pretrain/demo.yaml"


def overrides(shards: Path, run_dir: Path, zero: int, eval_every: int) -> list[str]:
    return [*TINY, WORKERS, f"data.path={shards}", f"run.dir={run_dir}", f"deepspeed.zero_stage={zero}",
            "train.steps=24", "train.ckpt_every=8", f"train.eval_every={eval_every}", "train.keep_last=2"]


def launch(over: list[str]) -> list[str]:
    """The preemption test's command (`run_and_signal`): DeepSpeed's launcher, which passes the rank's exit
    75 on (torchrun ends 1 whatever its rank's code) and starts each rank with --local_rank=N (rank_proc)."""
    return command("pretrain.py", CONFIG, over, 2, launcher="deepspeed")


def dump_stacks(pid: int, out: Path) -> None:
    """The Python stacks (py-spy) and native stacks (gdb) of every process under `pid`, for the record of
    a hang; each tool is used where installed (pip install py-spy; apt-get install gdb)."""
    import psutil

    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    tools = [[py_spy, "dump", "--pid"]] if os.path.exists(py_spy) else []
    if shutil.which("gdb"):
        tools.append(["gdb", "-batch", "-ex", "thread apply all bt", "-p"])
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    with out.open("w") as f:
        for p in procs:
            try:
                f.write(f"==== pid {p.pid} (parent {p.ppid()}): {' '.join(p.cmdline())[:200]}\n")
            except psutil.NoSuchProcess:  # a worker that ended since the list was taken
                continue
            for tool in tools:
                r = subprocess.run([*tool, str(p.pid)], capture_output=True, text=True, timeout=120)
                f.write(r.stdout + r.stderr)


def run_env() -> dict[str, str]:
    # This checkout's code, whichever checkout the venv was installed from (a clone can stress an old commit).
    return {**env(), "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run_once(argv: list[str], log: Path, hang_s: float, signal_at: str | None) -> str:
    """'ok', 'preempted', 'failed (rc N)' or 'hung'. With `signal_at`, SIGUSR1 goes to rank 1 once a line
    containing it is printed."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # list.extend: one line at a time
    reader.start()
    deadline, sent = time.monotonic() + hang_s, False
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if signal_at and not sent and any(signal_at in line for line in lines[-50:]):
                rank_proc(proc.pid, 1, 2).send_signal(signal.SIGUSR1)
                sent = True
            time.sleep(0.2)
    except BaseException:  # no run left behind (a rank not found, Ctrl-C): the whole session goes
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    hung = proc.poll() is None
    if hung:
        dump_stacks(proc.pid, log.with_suffix(".stacks"))
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    reader.join(timeout=10)
    log.write_text("".join(lines))
    if hung:
        return "hung"
    if proc.returncode == 75 and signal_at:
        return "preempted"
    if proc.returncode == 76:  # ExitCode.HUNG: the watchdog ended it (when dist.timeout_s < --hang-s)
        return "hung"
    return "ok" if proc.returncode == 0 else f"failed (rc {proc.returncode})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--zero", type=int, default=1, help="ZeRO stage (default 1)")
    p.add_argument("--eval-every", type=int, default=12, help="train.eval_every (the test's 12; smaller evaluates more)")
    p.add_argument("--hang-s", type=float, default=240, help="a run longer than this is a hang (default 240 s)")
    p.add_argument("--work", type=Path, default=None, help="folder for shards, runs and logs (default: a temp dir)")
    args = p.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="stress-"))
    work.mkdir(parents=True, exist_ok=True)
    shards = work / "shards"
    if not (shards / "dataset.json").exists():
        make_synthetic_shards(shards)
    ref_dir = work / "ref"
    shutil.rmtree(ref_dir, ignore_errors=True)
    ref = run_once(launch(overrides(shards, ref_dir, args.zero, args.eval_every)), work / "ref.log", args.hang_s,
                   None)
    print(f"reference run: {ref}", flush=True)
    reference = weights(ref_dir) if ref == "ok" else None
    tally: dict[str, int] = {}
    t0 = time.monotonic()
    for i in range(args.rounds):
        run_dir = work / f"round{i:02d}"
        shutil.rmtree(run_dir, ignore_errors=True)
        argv = launch(overrides(shards, run_dir, args.zero, args.eval_every))
        first = run_once(argv, work / f"round{i:02d}-preempt.log", args.hang_s, "step 4/24")
        second = run_once(argv, work / f"round{i:02d}-resume.log", args.hang_s, None) if first == "preempted" else "-"
        result = "hung" if "hung" in (first, second) else "ok" if (first, second) == ("preempted", "ok") \
            else f"failed ({first}, {second})"
        if result == "ok" and reference is not None:
            got = weights(run_dir)
            if any(not (got[k] == reference[k]).all() for k in reference):
                result = "weights differ"
        tally[result] = tally.get(result, 0) + 1
        print(f"round {i + 1}/{args.rounds}: {result} (preempted run: {first}; resumed: {second})", flush=True)
        if result == "ok":
            shutil.rmtree(run_dir, ignore_errors=True)
    hung = tally.get("hung", 0)
    print(f"{args.rounds} rounds in {time.monotonic() - t0:.0f} s: {hung} hung, "
          + ", ".join(f"{n} {k}" for k, n in sorted(tally.items())) + f"; logs in {work}", flush=True)
    return 1 if set(tally) - {"ok"} else 0


if __name__ == "__main__":
    sys.exit(main())
