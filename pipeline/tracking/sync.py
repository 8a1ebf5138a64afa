"""Copying a run directory to an MLflow store: what the live tracker's background thread does, and what
`python launch/sync_mlflow.py RUN_DIR` does later for what a job could not send.

The run directory is the record (metrics.jsonl, tracking.json); per tracking URI, mlflow_sync.json
holds the run's id in that store and how much of the record it has, so nothing is sent twice. It is
the one place a run id is kept (`recorded_run_id`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from pipeline import atomic

METRICS_FILE = "metrics.jsonl"
RECORD_FILE = "tracking.json"
SYNC_FILE = "mlflow_sync.json"
DEFAULT_DB = "mlflow.db"  # MLflow's own default store (mlflow.store.tracking.DEFAULT_TRACKING_URI)
UI_COMMAND = "mlflow ui"
UI_QUERY = "?workflowType=machine_learning"  # MLflow 3's switch from its GenAI pages to training runs
SYNC_COMMAND = "python launch/sync_mlflow.py"
# Tells MLflow 3's UI what the experiment holds (mlflow.experimentKind; "custom_model_development"
# is the UI's "Machine learning" kind, as opposed to GenAI apps and agents).
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
MAX_PARAM_VALUE = 6000  # mlflow.utils.validation: longer values are refused, not truncated


def say(msg: str, err: bool = False) -> None:
    print(f"[tracking] {msg}", file=sys.stderr if err else sys.stdout, flush=True)


def tracking_uri(uri: str | None = None) -> str:
    """`uri`, else MLFLOW_TRACKING_URI, else MLflow's default ./mlflow.db; a relative SQLite path is made
    absolute (one spelling per store: the sync state is keyed by it, and the thread must not depend on the cwd)."""
    uri = (uri or "").strip() or os.environ.get("MLFLOW_TRACKING_URI", "").strip() or f"sqlite:///{DEFAULT_DB}"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////") and ":memory:" not in uri:
        uri = f"sqlite:///{Path.cwd() / uri[len('sqlite:///'):]}"
    return uri


def _artifact_root(uri: str, experiment: str) -> str | None:
    """A SQLite store keeps artifacts beside it in mlruns/ (for ./mlflow.db that is MLflow's own default,
    ./mlruns; elsewhere MLflow would use the cwd of whichever job made the experiment)."""
    if not uri.startswith("sqlite:////"):
        return None  # a server decides for itself
    db = Path(uri[len("sqlite:///"):].partition("?")[0])
    return str(db.parent / "mlruns" / "".join(c if c.isalnum() or c in "-_." else "_" for c in experiment))


def experiment(client: Any, uri: str, name: str) -> Any:
    """The MLflow experiment `name` in store `uri`, made (its artifacts beside a SQLite store) when missing."""
    from mlflow.exceptions import MlflowException

    if client.get_experiment_by_name(name) is None:
        with contextlib.suppress(MlflowException):  # RESOURCE_ALREADY_EXISTS: another job just made it
            client.create_experiment(name, artifact_location=_artifact_root(uri, name), tags=EXPERIMENT_TAGS)
    return client.get_experiment_by_name(name)


def ui_hint(uri: str, experiment_id: str | None = None) -> str:
    """How to look at the runs: plain `mlflow ui` for the default store, the server's page otherwise."""
    page = f"/#/experiments/{experiment_id}/runs{UI_QUERY}" if experiment_id else f"/{UI_QUERY}"
    if uri.startswith("http"):
        return f"open {uri.rstrip('/')}{page}"
    where = f"(in {Path.cwd()})" if uri == f"sqlite:///{Path.cwd() / DEFAULT_DB}" else f"--backend-store-uri {uri}"
    return f"browse with: {UI_COMMAND} {where}, then open http://127.0.0.1:5000{page}"


def write_json(path: Path, data: Any) -> None:
    atomic.write_text(path, json.dumps(data, indent=1, sort_keys=True))


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def param_value(value: Any) -> str:
    return (json.dumps(value) if isinstance(value, (list, dict)) else str(value))[:MAX_PARAM_VALUE]


