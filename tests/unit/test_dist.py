"""pipeline.dist: which launcher started us, and what rank/world/master that means."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import dist
from pipeline.dist import (
    SHARED_STORE_FIX,
    DistEnv,
    DistEnvError,
    after_exit,
    detect_env,
    elastic_store_warning,
    expand_nodelist,
    expand_nodelist_python,
)

ROOT = Path(__file__).resolve().parents[2]


def test_torchrun_env_is_used_as_is():
    env = detect_env({
        "RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1",
        "MASTER_ADDR": "gpu-a01", "MASTER_PORT": "29600",
        # Slurm variables around the deepspeed launcher must not win over its own ranks.
        "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "n[1-2]",
    })
    assert env == DistEnv(rank=5, local_rank=1, world_size=16, master_addr="gpu-a01",
                          master_port=29600, source="torchrun")
    assert not env.is_main


def test_torchrun_env_defaults_for_missing_optional_vars():
    env = detect_env({"RANK": "0", "WORLD_SIZE": "1"})
    assert (env.local_rank, env.master_addr, env.master_port, env.source) == (0, "127.0.0.1", 29500, "torchrun")
    assert env.is_main


def _slurm(**extra: str) -> dict[str, str]:
    base = {
        "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "n[1-2]",
    }
    base.update(extra)
    return base


def test_slurm_env_maps_to_ranks_and_first_node(monkeypatch):
    monkeypatch.setattr(dist.shutil, "which", lambda name: None)  # the pure-python expansion
    env = detect_env(_slurm())
    assert env == DistEnv(rank=3, local_rank=1, world_size=4, master_addr="n1",
                          master_port=10000 + 123456 % 20000, source="slurm")


def test_slurm_port_from_job_id_is_in_range_and_differs_between_jobs(monkeypatch):
    monkeypatch.setattr(dist.shutil, "which", lambda name: None)
    ports = {detect_env(_slurm(SLURM_JOB_ID=str(j))).master_port for j in (1, 2, 19999, 20000, 987654321)}
    assert all(10000 <= p < 30000 for p in ports)
    assert detect_env(_slurm(SLURM_JOB_ID="7")).master_port == 10007
    assert detect_env(_slurm(SLURM_JOB_ID="20007")).master_port == 10007
    assert len(ports) == 5


def test_slurm_master_port_env_wins(monkeypatch):
    monkeypatch.setattr(dist.shutil, "which", lambda name: None)
    assert detect_env(_slurm(MASTER_PORT="40000")).master_port == 40000


def test_slurm_step_values_win_over_job_values(monkeypatch):
    # A step on a subset of the allocation: its own task count and node list decide.
    monkeypatch.setattr(dist.shutil, "which", lambda name: None)
    env = detect_env(_slurm(SLURM_NTASKS="16", SLURM_STEP_NUM_TASKS="4",
                            SLURM_JOB_NODELIST="n[1-4]", SLURM_STEP_NODELIST="n[3-4]"))
    assert (env.world_size, env.master_addr) == (4, "n3")


def test_batch_shell_without_srun_is_a_single_process():
    # What an sbatch script sees outside srun: rank variables for its own single process and the
    # allocation's task count. Taking that for rank 0 of 4 would hang waiting for the others.
    env = _slurm(SLURM_PROCID="0", SLURM_LOCALID="0")
    del env["SLURM_STEP_ID"]
    assert detect_env(env).source == "single"
    assert detect_env(env).world_size == 1


def test_slurm_bad_integer_names_the_variable():
    with pytest.raises(DistEnvError, match="SLURM_PROCID"):
        detect_env(_slurm(SLURM_PROCID="zero"))


def test_single_process_gets_a_free_local_port():
    env = detect_env({})
    assert (env.rank, env.local_rank, env.world_size, env.source) == (0, 0, 1, "single")
    assert env.master_addr == "127.0.0.1"
    with socket.socket() as sock:  # the port is really free: we can bind it
        sock.bind(("127.0.0.1", env.master_port))


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("n5", ["n5"]),
    ("n1,n5", ["n1", "n5"]),
    ("n[1-2],n5", ["n1", "n2", "n5"]),
    ("n[1-3,7],gpu-a[01-02]", ["n1", "n2", "n3", "n7", "gpu-a01", "gpu-a02"]),
    ("node[08-11]", ["node08", "node09", "node10", "node11"]),
    ("rack1-n[1-2]-ib", ["rack1-n1-ib", "rack1-n2-ib"]),
])
def test_expand_nodelist_python(nodelist, hosts):
    assert expand_nodelist_python(nodelist) == hosts


def test_expand_nodelist_rejects_what_it_cannot_parse():
    with pytest.raises(DistEnvError, match="node list"):
        expand_nodelist_python("n[1-2")


def test_expand_nodelist_falls_back_when_scontrol_fails(monkeypatch):
    monkeypatch.setattr(dist.shutil, "which", lambda name: "/nonexistent/scontrol")
    assert expand_nodelist("n[1-3,7],gpu-a[01-02]") == ["n1", "n2", "n3", "n7", "gpu-a01", "gpu-a02"]


def test_init_distributed_single_process_gloo(monkeypatch):
    """The no-launcher path really forms a group of one and exports the variables DeepSpeed reads."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("deepspeed")
    import torch.distributed as torch_dist

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(var, raising=False)
    if torch_dist.is_initialized():
        pytest.skip("a process group already exists in this test process")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    try:
        env = dist.init_distributed(timeout_s=60)
        assert env.source == "single" and env.world_size == 1
        assert torch_dist.get_world_size() == 1 and torch_dist.get_backend() == "gloo"
        import os
        assert os.environ["MASTER_PORT"] == str(env.master_port)
        assert dist.init_distributed() == env  # idempotent, and still says how it was launched
        tensor = torch.ones(3)
        torch_dist.all_reduce(tensor)
        assert tensor.tolist() == [1.0, 1.0, 1.0]
    finally:
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()


