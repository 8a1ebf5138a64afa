"""slurm/pretrain.sh and slurm/finetune.sh on a real local Slurm cluster (two nodes, one task each).

The first group runs stand-ins (tests/cluster/fixtures/) through the real scripts: the process
group over Slurm's environment, and the preemption contract (signal -> exit 75 -> requeue ->
resume). The second group runs the real trainer on the digits demo, on CPU over gloo.
"""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(1200)]

# What the scripts' #SBATCH defaults ask for (8 GPUs per node) does not exist here; the command
# line overrides it, as a user would on a smaller partition.
SMALL_JOB = ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1",
             # Long enough that the time-limit USR1 (@300 s before the end) never fires by itself.
             "--time=30"]
REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures"


def submit(cluster, job_dir: Path, script: str = "slurm/pretrain.sh", sbatch_args=(), wait=False,
           timeout_s: float = 300, **env: str):
    """Submit `script` from the repository root with a test-sized allocation; log in job_dir/logs.

    wait=True returns (job id, the job's exit code) once it has finished. It polls scontrol every
    half second rather than using `sbatch --wait`, whose back-off adds up to half a minute per job.
    """
    argv = [*SMALL_JOB, f"--output={job_dir}/logs/job-%j.out", *sbatch_args, script]
    env.setdefault("RUN_DIR", str(job_dir / "run"))
    env.setdefault("MAX_RESTARTS", "20")
    job_id = cluster.sbatch(argv, env=env, cwd=REPO)
    if not wait:
        return job_id
    info = cluster.wait_job(job_id, timeout_s=timeout_s)
    return job_id, int(info.get("ExitCode", "-1:0").split(":")[0])


def job_log(job_dir: Path, job_id: int) -> str:
    path = job_dir / "logs" / f"job-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def wait_for_log(cluster, job_dir: Path, job_id: int, pattern: str, timeout_s: float = 300) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = re.search(pattern, job_log(job_dir, job_id), re.MULTILINE)
        if match:
            return match
        state = cluster.job_info(job_id).get("JobState")
        if state in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}:
            break
        time.sleep(0.5)
    pytest.fail(f"job {job_id}: no {pattern!r} in the log ({cluster.job_info(job_id).get('JobState')}):\n"
                f"{job_log(job_dir, job_id)}")


def assert_finished(info: dict[str, str], log: str, state="COMPLETED", exit_code="0:0", restarts="0"):
    got = (info.get("JobState"), info.get("ExitCode"), info.get("Restarts"))
    assert got == (state, exit_code, restarts), f"(state, exit code, restarts) = {got}\n{log}"


@pytest.fixture
def stand_in_config(job_dir) -> str:
    config = job_dir / "standin.yaml"
    config.write_text("# the stand-ins ignore their config; slurm/pretrain.sh checks that it exists\n")
    return str(config)


# ----------------------------------------------------------------------------- stand-ins


def test_two_tasks_on_two_nodes_form_one_gloo_group(slurm_cluster, job_dir, stand_in_config):
    job_id, rc = submit(slurm_cluster, job_dir, wait=True, timeout_s=300,
                        ENTRY=str(FIXTURES / "dist_probe.py"), CONFIG=stand_in_config)
    log = job_log(job_dir, job_id)
    assert rc == 0, log
    probes = [dict(kv.split("=", 1) for kv in line.split("PROBE ", 1)[1].split())
              for line in log.splitlines() if "PROBE " in line]
    assert sorted(p["rank"] for p in probes) == ["0", "1"], log
    assert {p["world"] for p in probes} == {"2"}
    assert {p["node"] for p in probes} == {"n1", "n2"}        # one task per node, on both nodes
    assert {p["sum"] for p in probes} == {"3"}                # 1 + 2: the all-reduce spanned both
    assert {p["source"] for p in probes} == {"slurm"}
    assert {p["master"] for p in probes} == {f"n1:{10000 + job_id % 20000}"}
    assert "nodes n1 n2 (2), world size 2" in log


