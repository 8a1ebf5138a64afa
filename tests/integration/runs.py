"""Helpers for the multi-process tests: shards, launching the real entry points, reading results."""

from __future__ import annotations

import contextlib
import glob
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

from pipeline.dist import CPU_ALLREDUCE_BUFFERS, free_port  # noqa: F401 (free_port: for the tests)

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
DEEPSPEED = str(Path(sys.executable).with_name("deepspeed"))
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

# A tiny ViT that still has every part (patches, class token, blocks, head) and trains in seconds.
# No DataLoader workers: a rank's batches are the same with any number of them (the README's first
# guarantee, and weights equal bit for bit between 0 and 1 worker), and the workers' fork server costs
# a run about 5 s on the 2-core machine (it imports torch, torchvision and timm). The runs of the tests
# whose subject is the worker path (preemption and resume, signals, hangs, remote data, elastic nodes)
# add WORKERS; their uninterrupted reference runs keep 0, so those tests also compare 0 with 1.
TINY = [
    "model.variant=vit_ti16", "model.img_size=16", "model.patch_size=4", "model.embed_dim=32",
    "model.depth=2", "model.num_heads=2", "model.grad_checkpointing=true",
    "data.num_workers=0", "data.scale=[0.5, 1.0]", "data.hflip=0.0", "data.shuffle_span=64",
    "train.global_batch_size=16", "train.micro_batch_size=8", "train.lr=3e-3", "train.warmup_steps=3", "train.weight_decay=0.01",
    "train.log_every=2", "deepspeed.bf16=true", "tracking.enabled=false",
]
WORKERS = "data.num_workers=1"  # after TINY: the loader's workers and their fork server, as a user's run has them


def supervised(shards: Path, run_dir: Path, zero: int, steps: int = 24) -> list[str]:
    """configs/pretrain/demo.yaml's overrides for a TINY supervised run of `steps` (checkpoints every 8, the
    last 2 kept, evaluations every 12): what the preemption tests of test_pretrain.py and the bucket's
    restore test end against (`supervised_reference` runs it once per session at ZeRO-1)."""
    return [*TINY, f"data.path={shards}", f"run.dir={run_dir}", f"deepspeed.zero_stage={zero}",
            f"train.steps={steps}", "train.ckpt_every=8", "train.eval_every=12", "train.keep_last=2"]


def make_synthetic_shards(out: Path, size: int = 16, samples: int = 320, classes: int = 4, per_shard: int = 40) -> Path:
    subprocess.run([PYTHON, str(ROOT / "launch/make_shards.py"), "--source", "synthetic", "--out", str(out),
                    "--size", str(size), "--num-samples", str(samples), "--num-classes", str(classes),
                    "--max-samples-per-shard", str(per_shard), "--no-progress"], check=True, cwd=ROOT)
    return out


def command(entry: str, config: str, overrides: list[str], ranks: int, extra: list[str] = (),
            launcher: str = "torchrun") -> list[str]:
    """The command line of a run: one process for one rank, else `launcher` (torchrun or deepspeed).

    Both launchers are what users type (README, docs/cluster.md). Runs default to torchrun: one agent
    process, where DeepSpeed's launcher is a runner and a launcher that each import DeepSpeed first
    (about 4.5 s of CPU more per run, ~60 runs in `make test`). Tests of what DeepSpeed's launcher
    does (a rank's exit code 75, 76 or 2 passed on: torchrun ends 1 whatever the rank's code; a signal to
    the runner; --master_port) ask for it by name, in `run` and in `run_and_signal` alike."""
    script = str(ROOT / "launch" / entry)
    if ranks == 1:
        return [PYTHON, script, "--config", config, *extra, *overrides]
    if launcher == "deepspeed":
        return [DEEPSPEED, "--num_gpus", str(ranks), "--master_port", str(free_port()), script,
                "--config", config, *extra, *overrides]
    assert launcher == "torchrun", launcher
    return [TORCHRUN, "--nproc-per-node", str(ranks), "--master-port", str(free_port()), script,
            "--config", config, *extra, *overrides]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(PYTHONUNBUFFERED="1", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(var, None)
    return e


def shm_buffers() -> set[str]:
    """DeepSpeed's CPU all-reduce buffers in /dev/shm (see pipeline.dist.cpu_allreduce_buffer)."""
    return set(glob.glob(CPU_ALLREDUCE_BUFFERS))


def leaked_shm_buffers(before: set[str]) -> set[str]:
    """Buffers created since `before` that no live process maps: left by ranks that have ended. (A new
    file that is mapped belongs to a job still running, perhaps another one on this machine.)"""
    new = shm_buffers() - before
    return new - _mapped_files() if new else set()


def _mapped_files() -> set[str]:
    """Paths of the files some live process has mapped (from /proc/<pid>/maps)."""
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split(None, 5)[5].strip() for line in maps.read_text().splitlines()
                          if line.count(" ") >= 5 and "/dev/shm/" in line)
        except (OSError, IndexError):
            pass  # the process ended, or is not ours to read
    return mapped


