"""Process-group setup from whatever launched us: the DeepSpeed launcher/torchrun, Slurm's srun, or nothing.

    env = init_distributed()          # in every process, before building the engine
    if env.is_main: print(f"world size {env.world_size}")

Three launchers, one answer (`DistEnv`):

1. ``deepspeed``/``torchrun`` export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: use them.
2. ``srun`` (one task per GPU) exports SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_STEP_ID and the
   node list.
   Rank 0 runs on the first node of the step, so that node is the master; the port is derived from
   the job id so that two jobs sharing a node do not collide and every task computes the same one
   without talking to the others (no ssh, no hostfile).
3. Neither: a single process, rank 0 of 1, on a free local port (laptop, unit tests, or python run
   directly in a batch script without srun).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

TORCHRUN_VARS = ("RANK", "WORLD_SIZE")
SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
SLURM_PORT_BASE = 10000
SLURM_PORT_RANGE = 20000

_initialised_env: DistEnv | None = None  # what init_distributed() joined with, for repeated calls


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    source: str
    """"torchrun" (RANK/WORLD_SIZE set by the deepspeed launcher or torchrun), "slurm" or "single"."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class DistEnvError(RuntimeError):
    """The launcher's environment is inconsistent; the message names the variable."""


class PortInUse(DistEnvError):
    """Rank 0 cannot listen on MASTER_PORT: another job has it. The message says how to pick another."""

    def __init__(self, env: DistEnv):
        how = {"torchrun": "start with `deepspeed --master_port PORT ...` (or torchrun --master-port PORT)",
               "slurm": "export MASTER_PORT=PORT before srun (slurm/*.sh derive it from the job id)",
               "single": "set MASTER_PORT=PORT"}[env.source]
        super().__init__(f"port {env.master_port} on {env.master_addr} is taken (another job on this machine?): "
                         f"{how}, with a free PORT such as {free_port()}")


def _port_taken(port: int) -> bool:
    """Does something listen on `port` here? (Rank 0's process-group store must be able to.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free for the store
        try:
            sock.bind(("", port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def _int_var(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value is None or value == "":
        if default is None:
            raise DistEnvError(f"environment variable {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise DistEnvError(f"environment variable {name}={value!r} is not an integer") from None


def _split_top_level(nodelist: str) -> list[str]:
    """Split "n[1-3,7],gpu-a[01-02]" on the commas that are outside brackets."""
    parts, depth, current = [], 0, []
    for char in nodelist:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _expand_ranges(ranges: str) -> list[str]:
    """ "1-3,7" -> ["1", "2", "3", "7"]; zero padding is kept ("01-02" -> ["01", "02"])."""
    out = []
    for item in ranges.split(","):
        if "-" in item:
            lo, hi = item.split("-", 1)
            width = len(lo)
            out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
        else:
            out.append(item)
    return out


def expand_nodelist_python(nodelist: str) -> list[str]:
    """Expand a Slurm host list without Slurm: "n[1-3,7],gpu-a[01-02]" -> n1 n2 n3 n7 gpu-a01 gpu-a02.

    Handles one bracket group per host name (with an optional suffix), which is what Slurm
    produces for ordinary node names; `expand_nodelist` prefers ``scontrol`` when it exists.
    """
    hosts: list[str] = []
    for part in _split_top_level(nodelist):
        match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", part)
        if match is None:
            if "[" in part or "]" in part:
                raise DistEnvError(f"cannot parse Slurm node list {nodelist!r} (part {part!r})")
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        hosts.extend(f"{prefix}{r}{suffix}" for r in _expand_ranges(ranges))
    return hosts


def expand_nodelist(nodelist: str) -> list[str]:
    """Host names in a Slurm node list, in Slurm's order (``scontrol show hostnames``, else pure Python)."""
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        try:
            result = subprocess.run(
                [scontrol, "show", "hostnames", nodelist],
                capture_output=True, text=True, timeout=30, check=True,
            )
            hosts = result.stdout.split()
            if hosts:
                return hosts
        except (subprocess.SubprocessError, OSError):
            pass  # scontrol present but unusable (no slurm.conf here): the parser below is enough
    return expand_nodelist_python(nodelist)


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def slurm_master_port(environ: Mapping[str, str]) -> int:
    """MASTER_PORT if the user set one, else 10000 + job id mod 20000: the same in every task of a job."""
    if environ.get("MASTER_PORT"):
        return _int_var(environ, "MASTER_PORT")
    job_id = _int_var(environ, "SLURM_JOB_ID")
    return SLURM_PORT_BASE + job_id % SLURM_PORT_RANGE