@pytest.mark.parametrize("scancel_flags", [[], ["--batch"]], ids=["to-steps", "to-batch-shell"])
def test_usr1_checkpoints_requeues_and_resumes(slurm_cluster, job_dir, stand_in_config, scancel_flags):
    """USR1 to the tasks (what --signal=USR1@300 does) or to the batch shell (B:USR1, which the
    script forwards): every rank exits 75, the script requeues, the rerun resumes and finishes."""
    job_id = submit(slurm_cluster, job_dir, ENTRY=str(FIXTURES / "preemptible.py"), CONFIG=stand_in_config)
    wait_for_log(slurm_cluster, job_dir, job_id, r"STEP 3 ")
    slurm_cluster.run(["scancel", "--signal=USR1", *scancel_flags, str(job_id)])
    info = slurm_cluster.wait_job(job_id, timeout_s=300)
    log = job_log(job_dir, job_id)
    assert_finished(info, log, restarts="1")
    stopped = {int(s) for s in re.findall(r"PREEMPTED step=(\d+)", log)}
    assert len(stopped) == 1 and len(re.findall(r"PREEMPTED", log)) == 2, log   # both ranks, same step
    assert f"RESUMED step={stopped.pop()} restart=1" in log
    assert len(re.findall(r"FINISHED step=\d+ rank=\d", log)) == 2
    assert "requeueing job" in log and "restart 1/20" in log
    if scancel_flags == ["--batch"]:
        assert "batch shell got SIGUSR1" in log


def test_scancel_checkpoints_but_does_not_requeue(slurm_cluster, job_dir, stand_in_config):
    """A plain scancel (SIGTERM everywhere) lets the tasks checkpoint; the job stays cancelled."""
    job_id = submit(slurm_cluster, job_dir, ENTRY=str(FIXTURES / "preemptible.py"), CONFIG=stand_in_config)
    wait_for_log(slurm_cluster, job_dir, job_id, r"STEP 2 ")
    slurm_cluster.run(["scancel", str(job_id)])
    wait_for_log(slurm_cluster, job_dir, job_id, r"checkpointed after SIGTERM: job ended, not requeued", 60)
    deadline = time.monotonic() + 60
    while job_id in slurm_cluster.running_job_ids() and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(2)  # a requeue, if one had been asked for, shows by now
    info, log = slurm_cluster.job_info(job_id), job_log(job_dir, job_id)
    assert (info.get("JobState"), info.get("Restarts")) == ("CANCELLED", "0"), f"{info}\n{log}"
    assert len(re.findall(r"PREEMPTED step=\d+ rank=\d signals=\[15\]", log)) == 2, log
    assert (job_dir / "run" / "preempted-at").exists()


def test_requeues_stop_at_max_restarts(slurm_cluster, job_dir, stand_in_config):
    job_id = submit(slurm_cluster, job_dir, ENTRY=str(FIXTURES / "preemptible.py"), CONFIG=stand_in_config,
                    MAX_RESTARTS="0")
    wait_for_log(slurm_cluster, job_dir, job_id, r"STEP 2 ")
    slurm_cluster.run(["scancel", "--signal=USR1", str(job_id)])
    info = slurm_cluster.wait_job(job_id, timeout_s=180)
    log = job_log(job_dir, job_id)
    assert_finished(info, log, state="FAILED", exit_code="75:0")
    assert "MAX_RESTARTS=0" in log


def test_a_failure_is_not_requeued(slurm_cluster, job_dir, stand_in_config):
    job_id, rc = submit(slurm_cluster, job_dir, wait=True, timeout_s=180,
                        ENTRY=str(FIXTURES / "crash.py"), CONFIG=stand_in_config)
    log = job_log(job_dir, job_id)
    assert rc == 3, log
    assert_finished(slurm_cluster.job_info(job_id), log, state="FAILED", exit_code="3:0")
    assert "failed: srun exited with 3 (not requeued)" in log


def test_a_missing_config_is_named(slurm_cluster, job_dir):
    # Through `sbatch --wait`, as a user or a CI pipeline would: its exit code is the job's.
    job_id, rc = slurm_cluster.sbatch_wait(
        [*SMALL_JOB, f"--output={job_dir}/logs/job-%j.out", "slurm/pretrain.sh"],
        env={"CONFIG": "configs/pretrain/nope.yaml", "RUN_DIR": str(job_dir / "run")}, cwd=REPO, timeout_s=60)
    log = job_log(job_dir, job_id)
    assert rc == 2
    assert "error: CONFIG=configs/pretrain/nope.yaml does not exist" in log


