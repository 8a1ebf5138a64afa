"""slurm/pretrain.sh refuses settings it would otherwise ignore, in one line naming the variable, before
anything starts (bash only: these checks run before Python or srun)."""

import os
import subprocess
from pathlib import Path

import pytest

from pipeline.exit_codes import ExitCode

ROOT = Path(__file__).resolve().parents[2]


def _submit(**env: str) -> subprocess.CompletedProcess:
    # What sbatch gives the batch script: a job id and the directory it was submitted from.
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ELASTIC_"))}
    return subprocess.run(["bash", "slurm/pretrain.sh"], cwd=ROOT, capture_output=True, text=True, timeout=30,
                          env={**base, "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(ROOT), **env})


@pytest.mark.parametrize("var,value", [("ELASTIC_MAX_RESTARTS", "5"),
                                       ("ELASTIC_RDZV_CONF", "last_call_timeout=10")])
def test_an_elastic_setting_without_elastic_min_nodes_is_refused(var, value):
    proc = _submit(**{var: value})
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    assert proc.stderr.strip() == (f"error: {var}={value} is set but ELASTIC_MIN_NODES is not: set "
                                   f"ELASTIC_MIN_NODES to run elastically, or unset {var}")


@pytest.mark.parametrize("env,expected", [
    ({"ELASTIC_MIN_NODES": "3"}, "ELASTIC_MIN_NODES=3: expected a whole number from 1 to the job's 1 nodes"),
    ({"ELASTIC_MIN_NODES": "1", "ELASTIC_MAX_RESTARTS": "many"}, "ELASTIC_MAX_RESTARTS=many: expected a whole number"),
    ({"ELASTIC_MIN_NODES": "1", "ELASTIC_RDZV_CONF": "10"}, "ELASTIC_RDZV_CONF=10: expected key=value pairs"),
])
def test_a_malformed_elastic_setting_is_refused(env, expected):
    proc = _submit(**env)
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    assert proc.stderr.startswith(f"error: {expected}"), proc.stderr