def test_the_process_group_times_out_a_minute_after_the_watchdog(monkeypatch, tmp_path):
    """The group a run joins (resume.start, the one place it is joined) has max(dist.timeout_s, a loader's start
    allowance) + 60 s past the longest storage wait (data.retry_time_s + data.read_timeout_s) as its collectives' timeout: the watchdog
    (dist.timeout_s, counted past a storage wait) names the stuck rank, step and phase before a collective
    raises from inside gloo or NCCL, and no collective ends a wait the watchdog allows."""
    from datetime import timedelta

    torch = pytest.importorskip("torch")
    pytest.importorskip("deepspeed")
    import torch.distributed as torch_dist

    from pipeline.config import load_config
    from pipeline.run import resume
    from pipeline.train import lock

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(var, raising=False)
    if torch_dist.is_initialized():
        pytest.skip("a process group already exists in this test process")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run_dir = tmp_path / "run"
    cfg = load_config(ROOT / "configs/pretrain/demo.yaml", [f"run.dir={run_dir}", "dist.timeout_s=42",
                                                           "data.retry_time_s=100", "data.read_timeout_s=7"])
    try:
        resume.start(cfg)
        group = torch_dist.distributed_c10d._get_default_group()
        # a loader's start is allowed LOADER_START_S (120 s) when dist.timeout_s is smaller: the group waits that
        assert group._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=120 + 100 + 7 + 60)
    finally:
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()
        fd = lock._held.pop(str(run_dir.resolve()), None)
        if fd is not None:
            os.close(fd)


@pytest.mark.parametrize("environ, rank0", [
    ({}, True),                                                                  # alone
    ({"RANK": "0", "WORLD_SIZE": "2"}, True), ({"RANK": "1", "WORLD_SIZE": "2"}, False),  # torchrun / deepspeed
    ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1"}, False),  # srun step
    # the bare sbatch shell: SLURM_PROCID=0 of SLURM_NTASKS=2, but no step: one process, rank 0
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}, True),
    # torchrun inside an srun step: torchrun's variables win, as in detect_env
    ({"RANK": "3", "WORLD_SIZE": "4", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
      "SLURM_LOCALID": "0"}, False),
])
def test_is_rank0_reads_the_launcher_as_detect_env_does(environ, rank0):
    from pipeline.dist import detect_env, is_rank0, launcher_of

    assert is_rank0(environ) is rank0
    if launcher_of(environ) != "single":  # detect_env needs a node list for Slurm; give it one
        env = detect_env({"SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "7", "MASTER_ADDR": "n1", **environ})
        assert env.is_main is rank0


ELASTIC = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_MAX_RESTARTS": "3"}


@pytest.mark.parametrize("change, warns", [
    ({}, True),                                               # elastic, shared store: a join would fail
    ({"TORCHELASTIC_USE_AGENT_STORE": "False"}, False),       # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 set
    ({"TORCHELASTIC_MAX_RESTARTS": "0"}, False),              # cannot restart, so nobody joins
    ({"TORCHELASTIC_RUN_ID": "none"}, False),                 # static rendezvous: fixed membership
    ({"TORCHELASTIC_USE_AGENT_STORE": None}, False),          # not under torchrun
])
def test_elastic_store_warning_only_where_a_join_would_fail(change, warns):
    environ = {k: v for k, v in {**ELASTIC, **change}.items() if v is not None}
    warning = elastic_store_warning(environ)
    assert (warning is not None) == warns
    if warns:
        assert SHARED_STORE_FIX in warning and "job7" in warning


@pytest.mark.slow
def test_deepspeed_is_imported_without_mlflow_and_inductor_and_mlflow_still_imports_after():
    # What deepspeed.initialize asks of every optimizer (is it Muon?) imports the Muon module; with its kernels
    # compiled at import, that imported torch._inductor (about 1.2 s of CPU per rank).
    code = ("import sys; from pipeline.dist import import_deepspeed; import_deepspeed(); "
            "import deepspeed.autotuning.autotuner as a; print('mlflow' in sys.modules, a.has_mlflow); "
            "from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam; "
            "print(MuonWithAuxAdam.__name__, 'torch._inductor' in sys.modules); "
            "import mlflow; print(type(mlflow.__version__).__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-5:] == ["False", "False", "MuonWithAuxAdam", "False", "str"], out.stdout


def test_the_exit_line_says_torchruns_agent_restarts_and_otherwise_a_requeue():
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert after_exit({**torchrun, "TORCHELASTIC_MAX_RESTARTS": "3"}) == "for torchrun's agent to restart the workers"
    assert after_exit({**torchrun, "TORCHELASTIC_MAX_RESTARTS": "0"}) == "to be requeued"  # torchrun, no restarts
    assert after_exit(torchrun) == "to be requeued"  # the deepspeed launcher sets no TORCHELASTIC_* variables
    assert after_exit({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0"}) \
        == "to be requeued"