def launcher_of(environ: Mapping[str, str]) -> str:
    """Which launcher started this process, by the one precedence every reader uses: "torchrun" (RANK and
    WORLD_SIZE, set by torchrun and the deepspeed launcher), "slurm" (an srun step) or "single"."""
    if all(environ.get(v) for v in TORCHRUN_VARS):
        return "torchrun"
    # Only inside an srun step: the batch shell also has SLURM_PROCID=0 and SLURM_NTASKS, but it is
    # one process, and taking it for rank 0 of N would wait forever for the other N-1.
    in_step = bool(environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID"))
    if in_step and all(environ.get(v) for v in SLURM_VARS):
        return "slurm"
    return "single"


def import_deepspeed() -> None:
    """Import DeepSpeed without two imports this pipeline never uses, each paid by every rank:

    - its autotuner's optional MLflow import (about 1.5 s of CPU), there only to log autotuning
      experiments, which this pipeline never runs. Only rank 0 tracks, and it imports MLflow itself
      (pipeline.tracking);
    - the compilation of its Muon optimizer's kernels at that module's import (torch.compile as a
      decorator imports torch._inductor: about 1.2 s of CPU). DeepSpeed imports the module in every
      `deepspeed.initialize` (to ask whether the optimizer is Muon), whatever the optimizer. It is
      imported here with DeepSpeed's own stand-in for a torch without compile (an undecorated function):
      Muon is not one of train.optimizer's choices, so its kernels never run.

    Call it before anything under pipeline.train."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        return  # already imported (and MLflow in use): nothing to save
    sys.modules["mlflow"] = None  # `import mlflow` raises ImportError: DeepSpeed sets has_mlflow = False
    try:
        import deepspeed  # noqa: F401
    finally:
        if sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]  # a later `import mlflow` (rank 0's tracker) imports it as usual
    from deepspeed.runtime import compiler

    compile_ = compiler.compile
    compiler.compile = lambda: compiler.dummy_decorator  # what @compiler.compile() gives without torch.compile
    try:
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    except ImportError:
        pass  # a DeepSpeed without Muon: nothing to skip
    finally:
        compiler.compile = compile_


def is_rank0(environ: Mapping[str, str] | None = None) -> bool:
    """Is this process rank 0 of its job (or alone)? The one test every rank-0-only message uses: the
    process group's rank once it exists; before it (config errors, the fine-tune source), the
    launcher's environment read as `detect_env` reads it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    environ = os.environ if environ is None else environ
    var = {"torchrun": "RANK", "slurm": "SLURM_PROCID"}.get(launcher_of(environ))
    return var is None or environ[var].strip() == "0"


def say(msg: str) -> None:
    """Print on rank 0 only (see is_rank0): the one rank-0 output of commands, fine-tuning, the trainer and
    resume, before and after the process group exists."""
    if is_rank0():
        print(msg, flush=True)


def detect_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Rank, world size and rendezvous address of this process, from the launcher's environment."""
    environ = os.environ if environ is None else environ
    launcher = launcher_of(environ)

    if launcher == "torchrun":
        return DistEnv(
            rank=_int_var(environ, "RANK"),
            # torchrun and the deepspeed launcher always set LOCAL_RANK; a hand-written
            # environment may not, and on one node the local rank is the rank.
            local_rank=_int_var(environ, "LOCAL_RANK", _int_var(environ, "RANK")),
            world_size=_int_var(environ, "WORLD_SIZE"),
            master_addr=environ.get("MASTER_ADDR") or "127.0.0.1",
            master_port=_int_var(environ, "MASTER_PORT", 29500),
            source="torchrun",
        )

    if launcher == "slurm":
        # The step's values are the ones that count: a step may use fewer tasks and nodes than the job.
        world_size = _int_var(environ, "SLURM_STEP_NUM_TASKS", _int_var(environ, "SLURM_NTASKS"))
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") \
            or environ.get("SLURM_NODELIST")
        if not nodelist:
            raise DistEnvError("running under Slurm but SLURM_JOB_NODELIST is not set")
        return DistEnv(
            rank=_int_var(environ, "SLURM_PROCID"),
            local_rank=_int_var(environ, "SLURM_LOCALID"),
            world_size=world_size,
            # srun's default block distribution puts rank 0 on the first node of the step.
            master_addr=environ.get("MASTER_ADDR") or expand_nodelist(nodelist)[0],
            master_port=slurm_master_port(environ),
            source="slurm",
        )

    return DistEnv(
        rank=0, local_rank=0, world_size=1,
        master_addr="127.0.0.1", master_port=free_port(), source="single",
    )


SHARED_STORE_FIX = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"  # for torchrun's environment: see elastic_store_warning


def elastic_store_warning(environ: Mapping[str, str]) -> str | None:
    """A warning for an elastic torchrun job whose agents share their rendezvous TCP store, else None.

    With the shared store (torch's default since 2.5) the agent that is rank 0 keeps the MASTER_ADDR and
    MASTER_PORT it published in its first round and never writes them under a later round's key prefix
    (torch 2.15, dynamic_rendezvous.py next_rendezvous: `_bootstrap_store_info` is built once). A node that
    joins a running job builds them anew, waits for that round's MASTER_ADDR, and both agents die of a
    DistStoreError after 60 s (`.../MASTER_ADDR` on the newcomer, `.../role_info/N` on rank 0); pytorch
    issue 135712 reports other restarts broken by the same sharing. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the agents' environment makes
    rank 0 publish a fresh address every round (tests/integration/test_torchrun_elastic.py joins with it).
    Only a job that can restart (--max-restarts > 0) under a named rendezvous (--rdzv-id; "none" is the
    static rendezvous's default, whose membership never changes) can meet this. The TORCHELASTIC_* variables
    read here are the ones torchrun's agent exports into every worker (local_elastic_agent.py)."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    run_id = environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id == "none" or not environ.get("TORCHELASTIC_MAX_RESTARTS", "0").strip().isdigit() \
            or int(environ["TORCHELASTIC_MAX_RESTARTS"]) == 0:
        return None
    return (f"warning: torchrun --rdzv-id {run_id} can restart, but its agents share their rendezvous store: a node "
            f"that joins later will fail the next rendezvous (DistStoreError on MASTER_ADDR). Start torchrun with "
            f"{SHARED_STORE_FIX} in its environment (docs/cluster.md, Elastic).")


def after_exit(environ: Mapping[str, str] | None = None) -> str:
    """What follows a rank's exit 75, for its log line: torchrun's elastic agent (--max-restarts > 0) starts the
    workers again itself; under Slurm or deepspeed the job is requeued (or started again by the operator)."""
    environ = os.environ if environ is None else environ
    restarts = environ.get("TORCHELASTIC_MAX_RESTARTS", "0").strip()
    if launcher_of(environ) == "torchrun" and restarts.isdigit() and int(restarts) > 0:
        return "for torchrun's agent to restart the workers"
    return "to be requeued"


def _select_cuda_device(local_rank: int) -> None:
    import torch

    count = torch.cuda.device_count()
    # srun with --gpu-bind may leave each task exactly one visible GPU; otherwise all of the
    # node's GPUs are visible and the local rank picks one.
    torch.cuda.set_device(0 if count == 1 else local_rank % count)


def init_distributed(timeout_s: float = 600) -> DistEnv:
    """Join the process group (NCCL on GPU, gloo on CPU) and return this process's `DistEnv`.

    Exports RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT so that DeepSpeed and
    torch.distributed read the same values whichever launcher started us. Calling it again
    in an initialised process returns the environment without re-initialising.
    """
    import torch
    import torch.distributed as torch_dist

    global _initialised_env
    if torch_dist.is_available() and torch_dist.is_initialized():
        # After our own export, detect_env() would report "torchrun"; keep the original answer.
        return _initialised_env or detect_env()

    env = detect_env()
    os.environ.update(
        RANK=str(env.rank),
        LOCAL_RANK=str(env.local_rank),
        WORLD_SIZE=str(env.world_size),
        MASTER_ADDR=env.master_addr,
        MASTER_PORT=str(env.master_port),
    )
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        _select_cuda_device(env.local_rank)

    import deepspeed

    # Rank 0 hosts the store the others rendezvous at: a taken port would otherwise be a page of
    # DistNetworkError from every rank. Checked before, and recognised in, the init itself (a race).
    # (Under torchrun its agent hosts the store on MASTER_PORT itself: taken, and rightly so.)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if env.rank == 0 and env.world_size > 1 and not agent_store and _port_taken(env.master_port):
        raise PortInUse(env)
    try:
        deepspeed.init_distributed(
            dist_backend="nccl" if use_cuda else "gloo",
            auto_mpi_discovery=False,  # the environment above is the truth; never probe for mpirun
            timeout=timedelta(seconds=timeout_s),
            verbose=False,
        )
    except RuntimeError as e:  # torch's DistNetworkError is one
        if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
            raise PortInUse(env) from None
        raise
    if not use_cuda:
        _unlink_cpu_allreduce_buffer(env)
    warning = elastic_store_warning(os.environ)
    if warning and env.is_main:
        print(warning, flush=True)
    _initialised_env = env
    return env


CPU_ALLREDUCE_BUFFERS = "/dev/shm/deepspeed_allreduce_buffer_*"  # every job's (a glob), for cleanup and tests


def cpu_allreduce_buffer(env: DistEnv) -> str:
    """The /dev/shm file DeepSpeed's CPU all-reduce (deepspeed_shm_comm) creates for this rank.

    Named as in DeepSpeed's csrc/cpu/comm/shm.cpp: prefix, uid, master address, port, global rank.
    """
    return CPU_ALLREDUCE_BUFFERS.replace("*", f"{os.getuid()}_{env.master_addr}_{env.master_port}_{env.rank}")


def _unlink_cpu_allreduce_buffer(env: DistEnv) -> None:
    """Unlink this rank's 69 MB shared-memory all-reduce buffer as soon as every rank has mapped it.

    DeepSpeed (0.19) never unlinks it, so each CPU run left 69 MB per rank in /dev/shm (RAM) until reboot:
    a few hundred test runs filled a 24 GiB machine. After the barrier all ranks hold their mappings
    (shm_initialize maps every peer before returning), so the name can go; the memory itself is freed
    when the last rank exits, however it exits (SIGKILL included).
    """
    import torch.distributed as torch_dist

    torch_dist.barrier()
    try:
        os.unlink(cpu_allreduce_buffer(env))
    except FileNotFoundError:
        pass  # shm all-reduce is only used when all ranks share one node (LOCAL_SIZE == WORLD_SIZE)