def run(entry: str, config: str, overrides: list[str], ranks: int = 2, extra: list[str] = (),
        timeout: float = 900, extra_env: dict[str, str] | None = None,
        launcher: str = "torchrun") -> subprocess.CompletedProcess:
    """Run an entry point to the end. On a timeout the whole process group is killed and the test
    fails with what the run printed, so a hang shows where it hung."""
    argv = command(entry, config, overrides, ranks, list(extra), launcher)
    proc = subprocess.Popen(argv, cwd=ROOT, env={**env(), **(extra_env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(argv[:6])} ... still running after {timeout:.0f}s:\n"
                             f"{out[-4000:]}\n{err[-4000:]}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def forget_world_group() -> None:
    """DeepSpeed keeps its clone of the world group (deepspeed.utils.groups) past the run's
    destroy_process_group: cleared, as a fresh process has it, or the next engine in this process uses the
    dead one ("Group ... is not registered")."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        groups._WORLD_GROUP = None


def run_here(entry: str, config: str | None, overrides: list[str], extra: list[str] = (),
             extra_env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """A 1-rank run of launch/pretrain.py or launch/finetune.py in this process: the command's function
    (`commands.pretrain` / `finetune`), which is all the script runs after installing the signal handlers
    (the commands install them again). It saves the interpreter's start and the imports of torch, DeepSpeed
    and the pipeline, 5 to 8 s a run on the 2-core machine, where the test is about the run and not about
    the process (a signal, a kill, a wrapper, the launcher: those keep `run`). As `run` gives it: cwd the
    repository (or `cwd`), one torch thread (OMP_NUM_THREADS=1 in `env`), no launcher variables; what the run exports
    (RANK, MASTER_PORT... for DeepSpeed), its threads count and the cwd are put back afterwards, and what a
    process lets go of when it ends (its run directory's lock, DeepSpeed's world group) is let go of."""
    from pipeline import commands
    from pipeline.train import lock

    held = set(lock._held)  # what this process held before the run (a test of its own may hold one)
    command_of = {"pretrain.py": commands.pretrain, "finetune.py": commands.finetune}[entry]
    argv = [*(["--config", config] if config else []), *extra, *overrides]  # None: no --config, as a user may type it
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             *(extra_env or {}))
    saved_env = {k: os.environ.get(k) for k in names}
    saved = os.getcwd(), torch.get_num_threads(), sys.argv
    for k in names[:6]:
        os.environ.pop(k, None)
    os.environ.update(extra_env or {})
    out, err = io.StringIO(), io.StringIO()
    forget_world_group()  # another test's engine in this process may have left its dead one
    try:
        os.chdir(cwd)
        torch.set_num_threads(1)
        sys.argv = [str(ROOT / "launch" / entry)]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = int(command_of(argv))
            except SystemExit as e:  # argparse and the commands' usage errors, as the script would exit
                code = e.code if isinstance(e.code, int) else 1 if e.code else 0
    finally:
        forget_world_group()
        # The run directory's lock is held for the life of the process that took it (pipeline/train/lock.py):
        # released as the run's own process would at its exit, so that a later job (a process) may take it.
        for key in set(lock._held) - held:
            os.close(lock._held.pop(key))
            lock._created.pop(key, None)
        os.chdir(saved[0])
        torch.set_num_threads(saved[1])
        sys.argv = saved[2]
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def run_and_signal(entry: str, config: str, overrides: list[str], when: str, sig: int = signal.SIGUSR1,
                   rank: int = 1, ranks: int = 2, timeout: float = 900,
                   launcher: str = "torchrun") -> tuple[int, str]:
    """Start a run, send `sig` to one rank once a line containing `when` is printed; return (code, output).

    The code is the first rank to end non-zero's: DeepSpeed's launcher passes it on (and terminates the
    others); torchrun (the default, as in `run`: one agent process to start, where DeepSpeed's runner and
    launcher each import DeepSpeed and MLflow before the ranks start, 10-25 s on the 2-core machine) exits 1
    whatever it was, so its failure report's figure for that rank ("Root Cause") is returned instead."""
    proc = subprocess.Popen(command(entry, config, overrides, ranks, launcher=launcher), cwd=ROOT, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, sent, deadline = [], False, time.monotonic() + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if not sent and when in line:
            rank_proc(proc.pid, rank, ranks).send_signal(sig)
            sent = True
        if time.monotonic() > deadline:
            proc.kill()
            break
    code = proc.wait(timeout=60)
    assert sent, f"never saw {when!r}:\n" + "".join(lines[-40:])
    out = "".join(lines)
    if launcher == "torchrun" and code == 1 and ranks > 1:
        code = first_failure(out)
    return code, out


def first_failure(out: str) -> int:
    """The exit code torchrun's failure report gives its first failed rank ("Root Cause (first observed
    failure)"); 1 (torchrun's own) when the output has no such report."""
    found = re.search(r"Root Cause \(first observed failure\):\n\[\d+\]:\n(?:  .*\n)*?  exitcode  : (-?\d+)", out)
    return int(found[1]) if found else 1


def rank_proc(launcher_pid: int, rank: int, ranks: int) -> psutil.Process:
    """The training process of `rank` under the launcher: DeepSpeed's launcher passes --local_rank=N in the
    rank's argv; torchrun's workers are its own children with LOCAL_RANK=N in their environment (their
    DataLoader workers and fork servers inherit it, hence only direct children)."""
    if ranks == 1:
        return psutil.Process(launcher_pid)
    launcher = psutil.Process(launcher_pid)
    for child in launcher.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if f"--local_rank={rank}" in child.cmdline():
                return child
    for child in launcher.children():
        with contextlib.suppress(psutil.Error):
            if child.environ().get("LOCAL_RANK") == str(rank):
                return child
    raise AssertionError(f"no process for rank {rank} under {launcher_pid}")


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model.safetensors"))


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_sets_judged_alike(run_dir: Path, ref_dir: Path, marker: str,
                             name: str = "synth") -> tuple[dict[int, dict], dict[int, dict]]:
    """eval.sets' figures of set `name` (every 4 steps of 12): the resumed run's at steps 8 and 12 equal to the
    uninterrupted reference's, each k-NN top-1 strictly between 0 and 1 (where every sample is right, equal
    figures say nothing). `marker`: a metric every evaluation of the objective logs. Both runs' evaluations by step."""
    evals = {m["step"]: m["metrics"] for m in metrics(run_dir) if marker in m["metrics"]}
    ref_evals = {m["step"]: m["metrics"] for m in metrics(ref_dir) if marker in m["metrics"]}
    assert sorted(ref_evals) == [4, 8, 12] and {8, 12} <= evals.keys()
    for step in (8, 12):
        judged = {k: v for k, v in evals[step].items() if k.startswith(f"eval/{name}/")}
        assert judged == {k: v for k, v in ref_evals[step].items() if k.startswith(f"eval/{name}/")}, step
        assert {f"eval/{name}/knn_top1", f"eval/{name}/knn_top5", f"eval/{name}/knn_top1_k100"} <= judged.keys()
        assert 0 < judged[f"eval/{name}/knn_top1"] < 1 and 0 < judged[f"eval/{name}/knn_top1_k10"] < 1, judged
    return evals, ref_evals


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs: max |diff| {(a[k] - b[k]).abs().max().item()}"


# DINO's teacher-target entropy (train/dino_teacher_entropy) away from both collapses: near 0 (every image
# given one prototype) and near log K (uniform targets: the centre has caught up with outputs that no longer
# differ between images). Bounds from measurement: test_dino.py's 2-rank run (64 prototypes, teacher
# temperature warming up over 4 steps) logs 0.82, 1.48, 2.06, 2.32, 2.75, 2.94 at steps 2-12, against
# log 64 = 4.16; tests/unit/test_dino_objective.py shows collapsed targets failing this check.
ENTROPY_FLOOR, ENTROPY_CEILING_GAP = 0.25, 0.5


def assert_teacher_not_collapsed(entropy: float, prototypes: int) -> None:
    assert ENTROPY_FLOOR < entropy < math.log(prototypes) - ENTROPY_CEILING_GAP, (
        f"teacher entropy {entropy:.3f} of at most log {prototypes} = {math.log(prototypes):.3f}: collapsed")
