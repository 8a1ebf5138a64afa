"""The `slurm_cluster` fixture: one real local Slurm cluster (n1, n2) for the whole test session.

If Slurm cannot start here (not installed, not root) the tests skip and say why. CI sets
VIT_PIPELINE_REQUIRE_SLURM=1, which turns that skip into a failure: there the cluster must run.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from slurm_cluster import SlurmCluster, SlurmUnavailable  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def slurm_required() -> bool:
    return os.environ.get("VIT_PIPELINE_REQUIRE_SLURM", "") not in ("", "0")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm")
    if len(str(root)) > 70:  # munge's socket path must fit in a sockaddr_un (108 bytes)
        root = Path(tempfile.mkdtemp(prefix="vit-slurm-"))
    cluster = SlurmCluster(root)
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        message = f"local Slurm cluster unavailable: {exc}"
        if slurm_required():
            pytest.fail(f"{message}\n(VIT_PIPELINE_REQUIRE_SLURM=1: the Slurm tests must run here)", pytrace=False)
        pytest.skip(message)
    yield cluster
    cluster.stop()


@pytest.fixture
def job_dir(tmp_path, slurm_cluster) -> Path:
    """A directory for one test's logs and run dirs, readable by the jobs (which run as root here).

    On the way out, whatever the test left queued or running is cancelled: a test that failed
    half-way must not hold both nodes and make every later test wait on its job."""
    (tmp_path / "logs").mkdir()
    yield tmp_path
    if slurm_cluster.running_job_ids():
        slurm_cluster.run(["scancel", "--full", "--user", str(os.geteuid())], check=False)
        deadline = time.monotonic() + 60
        while slurm_cluster.running_job_ids() and time.monotonic() < deadline:
            time.sleep(0.5)


@pytest.fixture(scope="session")
def digits_shards(tmp_path_factory) -> Path:
    """The demo's shards, written once per session (what `python launch/make_shards.py --source digits` writes)."""
    import subprocess

    out = tmp_path_factory.mktemp("digits")
    subprocess.run([sys.executable, "launch/make_shards.py", "--source", "digits", "--out", str(out),
                    "--overwrite", "--no-progress"], cwd=REPO, check=True, capture_output=True, timeout=300)
    return out
