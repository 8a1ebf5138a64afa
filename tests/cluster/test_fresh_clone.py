"""The design card as typed, in a fresh copy of the repository (no logs/, runs/, data/, mlflow.db):

    sbatch slurm/pretrain.sh                     # resources shrunk on the command line, nothing else
    deepspeed --num_gpus 2 launch/finetune.py --res 64
    mlflow ui                                    # here: MLflow's client with no URI, from the same folder

Before the data exists, the job's log says so on its first lines with the make_shards command, and
the fine-tune with nothing to start from says what to pass. Steps are few: this is about the
commands, not about accuracy (tests/integration/test_mlflow_ui.py looks at the runs themselves).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.tracking import recorded_run_id

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.executable).parent.parent  # the checkout under test's venv, reused (not rebuilt)
SMALL_PARTITION = ["--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1", "--time=30"]
QUICK = ("train.steps=6 train.log_every=3 train.eval_every=0 train.ckpt_every=0 data.num_workers=1 "
         "tracking.timeout_s=120 tracking.system_metrics=false")  # a new SQLite store is slow to create on 2 cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fresh_copy(dest: Path) -> Path:
    """The repository's files as a clone would have them (tracked and not ignored: no runs/, logs/*, .venv)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    # .venv/bin/python (what slurm/pretrain.sh runs) starts this venv's interpreter by its own path: the
    # jobs see the venv's files under the same paths as every other test, so DeepSpeed's JIT-built ops
    # (keyed by their build's paths) are the ones `make venv` built. With .venv a link to the venv, the
    # jobs saw them under the copy's path and built their own (30-40 s on 2 cores).
    (dest / ".venv" / "bin").mkdir(parents=True)
    (dest / ".venv" / "bin" / "python").write_text(f'#!/bin/sh\nexec "{VENV}/bin/python" "$@"\n')
    (dest / ".venv" / "bin" / "python").chmod(0o755)
    return dest


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "SLURM_"))}
    env.update(PYTHONUNBUFFERED="1", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return env


def sbatch(cluster, clone: Path, **env: str) -> tuple[int, str, dict[str, str]]:
    """`sbatch <small partition> slurm/pretrain.sh` from the copy; the log where the script puts it."""
    job_id = cluster.sbatch([*SMALL_PARTITION, "slurm/pretrain.sh"], env={"MLFLOW_TRACKING_URI": "", **env},
                            cwd=clone)
    info = cluster.wait_job(job_id, timeout_s=900)
    log = clone / "logs" / f"vit-pretrain-{job_id}.out"
    assert log.is_file(), f"job {job_id} ({info.get('JobState')}) left no log in {clone / 'logs'}"
    return job_id, log.read_text(errors="replace"), info


def test_sbatch_then_finetune_as_typed_then_plain_mlflow(slurm_cluster, digits_shards, tmp_path):
    clone = fresh_copy(tmp_path / "clone")
    assert not (clone / "runs").exists() and not (clone / "mlflow.db").exists()

    # Nothing to fine-tune yet: one line that says what to pass.
    out = subprocess.run([str(VENV / "bin/python"), "launch/finetune.py", "--res", "64"], cwd=clone,
                         env=clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stdout + out.stderr
    assert "pass --from" in out.stderr

    # No shards yet: the log's first lines name the fix.
    job_id, log, info = sbatch(slurm_cluster, clone, OVERRIDES=QUICK)
    assert info.get("JobState") == "FAILED", f"{info}\n{log}"
    head = "\n".join(log.splitlines()[:8])
    assert "python launch/make_shards.py --source digits --out data/digits" in head, log

    (clone / "data").mkdir()
    (clone / "data" / "digits").symlink_to(digits_shards)  # what that command writes (made once per session)
    job_id, log, info = sbatch(slurm_cluster, clone, OVERRIDES=QUICK)
    assert (info.get("JobState"), info.get("ExitCode")) == ("COMPLETED", "0:0"), log
    pre_dir = clone / "runs" / f"vit-pretrain-{job_id}"
    assert (pre_dir / "model.safetensors").is_file(), log

    # deepspeed launch/finetune.py --res 64: no --config, no --from (only the length is shortened: the recipe's
    # batch of 512 at 64 px is 7 s a step here).
    port = ["--master_port", str(free_port())]  # other jobs on this machine may hold DeepSpeed's default
    ft = subprocess.run([str(VENV / "bin/deepspeed"), "--num_gpus", "2", *port, "launch/finetune.py", "--res", "64",
                         "train.steps=2", "train.warmup_steps=1", "train.log_every=1", "train.eval_every=0",
                         "tracking.timeout_s=120", "tracking.system_metrics=false"],
                        cwd=clone, env=clean_env(), capture_output=True, text=True, timeout=900)
    said = ft.stdout + ft.stderr
    assert ft.returncode == 0, said[-4000:]
    assert f"--from runs/vit-pretrain-{job_id}: the newest finished pretraining run" in said, said[-4000:]
    assert "no --config: the paper's fine-tuning recipe" in said
    ft_dir = clone / "runs" / f"vit-pretrain-{job_id}-ft64"
    ft_cfg = (ft_dir / "config.yaml").read_text()
    assert "optimizer: sgd" in ft_cfg and "data/digits" in ft_cfg, ft_cfg  # the recipe, the source's data set

    # Plain MLflow from that folder: no URI, as `mlflow ui` there would read it.
    listing = subprocess.run([str(VENV / "bin/python"), "-c", LIST_RUNS], cwd=clone, env=clean_env(),
                             capture_output=True, text=True, timeout=300)
    assert listing.returncode == 0, listing.stderr[-3000:]
    runs = {r["name"]: r for r in json.loads(listing.stdout.strip().splitlines()[-1])}
    pre, tuned = runs.get(pre_dir.name), runs.get(ft_dir.name)
    assert pre and tuned, runs
    assert (pre["status"], tuned["status"]) == ("FINISHED", "FINISHED"), runs
    assert tuned["tags"]["parent_run_id"] == pre["id"] == recorded_run_id(pre_dir)
    assert re.fullmatch(r"\d+", tuned["tags"].get("slurm_job_id", "0")) and pre["tags"]["slurm_job_id"] == str(job_id)


LIST_RUNS = """
import json
from mlflow import MlflowClient
client = MlflowClient()
exps = [e.experiment_id for e in client.search_experiments()]
print(json.dumps([{"name": r.info.run_name, "id": r.info.run_id, "status": r.info.status, "tags": r.data.tags}
                  for r in client.search_runs(exps)]))
"""