def test_finetune_names_a_missing_from(slurm_cluster, job_dir):
    # No FROM at all is fine (launch/finetune.py takes the newest finished run: tests/cluster/test_fresh_clone.py).
    job_id, rc = submit(slurm_cluster, job_dir, script="slurm/finetune.sh", wait=True, timeout_s=120,
                        FROM="runs/no-such-run")
    assert rc == 2
    assert "error: FROM=runs/no-such-run does not exist" in job_log(job_dir, job_id)


# ----------------------------------------------------------------------------- the real trainer

PRETRAIN_CONFIG = "configs/pretrain/demo.yaml"
FINETUNE_CONFIG = "configs/finetune/demo.yaml"
# The demo model, trained briefly: a checkpoint every 10 steps, logs every 5, one eval at the end.
PRETRAIN_STEPS = 30
SHORT_RUN = (f"train.steps={PRETRAIN_STEPS} train.log_every=5 train.eval_every=0 train.ckpt_every=10 "
             "data.num_workers=1 tracking.enabled=false")


def require(*paths: str) -> None:
    missing = [p for p in paths if not (REPO / p).exists()]
    if missing:
        pytest.skip(f"not written yet: {', '.join(missing)}")


@pytest.fixture(scope="session")
def pretrain_run(slurm_cluster, digits_shards, tmp_path_factory):
    """(a) An uninterrupted 2-node pretraining run of the demo config: (job id, job dir, log, exit code)."""
    require("launch/pretrain.py", PRETRAIN_CONFIG)
    job_dir = tmp_path_factory.mktemp("pretrain")
    (job_dir / "logs").mkdir()
    # No loader workers in this reference (the preempted job has them: the same batches, one fork server less).
    job_id, rc = submit(slurm_cluster, job_dir, wait=True, timeout_s=600, CONFIG=PRETRAIN_CONFIG,
                        OVERRIDES=f"{SHORT_RUN} data.num_workers=0 data.path={digits_shards}")
    return job_id, job_dir, job_log(job_dir, job_id), rc


def test_pretrain_on_two_nodes(slurm_cluster, pretrain_run):
    job_id, job_dir, log, rc = pretrain_run
    assert rc == 0, log
    assert "nodes n1 n2 (2), world size 2" in log
    assert re.search(r"^0: pretrain: .*\| world size 2 \|", log, re.MULTILINE), log
    assert f"step {PRETRAIN_STEPS}/{PRETRAIN_STEPS}" in log
    run_dir = job_dir / "run"
    assert (run_dir / "checkpoints" / "latest").is_file()
    assert (run_dir / "model.safetensors").is_file()
    assert slurm_cluster.job_info(job_id).get("NodeList") == "n[1-2]"


def test_pretrain_preempted_resumes_to_the_same_weights(slurm_cluster, digits_shards, pretrain_run, job_dir):
    """(b) USR1 mid-run: checkpoint, exit 75, requeue, resume; the final weights equal the uninterrupted run's."""
    from safetensors.torch import load_file

    _, base_dir, base_log, base_rc = pretrain_run
    assert base_rc == 0, base_log
    job_id = submit(slurm_cluster, job_dir, CONFIG=PRETRAIN_CONFIG,
                    OVERRIDES=f"{SHORT_RUN} data.path={digits_shards}")
    # Between two checkpoints, so the resume really starts from the checkpoint written on the signal.
    wait_for_log(slurm_cluster, job_dir, job_id, r"^0: step 15/", timeout_s=300)
    slurm_cluster.run(["scancel", "--signal=USR1", str(job_id)])
    info = slurm_cluster.wait_job(job_id, timeout_s=600)
    log = job_log(job_dir, job_id)
    assert_finished(info, log, restarts="1")
    stopped = re.search(r"preempted: checkpoint at step (\d+) saved", log)
    assert stopped, log
    assert 15 <= int(stopped.group(1)) < PRETRAIN_STEPS, log
    assert f"at step {stopped.group(1)}" in log.split("requeueing job", 1)[1]   # "resumed from ... at step N"

    ours = load_file(job_dir / "run" / "model.safetensors")
    base = load_file(base_dir / "run" / "model.safetensors")
    assert ours.keys() == base.keys()
    different = [k for k in base if not (ours[k] == base[k]).all()]
    assert not different, f"weights differ from the uninterrupted run: {different[:5]}"


