"""pipeline.tracking: runs land in MLflow, resume the same run, survive a dead server, replay once."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

from pipeline.config import Config  # noqa: E402
from pipeline.tracking import (  # noqa: E402
    METRICS_FILE,
    SYNC_FILE,
    UI_COMMAND,
    Tracker,
    recorded_run_id,
    start_tracking,
    sync_run_dir,
)

REPO = Path(__file__).resolve().parents[2]
HTTP_VARS = ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES")


@pytest.fixture(scope="session")
def template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated, empty SQLite store: creating the tables takes seconds, copying it does not."""
    db = tmp_path_factory.mktemp("template") / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No tracking URI or HTTP limits leak in from the shell or from another test; cwd is tmp_path."""
    for var in ("MLFLOW_TRACKING_URI", *HTTP_VARS, "SLURM_JOB_ID", "SLURM_JOB_NODELIST"):
        monkeypatch.setenv(var, "x")  # recorded, so that teardown restores what the shell had
        monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)


def sqlite_store(tmp_path: Path, template_db: Path, name: str = "store") -> str:
    db = tmp_path / name / "mlflow.db"
    db.parent.mkdir(parents=True)
    shutil.copy(template_db, db)
    return f"sqlite:///{db}"


def make_cfg(**tracking) -> Config:
    cfg = Config()
    cfg.model.embed_dim = 192
    cfg.train.lr = 3e-4
    cfg.tracking.timeout_s = 20.0  # a local SQLite store always answers; a generous bound avoids flakes
    cfg.tracking.system_metrics = False
    for key, value in tracking.items():
        setattr(cfg.tracking, key, value)
    return cfg


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_metrics_params_tags_and_config_land_in_the_default_sqlite_store(tmp_path, template_db, capsys):
    shutil.copy(template_db, tmp_path / "mlflow.db")  # MLflow's default location, pre-migrated
    cfg = make_cfg()
    run_dir = tmp_path / "runs" / "pre"
    tracker = start_tracking(cfg, run_dir, is_main=True, world_size=4)
    for step in (10, 20, 30):
        tracker.log_metrics({"loss": 1.0 / step, "lr": 3e-4, "eval/top1": step / 100}, step=step)
    model = run_dir / "model.safetensors"
    model.write_bytes(b"weights")
    tracker.log_artifact(model)
    tracker.finish()

    assert UI_COMMAND in capsys.readouterr().out
    client = MlflowClient()  # no URI: where MLflow (and `mlflow ui`) look by default, from the same folder
    run = client.get_run(tracker.run_id)
    assert recorded_run_id(run_dir) == tracker.run_id  # mlflow_sync.json: the one file holding run ids
    assert not (run_dir / "mlflow_run_id").exists()
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "pre"
    assert run.data.params["model.embed_dim"] == "192"
    assert float(run.data.params["train.lr"]) == 3e-4
    assert run.data.params["model.variant"] == "vit_b16"
    assert history(client, tracker.run_id, "loss") == [(10, 0.1), (20, 0.05), (30, 1 / 30)]
    assert history(client, tracker.run_id, "eval/top1") == [(10, 0.1), (20, 0.2), (30, 0.3)]
    tags = run.data.tags
    assert (tags["kind"], tags["model_variant"], tags["world_size"], tags["zero_stage"]) == (
        "pretrain", "vit_b16", "4", "1")
    artifacts = {a.path for a in client.list_artifacts(tracker.run_id)}
    assert artifacts == {"config.yaml", "model.safetensors"}
    assert run.info.artifact_uri.startswith(str(tmp_path / "mlruns"))
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI's "Machine learning"
    assert tags["mlflow.user"] and tags["mlflow.source.name"]  # from MLflow's context providers
    assert [row["step"] for row in jsonl(run_dir / METRICS_FILE)] == [10, 20, 30]


def test_second_start_on_the_same_run_dir_continues_the_run(tmp_path, template_db, monkeypatch):
    uri = sqlite_store(tmp_path, template_db)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    run_dir = tmp_path / "run"
    first = start_tracking(make_cfg(), run_dir, is_main=True, world_size=1)
    for step in range(3):
        first.log_metrics({"loss": float(step)}, step=step)
    first.finish(status=None)  # preempted: the run stays open for the requeued job
    client = MlflowClient(uri)
    assert client.get_run(first.run_id).info.status == "RUNNING"

    cfg = make_cfg()
    cfg.train.lr = 1e-4  # changed on requeue: MLflow would refuse to overwrite the param
    second = start_tracking(cfg, run_dir, is_main=True, world_size=1)
    for step in range(3, 6):
        second.log_metrics({"loss": float(step)}, step=step)
    second.finish()

    assert second.run_id == first.run_id
    exp = client.get_experiment_by_name("vit-pipeline")
    assert len(client.search_runs([exp.experiment_id])) == 1
    assert history(client, first.run_id, "loss") == [(s, float(s)) for s in range(6)]
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert float(run.data.params["train.lr"]) == 3e-4
    assert float(run.data.tags["param_override.train.lr"]) == 1e-4


@pytest.mark.slow
def test_dead_server_never_blocks_training_and_replay_fills_the_store_once(tmp_path, template_db, monkeypatch,
                                                                          capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port()}")
    run_dir = tmp_path / "run"
    began = time.monotonic()
    tracker = start_tracking(make_cfg(timeout_s=2.0, retry_s=60.0), run_dir, is_main=True, world_size=1)
    for step in range(20):
        tracker.log_metrics({"loss": 1.0 / (step + 1), "images_per_s": 100.0 + step}, step=step)
    tracker.finish()
    assert time.monotonic() - began < 4.0
    assert tracker.run_id is None
    assert [row["step"] for row in jsonl(run_dir / METRICS_FILE)] == list(range(20))
    err = capsys.readouterr().err
    assert err.count("MLflow unreachable") == 1
    assert "launch/sync_mlflow.py" in err

    uri = sqlite_store(tmp_path, template_db)
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(REPO)}
    for attempt in range(2):
        out = subprocess.run([sys.executable, str(REPO / "launch" / "sync_mlflow.py"), str(run_dir)],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert f"sent {40 if attempt == 0 else 0} metric points" in out.stdout  # 20 steps x 2

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("vit-pipeline").experiment_id])
    assert history(client, run.info.run_id, "loss") == [(s, 1.0 / (s + 1)) for s in range(20)]
    assert len(client.get_metric_history(run.info.run_id, "images_per_s")) == 20
    assert run.data.params["model.embed_dim"] == "192"
    assert run.info.status == "FINISHED"
    assert recorded_run_id(run_dir, uri) == run.info.run_id and recorded_run_id(run_dir) is None  # the live store never answered


def test_slow_server_costs_at_most_the_timeout(tmp_path, monkeypatch):
    """A server that accepts connections and never answers (hung, overloaded)."""
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{hung.getsockname()[1]}")
        began = time.monotonic()
        tracker = start_tracking(make_cfg(timeout_s=1.0), tmp_path / "run", is_main=True, world_size=1)
        started = time.monotonic() - began
        for step in range(50):
            tracker.log_metrics({"loss": 1.0}, step=step)
        logged = time.monotonic() - began - started
        tracker.finish()
        total = time.monotonic() - began
    assert started < 2.5
    assert logged < 0.5
    assert total < 5.0
    assert len(jsonl(tmp_path / "run" / METRICS_FILE)) == 50


def test_store_that_comes_back_later_gets_everything(tmp_path, template_db, monkeypatch, capsys):
    store = tmp_path / "store"
    store.write_text("a file where the store's folder should be: MLflow cannot open it")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store / 'mlflow.db'}")
    run_dir = tmp_path / "run"
    tracker = start_tracking(make_cfg(retry_s=0.2), run_dir, is_main=True, world_size=1)
    for step in range(5):
        tracker.log_metrics({"loss": float(step)}, step=step)
    assert tracker.run_id is None

    store.unlink()
    store.mkdir()
    shutil.copy(template_db, store / "mlflow.db")
    deadline = time.monotonic() + 15
    while tracker.run_id is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tracker.run_id is not None  # the worker retried by itself while training went on
    for step in range(5, 10):
        tracker.log_metrics({"loss": float(step)}, step=step)
    tracker.finish()

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    assert history(client, tracker.run_id, "loss") == [(s, float(s)) for s in range(10)]
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    captured = capsys.readouterr()
    assert captured.err.count("MLflow unreachable") == 1
    assert "reachable again" in captured.out


def test_replay_appends_to_a_live_run_without_duplicates(tmp_path, template_db, monkeypatch):
    uri = sqlite_store(tmp_path, template_db)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    run_dir = tmp_path / "run"
    tracker = start_tracking(make_cfg(), run_dir, is_main=True, world_size=1)
    for step in range(5):
        tracker.log_metrics({"loss": float(step)}, step=step)
    tracker.finish()
    done = sync_run_dir(run_dir)
    assert (done["run_id"], done["created"], done["metrics"]) == (tracker.run_id, False, 0)
    assert len(MlflowClient(uri).get_metric_history(tracker.run_id, "loss")) == 5


def test_finetune_run_records_its_pretraining_run(tmp_path, template_db, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", sqlite_store(tmp_path, template_db))
    pre_dir = tmp_path / "runs" / "pre"
    pre = start_tracking(make_cfg(), pre_dir, is_main=True, world_size=8)
    (pre_dir / "model.safetensors").write_bytes(b"weights")
    pre.finish()

    cfg = make_cfg(log_model=False)
    cfg.run.kind = "finetune"
    cfg.finetune.source = str(pre_dir / "model.safetensors")
    ft_dir = tmp_path / "runs" / "ft"
    ft = start_tracking(cfg, ft_dir, is_main=True, world_size=1, tags={"dataset": "digits"})
    (ft_dir / "model.safetensors").write_bytes(b"tuned")
    ft.log_artifact(ft_dir / "model.safetensors")  # log_model off: a tag, not an upload
    ft.finish()

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    tags = client.get_run(ft.run_id).data.tags
    assert pre.run_id and ft.run_id != pre.run_id
    assert tags["parent_run_id"] == pre.run_id
    assert tags["source_path"] == str((pre_dir / "model.safetensors").resolve())
    assert tags["parent_run_name"] == "pre"
    assert (tags["kind"], tags["dataset"]) == ("finetune", "digits")
    assert "mlflow.parentRunId" not in tags
    assert tags["model_path"] == str((ft_dir / "model.safetensors").resolve())
    assert {a.path for a in client.list_artifacts(ft.run_id)} == {"config.yaml"}


def test_non_main_rank_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'store.db'}")
    run_dir = tmp_path / "run"
    tracker = start_tracking(make_cfg(), run_dir, is_main=False, world_size=8)
    tracker.log_metrics({"loss": 1.0}, step=1)
    tracker.set_tags({"a": "b"})
    tracker.log_artifact(tmp_path / "whatever.txt")
    tracker.finish()
    assert type(tracker) is Tracker and tracker.run_id is None
    assert list(tmp_path.iterdir()) == []


def test_disabled_tracking_writes_only_the_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    tracker = start_tracking(make_cfg(enabled=False), run_dir, is_main=True, world_size=1)
    tracker.log_metrics({"loss": 2.0, "bad_samples": 3}, step=7)
    tracker.finish()
    assert tracker.run_id is None
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "mlflow.db").exists()
    assert jsonl(run_dir / METRICS_FILE)[0]["metrics"] == {"loss": 2.0, "bad_samples": 3.0}
    assert recorded_run_id(run_dir) is None and not (run_dir / SYNC_FILE).exists()


def test_damaged_metric_lines_are_counted_and_named_and_the_rest_is_sent(tmp_path, template_db, capsys):
    """A line that is not metrics (a half-written line after a full disk, a hand edit) cannot be sent:
    the replay says how many and which, sends every good line, and does not mutate the environment."""
    run_dir = tmp_path / "run"
    tracker = start_tracking(make_cfg(enabled=False), run_dir, is_main=True, world_size=1)
    tracker.log_metrics({"loss": 1.0}, step=0)
    with open(run_dir / METRICS_FILE, "a") as fh:
        fh.write('{"step": 1, "time": 1.0, "metr\n')  # truncated mid-write
        fh.write('{"step": 2, "time": 1.0, "metrics": {"loss": "nan?"}}\n')  # a value that is no number
    tracker.log_metrics({"loss": 3.0}, step=3)
    tracker.finish()

    uri = sqlite_store(tmp_path, template_db)
    done = sync_run_dir(run_dir, uri)
    assert "MLFLOW_TRACKING_URI" not in os.environ  # the URI is an argument, not a process-wide setting
    assert (done["metrics"], done["skipped_lines"]) == (2, 2)
    err = capsys.readouterr().err
    assert "2 line(s) of" in err and "byte " in err and "metr" in err
    assert history(MlflowClient(uri), done["run_id"], "loss") == [(0, 1.0), (3, 3.0)]
    again = sync_run_dir(run_dir, uri)  # counted once: the offset moved past them
    assert (again["metrics"], again["skipped_lines"]) == (0, 0)


def test_start_metrics_count_the_starts_and_the_steps_lost_since_the_checkpoint(tmp_path):
    from pipeline.tracking import METRICS_FILE, start_metrics

    assert start_metrics(tmp_path, 0, 2) == {"run/world_size": 2.0, "run/restarts": 0.0, "run/lost_steps": 0.0}
    lines = [{"step": 0, "metrics": {"run/world_size": 2.0, "run/restarts": 0.0, "run/lost_steps": 0.0}},
             *({"step": s, "metrics": {"train/loss": 1.0}} for s in (2, 4, 6, 8)),
             {"step": 5, "metrics": {"run/world_size": 1.0, "run/restarts": 1.0, "run/lost_steps": 3.0}},
             {"step": 6, "metrics": {"train/loss": 1.0}}]
    text = "".join(json.dumps(x) + "\n" for x in lines) + '{"step": 12, "metri'  # cut short by a SIGKILL
    (tmp_path / METRICS_FILE).write_text(text)
    # Two starts recorded; the furthest step logged is 8 (the cut line does not count); resumed from 5.
    assert start_metrics(tmp_path, 5, 2) == {"run/world_size": 2.0, "run/restarts": 2.0, "run/lost_steps": 3.0}
    # A requeue that resumes where it stopped loses nothing.
    assert start_metrics(tmp_path, 8, 1)["run/lost_steps"] == 0.0


def test_a_refusal_of_mlflow_is_said_as_its_answer_not_as_an_outage() -> None:
    """A parameter name MLflow refuses (before data.sources names were checked: 'data.sources.a/b.weight') was
    said as "MLflow unreachable"; it is what MLflow answered."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    from pipeline.tracking.tracker import failure_said

    refused = MlflowException("Invalid value 'data.sources.a/b.weight' for parameter 'key'",
                              error_code=INVALID_PARAMETER_VALUE)
    assert failure_said("http://mlflow:5000", refused) == (
        "MLflow at http://mlflow:5000 answered INVALID_PARAMETER_VALUE: Invalid value 'data.sources.a/b.weight' "
        "for parameter 'key'")
    down = failure_said("http://mlflow:5000", ConnectionRefusedError(111, "Connection refused"))
    assert down.startswith("MLflow unreachable at http://mlflow:5000 (ConnectionRefusedError: "), down