class Syncer:
    """Brings one tracking URI up to date with one run directory (live worker and sync_mlflow.py).

    mlflow_sync.json: {uri: {"run_id", "offset", "artifacts", "models", "ended"}}; "offset" is how many bytes
    of metrics.jsonl that URI has, "models" each MLflow Model sent and the version it was registered as, so
    nothing is sent or registered twice."""

    def __init__(self, run_dir: Path, uri: str, record: Callable[[], dict[str, Any]], live: bool):
        self.run_dir, self.uri, self.record, self.live = run_dir, uri, record, live
        self.client: Any = None
        self.run_id = self.experiment_id = None
        self.resumed = False
        self.sent = {"metrics": 0, "params": 0, "artifacts": 0, "skipped_lines": 0}
        self.tags_sent: dict[str, str] = {}
        self.state = read_json(run_dir / SYNC_FILE)
        self.entry = self.state.setdefault(uri, {"offset": 0, "artifacts": {}})

    def _save(self) -> None:
        write_json(self.run_dir / SYNC_FILE, self.state)

    def connect(self) -> None:
        """Find (or create) this run directory's run on this URI; log params, tags and the config."""
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        client, rec = MlflowClient(self.uri), self.record()
        candidate, run = self.entry.get("run_id"), None
        if candidate:
            try:
                run = client.get_run(candidate)
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
            if run is None or run.info.lifecycle_stage == "deleted":
                say(f"run {candidate} is gone from {self.uri}; creating a new one", err=True)
                run = None
        if run is None:
            run = self._create_run(client, rec)
            self.entry = self.state[self.uri] = {"run_id": run.info.run_id, "offset": 0, "artifacts": {}}
        else:
            self.resumed = True
            if self.live and run.info.status != "RUNNING":
                client.update_run(run.info.run_id, status="RUNNING")
                self.entry.pop("ended", None)
        self._save()
        self.client, self.run_id, self.experiment_id = client, run.info.run_id, run.info.experiment_id
        self._log_params(run.data.params, rec.get("params", {}))
        self.tags_sent = {}
        self._log_tags(rec.get("tags", {}))
        if rec.get("config") is not None:
            client.log_text(self.run_id, yaml.safe_dump(rec["config"], sort_keys=False), "config.yaml")

    def _create_run(self, client: Any, rec: dict[str, Any]) -> Any:
        from mlflow.tracking.context.registry import resolve_tags

        name = rec.get("experiment") or "Default"
        exp = experiment(client, self.uri, name)
        if exp.lifecycle_stage == "deleted":
            raise RuntimeError(f"experiment '{name}' is deleted at {self.uri}: restore it (mlflow experiments "
                               f"restore --experiment-id {exp.experiment_id}) or set tracking.experiment")
        for key, value in EXPERIMENT_TAGS.items():
            if key not in exp.tags:  # an experiment made before, or by someone else
                client.set_experiment_tag(exp.experiment_id, key, value)
        # MLflow's context providers give user, source and git commit (the fluent API adds them itself).
        return client.create_run(exp.experiment_id, start_time=rec.get("start_time"), run_name=rec.get("run_name"),
                                 tags={**resolve_tags(), **rec.get("tags", {})})

    def _log_params(self, existing: dict[str, str], params: dict[str, str]) -> None:
        from mlflow.entities import Param

        new = [Param(k, v) for k, v in params.items() if k not in existing]
        if new:
            self.client.log_batch(self.run_id, params=new, synchronous=True)  # MLflow splits big batches itself
        self.sent["params"] += len(new)
        changed = {f"param_override.{k}": v for k, v in params.items() if existing.get(k, v) != v}
        if changed:
            say(f"resumed run {self.run_id} with changed params (MLflow keeps the first value; the new one "
                 f"is tag param_override.<key>): {', '.join(k[15:] for k in changed)}")
            self._log_tags(changed)

    def _log_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        todo = {k: str(v) for k, v in tags.items() if self.tags_sent.get(k) != str(v)}
        if todo:
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in todo.items()], synchronous=True)
            self.tags_sent.update(todo)

    def push(self) -> None:
        """Send new tags, metric lines, artifacts and the final status."""
        rec = self.record()
        self._log_tags(rec.get("tags", {}))
        self._push_metrics()
        for item in rec.get("artifacts", []):
            with contextlib.suppress(OSError):  # a file that is gone (a cleaned-up checkpoint): nothing to send
                st = Path(item["path"]).stat()
                if self.entry["artifacts"].get(item["path"]) != f"{st.st_size}:{st.st_mtime_ns}":
                    self.client.log_artifact(self.run_id, item["path"], item.get("artifact_path"))
                    self.entry["artifacts"][item["path"]] = f"{st.st_size}:{st.st_mtime_ns}"
                    self.sent["artifacts"] += 1
                    self._save()
        for item in rec.get("models", []):
            self._push_model(item)
        ended = [rec.get("status"), rec.get("end_time")]
        if rec.get("status") and self.entry.get("ended") != ended:
            self.client.set_terminated(self.run_id, status=rec["status"], end_time=rec.get("end_time"))
            self.entry["ended"] = ended
            self._save()

    def _push_model(self, item: dict[str, Any]) -> None:
        """An MLflow Model folder (pipeline/tracking/served.py) as the run's artifact, once per version of the
        folder; then, with a name to register it under, a new version of that registered model, once."""
        try:
            stamp = str((Path(item["path"]) / "MLmodel").stat().st_mtime_ns)
        except OSError:
            return  # the folder is gone: nothing to send
        done = self.entry.setdefault("models", {}).get(item["artifact_path"], {})
        if done.get("stamp") != stamp:
            self.client.log_artifacts(self.run_id, item["path"], item["artifact_path"])
            done = self.entry["models"][item["artifact_path"]] = {"stamp": stamp}
            self.sent["artifacts"] += 1
            self._save()
        if item.get("register") and done.get("registered") != item["register"]:
            version = register_model(self.client, item["register"], self.run_id, item["artifact_path"],
                                     item.get("description", ""))
            done.update(registered=item["register"], version=version)
            self._save()
            say(f"registered {item['register']} version {version} (models:/{item['register']}/{version}): "
                f"{item.get('description', '')}")

    def _push_metrics(self) -> None:
        """Send the complete lines of metrics.jsonl past this URI's offset (MLflow splits the batch)."""
        from mlflow.entities import Metric

        try:
            with open(self.run_dir / METRICS_FILE, "rb") as fh:
                fh.seek(self.entry["offset"])
                data = fh.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # a line being written right now waits for the next round
        metrics, damaged = [], []
        at = self.entry["offset"]  # byte offset of the current line in metrics.jsonl, to name it
        for line in data[:end].split(b"\n")[:-1]:
            try:
                row = json.loads(line)
                step, stamp = int(row["step"]), int(float(row["time"]) * 1000)
                metrics += [Metric(str(k), float(v), stamp, step) for k, v in row["metrics"].items()]
            except (ValueError, KeyError, TypeError, AttributeError) as e:  # a damaged line (a disk full, an edit)
                damaged.append(f"byte {at}: {type(e).__name__}: {line[:80]!r}")
            at += len(line) + 1
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics, synchronous=True)
        self.sent["metrics"] += len(metrics)
        if damaged:  # not sendable, now or later: say so, and keep the count where sync_mlflow.py reports it
            self.sent["skipped_lines"] += len(damaged)
            self.entry["skipped_lines"] = self.entry.get("skipped_lines", 0) + len(damaged)
            say(f"{len(damaged)} line(s) of {self.run_dir / METRICS_FILE} are not metrics and were not sent "
                 f"({self.entry['skipped_lines']} in all for {self.uri}); first: {damaged[0]}", err=True)
        self.entry["offset"] += end
        self._save()


