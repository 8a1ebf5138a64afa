"""MLflow tracking: one run per training job, resumed across requeues, never in training's way.

`tracker.py` is the live tracker (rank 0, a background thread); `sync.py` copies a run directory to a
store, live or later (`launch/sync_mlflow.py`).

    tracker = start_tracking(cfg, run_dir, is_main=env.is_main, world_size=env.world_size)
    tracker.log_metrics({"train/loss": 2.3}, step=10)
    tracker.finish()                # "FINISHED"; finish(None) leaves the run RUNNING for a requeue

Where: ``MLFLOW_TRACKING_URI``, else MLflow's own default (``./mlflow.db``, artifacts in ``./mlruns``),
so a plain ``mlflow ui`` there shows every run. The run directory is the record: the training thread
only writes metrics.jsonl and tracking.json; a background thread copies them to MLflow (`Syncer`,
progress per URI in mlflow_sync.json), says once when the server is down and catches up when it is
back. ``python launch/sync_mlflow.py RUN_DIR`` sends what a job could not (nothing twice). A requeued
job continues the run named in RUN_DIR/mlflow_sync.json; a param changed on resume becomes tag ``param_override.<key>``.
Every start logs run/world_size, run/restarts and run/lost_steps (`start_metrics`), so the UI shows an
elastic job shrinking and growing.
"""

from pipeline.tracking.sync import (
    METRICS_FILE,
    RECORD_FILE,
    SYNC_FILE,
    UI_COMMAND,
    recorded_run_id,
    sync_run_dir,
    tracking_uri,
    ui_hint,
)
from pipeline.tracking.tracker import Tracker, default_tags, start_metrics, start_tracking

__all__ = ["METRICS_FILE", "RECORD_FILE", "SYNC_FILE", "UI_COMMAND", "Tracker", "default_tags",
           "recorded_run_id", "start_metrics", "start_tracking", "sync_run_dir", "tracking_uri", "ui_hint"]
