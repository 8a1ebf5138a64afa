"""torchrun elastic on one machine: two agents (--nnodes 1:2 --nproc-per-node 1, c10d rendezvous on
loopback). Node 1 is SIGKILLed mid-run (agent and worker, as a lost machine), node 0 goes on alone from
the newest complete checkpoint and finishes with the weights of an uninterrupted 2-rank run. (A node
joining again is not tested yet: it fails in the next rendezvous round, see the test.)"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.integration.runs import PYTHON, ROOT, TINY, env, free_port, run, weights

pytestmark = [pytest.mark.dist, pytest.mark.slow]
CONFIG = "configs/pretrain/demo.yaml"
TORCHRUN = str(Path(PYTHON).with_name("torchrun"))
CKPT_EVERY = 5

# Each optimizer step takes at least STEP_S, so that a node has time to join before the run ends (a
# tiny model steps in milliseconds; torchrun's rendezvous takes seconds). Test-only, by wrapping.
SLOW_STEPS = """
import runpy, sys, time
sys.path.insert(0, sys.argv[2])  # this checkout's pipeline, before any installed one
from pipeline.train import trainer
real, step_s = trainer.backward_and_step, float(sys.argv[1])
def slow(engine, loss):
    time.sleep(step_s)
    return real(engine, loss)
trainer.backward_and_step = slow
sys.argv = sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
STEP_S = 0.1


def overrides(shards, run_dir: Path, steps: int = 30) -> list[str]:
    return [*TINY, f"data.path={shards}", f"run.dir={run_dir}", "deepspeed.zero_stage=1", f"train.steps={steps}",
            f"train.ckpt_every={CKPT_EVERY}", "train.eval_every=0", "train.keep_last=3"]


class Agent:
    """One torchrun agent (a "node") in its own session; its output lines with their arrival times."""

    def __init__(self, wrapper: Path, port: int, over: list[str]):
        argv = [TORCHRUN, "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test", "--max-restarts", "3",
                "--monitor-interval", "1", str(wrapper), str(STEP_S), str(ROOT), str(ROOT / "launch/pretrain.py"),
                "--config", CONFIG, *over]
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def wait_for(self, pattern: str, after: float = 0.0, timeout: float = 300) -> float:
        """Arrival time of the first line after `after` matching `pattern`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                if t >= after and re.search(pattern, line):
                    return t
            assert self.proc.poll() is None or self._reader.is_alive(), self.text()[-4000:]
            time.sleep(0.2)
        raise AssertionError(f"no line matching {pattern!r} in {timeout:.0f} s:\n{self.text()[-4000:]}")

    def text(self) -> str:
        return "".join(line for _, line in self.lines)

    def kill_node(self) -> None:
        """SIGKILL the agent and its workers at once: the machine is gone, nobody checkpoints."""
        procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        for p in procs:
            p.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    @staticmethod
    def first(agents: list[Agent], pattern: str, after: float = 0.0, timeout: float = 300) -> float:
        """The first line matching `pattern` in any agent's output (rank 0 may sit on either node)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [t for a in agents for t, line in list(a.lines) if t >= after and re.search(pattern, line)]
            if hits:
                return min(hits)
            time.sleep(0.2)
        raise AssertionError(f"no line matching {pattern!r} in {timeout:.0f} s:\n"
                             + "\n=====\n".join(a.text()[-3000:] for a in agents))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_a_lost_node_the_job_finishes_on_one_with_the_uninterrupted_weights(shards, tmp_path):
    ref = run("pretrain.py", CONFIG, overrides(shards, tmp_path / "ref"))
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]

    wrapper = tmp_path / "slow_steps.py"
    wrapper.write_text(SLOW_STEPS)
    port, over = free_port(), overrides(shards, tmp_path / "elastic")
    node0 = Agent(wrapper, port, over)
    # The c10d rendezvous store lives in the agent that binds --rdzv-endpoint first; losing that agent ends
    # the job (the limit docs/cluster.md names). Node 0 must be it: node 1 starts once the port listens.
    deadline = time.monotonic() + 60
    while not _listening(port):
        assert time.monotonic() < deadline and node0.proc.poll() is None, node0.text()[-3000:]
        time.sleep(0.2)
    node1 = Agent(wrapper, port, over)
    try:
        both = [node0, node1]
        Agent.first(both, r"world size 2 .* steps 0->")
        Agent.first(both, r"^step 8/")
        killed = time.monotonic()
        node1.kill_node()
        lost_at = max(int(m) for a in both for m in re.findall(r"^step (\d+)/", a.text(), re.M))
        # Node 0's worker fails on the dead peer (a gloo read error), its agent runs the rendezvous
        # again with the one node left and restarts the worker on world size 1, from the newest tag.
        alone = node0.wait_for(r"world size 1 .* steps \d+->", after=killed)
        first_alone = node0.wait_for(r"^step \d+/", after=alone)
        resumed = [int(m) for m in re.findall(r"resumed from \S+ at step (\d+)", node0.text())]
        assert resumed and lost_at - resumed[-1] <= CKPT_EVERY, node0.text()[-4000:]

        # Joining again is not tested: node 1's return dies in the next rendezvous round (DistStoreError
        # waiting for role_info / MASTER_ADDR), the join failure issue 34 names; it is not fixed yet.
        assert node0.proc.wait(timeout=300) == 0, node0.text()[-4000:]
    finally:
        node0.stop()
        node1.stop()
    print(f"loss: {first_alone - killed:.1f} s from SIGKILL to the first step on 1 rank")
    a, b = weights(tmp_path / "ref"), weights(tmp_path / "elastic")
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= 1e-6, f"largest weight difference {worst:.3g}"