def register_model(client: Any, name: str, run_id: str, artifact_path: str, description: str) -> str:
    """A new version of registered model `name` (made when missing) from the run's artifact; its number."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    version = client.create_model_version(name, source=f"runs:/{run_id}/{artifact_path}", run_id=run_id,
                                          description=description)
    return str(version.version)


def recorded_run_id(run_dir: Path | str, uri: str | None = None) -> str | None:
    """The MLflow run id of RUN_DIR in store `uri` (default: the store its job logged to, tracking.json's
    "uri"), from mlflow_sync.json; None where that store never answered."""
    run_dir = Path(run_dir)
    uri = uri or read_json(run_dir / RECORD_FILE).get("uri")
    return read_json(run_dir / SYNC_FILE).get(uri, {}).get("run_id") if uri else None


def sync_run_dir(run_dir: Path | str, uri: str | None = None) -> dict[str, Any]:
    """Send to `uri` (default: `tracking_uri()`) whatever of RUN_DIR it does not have yet; again: nothing.

    Returns {"run_id", "uri", "created", "metrics", "params", "artifacts", "skipped_lines"} (counts of
    this call; skipped_lines are lines of metrics.jsonl that are not metrics, named on stderr)."""
    run_dir = Path(run_dir)
    if not (run_dir / RECORD_FILE).is_file():
        raise FileNotFoundError(f"{run_dir} has no {RECORD_FILE}: not a run directory written by pipeline.tracking")
    record = read_json(run_dir / RECORD_FILE)
    # MLflow reads its HTTP retry count from the environment only; setdefault keeps a user's value.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # a replay has time, but not minutes
    syncer = Syncer(run_dir, uri := tracking_uri(uri), lambda: record, live=False)
    syncer.connect()
    syncer.push()
    return {"run_id": syncer.run_id, "uri": uri, "created": not syncer.resumed, **syncer.sent}
