"""Tracking from a real training run: a dead server costs seconds, and the replay fills the store later."""

import subprocess
import time

import pytest
from mlflow.tracking import MlflowClient

from pipeline.tracking import recorded_run_id
from tests.integration.runs import PYTHON, ROOT, TINY, env, free_port, run

pytestmark = pytest.mark.dist


def test_closed_port_does_not_stall_a_20_step_run_and_replay_fills_the_store(tmp_path, shards):
    common = [*TINY, f"data.path={shards}", "train.steps=20", "train.log_every=1", "train.eval_every=10",
              "tracking.enabled=true", "tracking.timeout_s=2", "tracking.system_metrics=false"]

    def timed(run_dir, uri):
        start = time.monotonic()
        out = run("pretrain.py", "configs/pretrain/demo.yaml", [*common, f"run.dir={run_dir}"], ranks=1,
                  extra_env={"MLFLOW_TRACKING_URI": uri})
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        return time.monotonic() - start, out

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    healthy, _ = timed(tmp_path / "healthy", store)
    dead_dir = tmp_path / "dead"
    dead, out = timed(dead_dir, f"http://127.0.0.1:{free_port()}")  # nothing listens there
    assert "MLflow unreachable" in out.stdout + out.stderr
    assert dead < healthy + 10, f"a dead tracking server slowed the run from {healthy:.1f}s to {dead:.1f}s"
    assert len((dead_dir / "metrics.jsonl").read_text().splitlines()) >= 20

    # Later, the server is back: the replay sends everything the job could not.
    replay = subprocess.run([PYTHON, "launch/sync_mlflow.py", str(dead_dir), "--uri", store], cwd=ROOT, env=env(),
                            capture_output=True, text=True, timeout=120)
    assert replay.returncode == 0, replay.stderr
    client = MlflowClient(tracking_uri=store)
    run_id = recorded_run_id(dead_dir, store)
    losses = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in losses) == list(range(1, 21))
    assert client.get_run(run_id).data.params["model.embed_dim"] == "32"
    # The healthy run and the replayed one sit in the same experiment, comparable.
    experiment = client.get_experiment_by_name("vit-pipeline-demo")
    assert len(client.search_runs([experiment.experiment_id])) == 2