def test_a_file_store_refusing_the_run_is_said_once_with_the_fix_and_not_retried(tmp_path, monkeypatch, capsys):
    """MLflow 3 answers a file: tracking URI INVALID_PARAMETER_VALUE ("maintenance mode") on every call: before,
    the thread retried it every tracking.retry_s for the whole run. Now: said once, with the store to use, never
    tried again; the run's metrics stay in metrics.jsonl for sync_mlflow.py."""
    from pipeline.tracking import sync

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    calls = []
    connect = sync.Syncer.connect
    monkeypatch.setattr(sync.Syncer, "connect", lambda self: calls.append(1) or connect(self))
    tracker = start_tracking(make_cfg(timeout_s=5.0, retry_s=0.1), tmp_path / "run", is_main=True, world_size=1)
    for step in range(10):
        tracker.log_metrics({"loss": 1.0}, step=step)
        time.sleep(0.05)  # five retry periods
    tracker.finish()
    err = capsys.readouterr().err
    assert len(calls) == 1, (calls, err)
    assert err.count("not retried") == 1 and "answered INVALID_PARAMETER_VALUE" in err, err
    assert "MLFLOW_TRACKING_URI=sqlite:///mlflow.db" in err and "MLflow unreachable" not in err, err
    assert len(jsonl(tmp_path / "run" / METRICS_FILE)) == 10