def test_finetune_from_the_pretrain_run(slurm_cluster, digits_shards, pretrain_run, job_dir):
    """(c) slurm/finetune.sh FROM=<run of (a)> RES=2x: runs, resizes, exports weights at the new size."""
    require("launch/finetune.py", FINETUNE_CONFIG)
    _, base_dir, base_log, base_rc = pretrain_run
    assert base_rc == 0, base_log
    job_id, rc = submit(slurm_cluster, job_dir, script="slurm/finetune.sh", wait=True, timeout_s=600,
                        CONFIG=FINETUNE_CONFIG, FROM=str(base_dir / "run"), RES="64",
                        OVERRIDES=f"train.steps=10 train.log_every=5 train.eval_every=0 data.num_workers=0 "
                                  f"tracking.enabled=false data.path={digits_shards}")
    log = job_log(job_dir, job_id)
    assert rc == 0, log
    assert re.search(r"^0: finetune: .*\(64, 64\).*\| world size 2 \|", log, re.MULTILINE), log
    from safetensors.torch import load_file

    weights = load_file(job_dir / "run" / "model.safetensors")
    pos_embed = next(v for k, v in weights.items() if k.endswith("pos_embed"))
    assert pos_embed.shape[1] == 1 + (64 // 4) ** 2   # class token + a 16x16 grid of 4x4 patches


JUDGE_SCRIPT = """#!/bin/bash
# launch/evaluate.py and launch/embed.py as docs/evaluation.md runs them under srun: one task per node.
set -euo pipefail
srun --kill-on-bad-exit=1 "$PY" launch/evaluate.py --from "$FROM" --data "$DATA" --no-mlflow --batch-size 16 \\
    --json "$OUT/srun.json"
srun --kill-on-bad-exit=1 "$PY" launch/embed.py --from "$FROM" --data "$DATA" --workers 0 --batch-size 16 \\
    --out "$OUT/emb-srun"
"""


def test_evaluate_and_embed_under_srun_on_two_nodes_give_what_one_process_gives(slurm_cluster, digits_shards,
                                                                               pretrain_run, job_dir):
    """(d) The pretraining run of (a) judged and embedded by srun's two tasks on two nodes (a gloo group over
    Slurm's environment, as the trainer's): evaluate's figures equal one process's bit for bit; embed writes
    each image once, the vectors one process writes."""
    import json
    import subprocess
    import sys

    import pandas as pd
    import torch

    _, base_dir, base_log, base_rc = pretrain_run
    assert base_rc == 0, base_log
    source, out = base_dir / "run", job_dir / "out"
    out.mkdir()
    script = job_dir / "judge.sh"
    script.write_text(JUDGE_SCRIPT)
    env = {"PY": sys.executable, "FROM": str(source), "DATA": str(digits_shards), "OUT": str(out)}
    job_id = slurm_cluster.sbatch([*SMALL_JOB, f"--output={job_dir}/logs/job-%j.out", str(script)], env=env, cwd=REPO)
    info = slurm_cluster.wait_job(job_id, timeout_s=600)
    log = job_log(job_dir, job_id)
    assert info.get("ExitCode") == "0:0", log
    for command, extra in (("evaluate.py", ["--no-mlflow", "--json", str(out / "one.json")]),
                           ("embed.py", ["--workers", "0", "--out", str(out / "emb-one")])):
        one = subprocess.run([sys.executable, f"launch/{command}", "--from", str(source), "--data", str(digits_shards),
                              "--batch-size", "16", *extra], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    srun, one = (json.loads((out / f"{n}.json").read_text())[0]["metrics"] for n in ("srun", "one"))
    assert srun == one and any("knn" in k for k in one), (srun, one)
    a, b = (pd.read_parquet(out / n).sort_values("key").reset_index(drop=True) for n in ("emb-srun", "emb-one"))
    assert len(a) == len(b) > 0 and list(a.key) == list(b.key) and a.key.is_unique
    for column in ("cls", "mean_patch"):
        torch.testing.assert_close(torch.tensor(list(a[column])), torch.tensor(list(b[column])), atol=1e-5, rtol=0)


def _kill_node_agent(job_id: int, node: str) -> list[str]:
    """SIGKILL the task of `job_id` on `node` (the script's wrapper, its torchrun agent, the ranks), as the
    node's death would: found by their environment, that job's task on that slurmd (both "nodes" are this
    machine). Returns the agent's command line."""
    import psutil

    agents = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            environ = proc.environ()
            if "torch.distributed.run" in " ".join(proc.info["cmdline"] or []) \
                    and environ.get("SLURM_JOB_ID") == str(job_id) and environ.get("SLURMD_NODENAME") == node:
                agents.append(proc)
        except (psutil.Error, OSError):
            continue
    pids = {p.pid for p in agents}
    tops = [p for p in agents if p.ppid() not in pids]  # the wrapper shell, whose child is the agent
    assert len(tops) == 1, f"expected one task of job {job_id} on {node}, found {[p.cmdline()[:3] for p in tops]}"
    (agent,) = [p for p in agents if p.ppid() == tops[0].pid]
    cmdline = agent.cmdline()
    for proc in [tops[0], *tops[0].children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return cmdline


def test_elastic_job_loses_a_node_and_finishes_on_one(slurm_cluster, digits_shards, job_dir):
    """ELASTIC_MIN_NODES=1 on 2 nodes (sbatch --no-kill): n2's agent and rank are killed mid-run; n1's agent
    restarts its rank on world size 1 from the newest checkpoint, and the job completes (exit 0, no requeue).
    ELASTIC_RDZV_CONF shortens the rendezvous's waits after the loss (torch's: a 30 s last call, 15 s for
    the dead node's heartbeat to expire)."""
    steps, every = 60, 5
    job_id = submit(slurm_cluster, job_dir, sbatch_args=["--no-kill"], CONFIG=PRETRAIN_CONFIG, ELASTIC_MIN_NODES="1",
                    ELASTIC_RDZV_CONF="last_call_timeout=10,keep_alive_interval=3",
                    OVERRIDES=f"train.steps={steps} train.log_every=1 train.eval_every=0 train.ckpt_every={every} "
                              f"data.num_workers=1 tracking.enabled=false data.path={digits_shards}")
    wait_for_log(slurm_cluster, job_dir, job_id, r"^\d: pretrain: .*\| world size 2 \|", timeout_s=300)
    wait_for_log(slurm_cluster, job_dir, job_id, r"^\d: step 8/", timeout_s=300)
    agent = _kill_node_agent(job_id, "n2")
    assert agent[agent.index("--rdzv-conf") + 1] == "is_host=0,last_call_timeout=10,keep_alive_interval=3", agent
    lost_at = max(int(s) for s in re.findall(r"^\d: step (\d+)/", job_log(job_dir, job_id), re.MULTILINE))
    info = slurm_cluster.wait_job(job_id, timeout_s=600)
    log = job_log(job_dir, job_id)
    assert_finished(info, log)
    assert re.search(r"^0: pretrain: .*\| world size 1 \|", log, re.MULTILINE), log
    assert "elastic: finished on n1" in log, log
    resumed = int(re.findall(r"resumed from \S+ at step (\d+)", log)[-1])
    assert lost_at - resumed <= every, (lost_at, resumed)
    assert f"step {steps}/{steps}" in log and (job_dir / "run" / "model.safetensors").is_file()


def test_elastic_job_usr1_checkpoints_requeues_and_resumes(slurm_cluster, digits_shards, job_dir):
    """The time-limit signal in elastic mode: slurm/elastic_agent.sh turns SIGUSR1 into the agent's SIGTERM,
    the ranks checkpoint and exit 75 (the agent does not restart them), the job is requeued and resumes there."""
    steps = 40
    job_id = submit(slurm_cluster, job_dir, sbatch_args=["--no-kill"], CONFIG=PRETRAIN_CONFIG, ELASTIC_MIN_NODES="1",
                    OVERRIDES=f"train.steps={steps} train.log_every=1 train.eval_every=0 train.ckpt_every=100 "
                              f"data.num_workers=1 tracking.enabled=false data.path={digits_shards}")
    wait_for_log(slurm_cluster, job_dir, job_id, r"^\d: step 8/", timeout_s=300)
    slurm_cluster.run(["scancel", "--signal=USR1", str(job_id)])
    info = slurm_cluster.wait_job(job_id, timeout_s=600)
    log = job_log(job_dir, job_id)
    assert_finished(info, log, restarts="1")
    before, after = log.split("requeueing job", 1)
    saved = re.search(r"preempted: checkpoint at step (\d+) saved", before)
    assert saved and 8 <= int(saved.group(1)) < steps, log
    # One start before the requeue: the agent ended instead of restarting its ranks after their exit 75.
    assert len(re.findall(r"^\d: pretrain: .*\| world size 2 \|", before, re.MULTILINE)) == 1, log
    assert f"at step {saved.group(1)}" in after and f"step {steps}/{steps}" in after, log
