"""A real Slurm cluster on this machine, for tests: munged, slurmctld and two slurmd "nodes" (n1, n2).

    cluster = SlurmCluster(tmp_dir)
    cluster.start()                      # raises SlurmUnavailable with the reason if it cannot
    job_id = cluster.sbatch(["slurm/pretrain.sh"], env={...})
    info = cluster.wait_job(job_id)      # {"JobState": "COMPLETED", "ExitCode": "0:0", ...}
    cluster.stop()                       # stops only the daemons started here, by pid

Both nodes live on loopback (NodeAddr=127.0.0.1, each slurmd on its own port), so a 2-node job
really runs two srun tasks through two slurmd/slurmstepd, with Slurm's own environment, signals
and requeue. Everything (config, state, spool, logs, munge socket and key) lives in one temp
dir; the only change outside it is an /etc/hosts line so that n1 and n2 resolve.

Debian's slurm-wlm and munge provide the binaries (tests/cluster/install_slurm.sh).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

NODES = ("n1", "n2")
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin")
FINISHED_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
    "PREEMPTED",
}


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here (not installed, not root, a daemon did not come up); the message says why."""


def find_binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for directory in SBIN_DIRS:
        candidate = Path(directory) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def free_ports(count: int) -> list[int]:
    """Distinct TCP ports that are free now (all sockets held open until every port is chosen)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def ensure_hosts_entry(names: tuple[str, ...] = NODES, hosts_file: Path = Path("/etc/hosts")) -> None:
    """Make the node names resolve to 127.0.0.1 (srun, slurmd and gloo look them up)."""
    missing = []
    for name in names:
        try:
            socket.gethostbyname(name)
        except OSError:
            missing.append(name)
    if not missing:
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"node names {missing} do not resolve and only root may add them to {hosts_file}")
    with hosts_file.open("a") as fh:
        fh.write(f"127.0.0.1 {' '.join(missing)}  # vit-pipeline tests/cluster\n")


def parse_scontrol_record(text: str) -> dict[str, str]:
    """`scontrol show job -o` output ("Key=Value Key=Value ...") as a dict."""
    record = {}
    for match in re.finditer(r"(\S+?)=(\S*)", text):
        record.setdefault(match.group(1), match.group(2))
    return record


@dataclass
class SlurmCluster:
    root: Path
    nodes: tuple[str, ...] = NODES
    cluster_name: str = "vitpipe"
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    # ------------------------------------------------------------------ layout

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    @property
    def log_dir(self) -> Path:
        return self.root / "log"

    @property
    def env(self) -> dict[str, str]:
        """Environment for Slurm client commands (and jobs, which inherit it) on this cluster."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        # Debian keeps slurmd/slurmctld in sbin; jobs only need the client commands, which are in bin.
        env["PATH"] = os.pathsep.join([env.get("PATH", ""), *SBIN_DIRS])
        for var in list(env):  # a test run inside a Slurm job must not leak that job's identity
            if var.startswith("SLURM_") and var != "SLURM_CONF":
                del env[var]
        return env

    # ------------------------------------------------------------------ start/stop

    def check_prerequisites(self) -> None:
        missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "scontrol")
                   if find_binary(b) is None]
        if missing:
            raise SlurmUnavailable(f"not installed: {', '.join(missing)} (run tests/cluster/install_slurm.sh as root)")
        if os.geteuid() != 0:
            raise SlurmUnavailable("the local Slurm cluster needs root (slurmd runs jobs as their user)")

    def start(self, timeout_s: float = 60) -> None:
        self.check_prerequisites()
        ensure_hosts_entry(self.nodes)
        for sub in ("etc", "state", "spool", "log", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        try:
            self._start_munge()
            self._write_config()
            self._spawn("slurmctld", [find_binary("slurmctld"), "-D", "-f", str(self.conf)])
            for node in self.nodes:
                (self.root / "spool" / node).mkdir(exist_ok=True)
                self._spawn(f"slurmd-{node}", [find_binary("slurmd"), "-D", "-N", node, "-f", str(self.conf)])
            self._wait_nodes_idle(timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Cancel this cluster's jobs, then stop the daemons started here (SIGTERM, then SIGKILL)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "--user", str(os.geteuid())], check=False, timeout=10)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and self.running_job_ids():
                time.sleep(0.5)
        # Reverse start order: slurmds, then slurmctld, then munged (which the others talk to).
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        self.procs.clear()

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = (self.log_dir / f"{name}.stdout").open("ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=self.env, start_new_session=True)
        log.close()
        self.procs[name] = proc
        time.sleep(0.2)
        if proc.poll() is not None:
            raise SlurmUnavailable(f"{name} exited with {proc.returncode} at start:\n{self.logs(name)}")
        return proc

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
        self.root.joinpath("munge").chmod(0o700)
        self._spawn("munged", [
            find_binary("munged"), "--foreground", "--force",
            f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={self.root / 'munge' / 'munged.pid'}",
            f"--log-file={self.log_dir / 'munged.log'}",
            f"--seed-file={self.root / 'munge' / 'munged.seed'}",
        ])
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            if time.monotonic() > deadline or self.procs["munged"].poll() is not None:
                raise SlurmUnavailable(f"munged did not create {self.munge_socket}:\n{self.logs('munged')}")
            time.sleep(0.1)

    def _write_config(self) -> None:
        ctld_port, *node_ports = free_ports(1 + len(self.nodes))
        # Each "node" gets half the machine's cores (at least one): Slurm drains a node whose
        # configured CPUs exceed what slurmd finds, and both slurmds see the same hardware.
        cpus = max(1, (os.cpu_count() or 2) // len(self.nodes))
        hostname = socket.gethostname()
        root = self.root
        lines = [
            f"ClusterName={self.cluster_name}",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={node_ports[0]}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire also sets how long a requeued job waits before it may start again
            # (default 120 s); the preemption tests requeue several times.
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool' / '%n'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={self.log_dir / 'slurmctld.log'}",
            f"SlurmdLogFile={self.log_dir / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # No cgroups: the test machine may be a container without a writable cgroup tree.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin",
            # Look at the queue every few seconds: a requeued job becomes eligible by the clock, not an event.
            "SchedulerParameters=sched_interval=2",
            "MpiDefault=none",
            "JobRequeue=1",
            "ReturnToService=2",
            "KillWait=10",
            # Keep finished jobs visible to `scontrol show job` (there is no accounting database).
            "MinJobAge=600",
            "InactiveLimit=0",
            "SlurmdTimeout=300",
            "SlurmctldTimeout=120",
        ]
        for node, port in zip(self.nodes, node_ports):
            lines.append(f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname={hostname} Port={port} "
                         f"CPUs={cpus} RealMemory=1000 State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        (self.conf.parent / "cgroup.conf").write_text(
            "# Not used (proctrack/linuxproc, task/none); present so no plugin goes looking for the system one.\n"
            "CgroupAutomount=no\nConstrainCores=no\nConstrainRAMSpace=no\nConstrainDevices=no\n"
        )

    def _wait_nodes_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited with {proc.returncode}:\n{self.logs(name)}")
            result = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, timeout=10)
            states = dict(line.split() for line in result.stdout.splitlines() if len(line.split()) == 2)
            if all(states.get(node) == "idle" for node in self.nodes):
                return
            time.sleep(0.5)
        raise SlurmUnavailable(f"nodes not idle after {timeout_s:.0f}s: {states}\n{self.logs()}")

    # ------------------------------------------------------------------ using it

    def run(self, argv: list[str], check: bool = True, timeout: float = 60,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        full_env = self.env
        full_env.update(env or {})
        result = subprocess.run(argv, capture_output=True, text=True, env=full_env, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout}{result.stderr}")
        return result

    def sbatch(self, argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
        """Submit a batch job and return its id (without waiting)."""
        full_env = self.env
        full_env.update(env or {})
        result = subprocess.run(["sbatch", "--parsable", *argv], capture_output=True, text=True,
                                env=full_env, cwd=cwd, timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(argv)} failed ({result.returncode}):\n{result.stderr}")
        return int(result.stdout.strip().split(";")[0])

    def sbatch_wait(self, argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None,
                    timeout_s: float = 300) -> tuple[int, int]:
        """`sbatch --wait`: submit, block until the job ends, return (job id, sbatch's exit code = the job's)."""
        full_env = self.env
        full_env.update(env or {})
        try:
            result = subprocess.run(["sbatch", "--parsable", "--wait", *argv], capture_output=True, text=True,
                                    env=full_env, cwd=cwd, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            self.run(["scancel", "--full", "--user", str(os.geteuid())], check=False)
            raise TimeoutError(f"sbatch --wait {' '.join(argv)} still running after {timeout_s:.0f}s") from exc
        first_line = result.stdout.strip().splitlines()[0] if result.stdout.strip() else ""
        if not first_line.split(";")[0].isdigit():
            raise RuntimeError(f"sbatch {' '.join(argv)} failed ({result.returncode}):\n{result.stderr}")
        return int(first_line.split(";")[0]), result.returncode

    def job_info(self, job_id: int) -> dict[str, str]:
        result = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        return parse_scontrol_record(result.stdout) if result.returncode == 0 else {}

    def running_job_ids(self) -> list[int]:
        result = self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=10)
        return [int(x) for x in result.stdout.split() if x.isdigit()]

    def wait_job(self, job_id: int, timeout_s: float = 300, poll_s: float = 0.5) -> dict[str, str]:
        """Wait until the job is finished (requeues included) and return its final scontrol record."""
        deadline = time.monotonic() + timeout_s
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job_info(job_id)
            if info.get("JobState") in FINISHED_STATES:
                return info
            time.sleep(poll_s)
        self.run(["scancel", str(job_id)], check=False)
        raise TimeoutError(f"job {job_id} not finished after {timeout_s:.0f}s: {info}\n{self.logs()}")

    def wait_state(self, job_id: int, states: set[str], timeout_s: float = 60) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job_info(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.2)
        raise TimeoutError(f"job {job_id} never reached {states}: {info}")

    def logs(self, name: str | None = None, tail: int = 40) -> str:
        """The last lines of the daemon logs (all, or one daemon's), for failure messages."""
        out = []
        for path in sorted(self.log_dir.glob("*")):
            if name is None or path.name.startswith(name):
                lines = path.read_text(errors="replace").splitlines()[-tail:]
                out.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(out)
