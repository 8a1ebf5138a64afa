"""SIGTERM however the job was started: to the `deepspeed` runner, to DeepSpeed's per-node launcher, to
torchrun, to the whole process group (`timeout`, `kill -TERM -PGID`, a container runtime), or to
`python -m pipeline.supervise` in front of the runner. Each ends in a checkpoint at a step boundary, the
ranks exit 75, and no process of the job outlives it; under the supervisor the process we started exits
75 too."""

import os
import signal
import subprocess
import threading
import time

import psutil
import pytest

from pipeline.train.checkpoint import check_tag, newest_complete_tag
from tests.integration.runs import DEEPSPEED, PYTHON, ROOT, TINY, env, free_port

pytestmark = pytest.mark.dist
CONFIG = "configs/pretrain/demo.yaml"
STEPS = 400  # never reached: the signal ends each run


# Runs launch/pretrain.py as it is and records each rank's exit code (the launchers report only their own).
RECORD_EXIT = """
import os, runpy, sys
from pathlib import Path
script = os.environ["WRAPPED_SCRIPT"]
sys.argv = [script, *[a for a in sys.argv[1:] if not a.startswith("--local_rank")]]
code = 1
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as e:
    code = int(e.code or 0)
finally:
    Path(os.environ["EXIT_DIR"], "rank" + os.environ["RANK"]).write_text(str(code))
sys.exit(code)
"""


def start(how: str, shards, run_dir, wrapper) -> subprocess.Popen:
    overrides = [*TINY, f"data.path={shards}", f"run.dir={run_dir}", f"train.steps={STEPS}", "train.ckpt_every=0",
                 "train.eval_every=0", "train.log_every=1", "data.num_workers=2"]
    script = str(wrapper)
    if how == "torchrun":
        argv = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
                script, "--config", CONFIG, *overrides]
    else:
        argv = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), script, "--config", CONFIG, *overrides]
    if how == "supervised":  # what a container's entry point, `kill` or a CI runner should start
        argv = [PYTHON, "-m", "pipeline.supervise", *argv]
    extra = {"WRAPPED_SCRIPT": str(ROOT / "launch/pretrain.py"), "EXIT_DIR": str(wrapper.parent)}
    return subprocess.Popen(argv, cwd=ROOT, env={**env(), **extra}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group, as a batch system gives it


def target(proc: subprocess.Popen, how: str) -> psutil.Process | None:
    if how == "launcher":  # deepspeed.launcher.launch, the runner's child that starts the ranks
        return next(c for c in psutil.Process(proc.pid).children() if "deepspeed.launcher.launch" in " ".join(c.cmdline()))
    return psutil.Process(proc.pid)  # the runner, torchrun, the supervisor


@pytest.mark.parametrize("how", ["runner", "launcher", "group", "torchrun", "supervised"])
def test_sigterm_ends_in_a_checkpoint_and_exit_75_of_every_rank(shards, tmp_path, how):
    run_dir = tmp_path / "run"
    wrapper = tmp_path / "record_exit.py"
    wrapper.write_text(RECORD_EXIT)
    proc = start("deepspeed" if how in ("runner", "launcher", "group") else how, shards, run_dir, wrapper)
    lines: list[str] = []
    signalled = threading.Event()
    job: list[psutil.Process] = []

    def read() -> None:  # until every process holding the pipe (runner, launcher, ranks, workers) has ended
        for line in proc.stdout:
            lines.append(line)
            if not signalled.is_set() and f"step 3/{STEPS}" in line:
                job.extend(psutil.Process(proc.pid).children(recursive=True))
                if how == "group":
                    os.killpg(proc.pid, signal.SIGTERM)
                else:
                    target(proc, how).send_signal(signal.SIGTERM)
                signalled.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=300)
    out = "".join(lines)
    if reader.is_alive():
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"still running 300 s after the start ({'signalled' if signalled.is_set() else 'no signal'}):\n"
                    + out[-4000:])
    proc.wait(timeout=60)
    assert signalled.is_set(), out[-3000:]
    assert "DataLoader worker" not in out, out[-4000:]
    # torchrun answers a signal to itself with a traceback of its own (SignalException); the ranks print none.
    own = 1 if how == "torchrun" and "SignalException: Process" in out else 0
    assert out.count("Traceback") == own, out[-4000:]
    assert out.count("preempted: checkpoint at step") == 1, out[-4000:]  # rank 0 says it once
    tag = newest_complete_tag(run_dir)
    assert tag is not None and check_tag(run_dir / "checkpoints" / tag) is None
    assert 3 <= int(tag.split("_")[1]) < STEPS
    time.sleep(1)
    assert not [p for p in job if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], "a process outlived the job"
    codes = {p.name: p.read_text() for p in tmp_path.glob("rank*")}
    assert codes == {"rank0": "75", "rank1": "75"}, (codes, out[-3000:])
    if how == "supervised":  # the process we started says 75 too, and no launcher was signalled
        assert proc.returncode == 75 and "SIGTERM: passing it to the ranks" in out, out[-3000:]
    print(f"SIGTERM to the {how}: checkpoint {tag}, ranks exit 75, the process we started exits {proc.returncode}")
