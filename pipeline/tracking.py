"""MLflow tracking: one run per training job, resumed across requeues, never in training's way.

    tracker = start_tracking(cfg, run_dir, is_main=env.is_main, world_size=env.world_size)
    tracker.log_metrics({"train/loss": 2.3}, step=10)
    tracker.finish()                # "FINISHED"; finish(None) leaves the run RUNNING for a requeue

Where: ``MLFLOW_TRACKING_URI``, else MLflow's own default (``./mlflow.db``, artifacts in ``./mlruns``),
so a plain ``mlflow ui`` there shows every run. The run directory is the record: the training thread
only writes metrics.jsonl and tracking.json; a background thread copies them to MLflow (`_Syncer`,
progress per URI in mlflow_sync.json), says once when the server is down and catches up when it is
back. ``python launch/sync_mlflow.py RUN_DIR`` sends what a job could not (nothing twice). A requeued
job continues the run in RUN_DIR/mlflow_run_id; a param changed on resume becomes tag ``param_override.<key>``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from pipeline.config import Config, flatten, to_dict

METRICS_FILE = "metrics.jsonl"
RECORD_FILE = "tracking.json"
RUN_ID_FILE = "mlflow_run_id"
SYNC_FILE = "mlflow_sync.json"
DEFAULT_DB = "mlflow.db"  # MLflow's own default store (mlflow.store.tracking.DEFAULT_TRACKING_URI)
UI_COMMAND = "mlflow ui"
UI_QUERY = "?workflowType=machine_learning"  # MLflow 3's switch from its GenAI pages to training runs
SYNC_COMMAND = "python launch/sync_mlflow.py"
# Tells MLflow 3's UI what the experiment holds (mlflow.experimentKind; "custom_model_development"
# is the UI's "Machine learning" kind, as opposed to GenAI apps and agents).
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
MAX_PARAM_VALUE = 6000  # mlflow.utils.validation: longer values are refused, not truncated


def _say(msg: str, err: bool = False) -> None:
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


def ui_hint(uri: str, experiment_id: str | None = None) -> str:
    """How to look at the runs: plain `mlflow ui` for the default store, the server's page otherwise."""
    page = f"/#/experiments/{experiment_id}/runs{UI_QUERY}" if experiment_id else f"/{UI_QUERY}"
    if uri.startswith("http"):
        return f"open {uri.rstrip('/')}{page}"
    where = f"(in {Path.cwd()})" if uri == f"sqlite:///{Path.cwd() / DEFAULT_DB}" else f"--backend-store-uri {uri}"
    return f"browse with: {UI_COMMAND} {where}, then open http://127.0.0.1:5000{page}"


def _parent_tags(source: str) -> dict[str, str]:
    """A fine-tune's link to its pretraining run: the source path and the run id found beside it.

    A plain tag, not mlflow.parentRunId: that one nests the fine-tune under its parent in the runs
    table (hidden until expanded), while a tag keeps both as rows to compare side by side."""
    path = Path(source).expanduser().resolve()
    tags, note = {"source_path": str(path)}, f"Fine-tuned from `{path}`."
    here = path if path.is_dir() else path.parent
    for folder in (here, *here.parents[:2]):  # run dir, or a file in it or in its checkpoints/<tag>/
        if (folder / RUN_ID_FILE).is_file():
            parent = tags["parent_run_id"] = (folder / RUN_ID_FILE).read_text().strip()
            tags["parent_run_name"] = str(_read_json(folder / RECORD_FILE).get("run_name", folder.name))
            note = f"Fine-tuned from `{path}` (pretraining run `{parent}`)."
            break
    return {**tags, "mlflow.note.content": note}


def default_tags(cfg: Config, run_dir: Path, world_size: int) -> dict[str, str]:
    """What to filter and group runs by. Git commit, user and source come from MLflow's context providers."""
    tags = {"kind": cfg.run.kind, "model_variant": cfg.model.variant, "world_size": str(world_size),
            "zero_stage": str(cfg.deepspeed.zero_stage), "run_dir": str(run_dir.resolve()),
            "host": socket.gethostname()}
    if os.environ.get("SLURM_JOB_ID"):
        for tag, var in (("slurm_job_id", "SLURM_JOB_ID"), ("slurm_nodelist", "SLURM_JOB_NODELIST"),
                         ("slurm_restart_count", "SLURM_RESTART_COUNT")):
            if os.environ.get(var):
                tags[tag] = os.environ[var]
    if cfg.run.kind == "finetune" and cfg.finetune.source:
        tags.update(_parent_tags(cfg.finetune.source))
    return tags


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _param_value(value: Any) -> str:
    return (json.dumps(value) if isinstance(value, (list, dict)) else str(value))[:MAX_PARAM_VALUE]


class _Syncer:
    """Brings one tracking URI up to date with one run directory (live worker and sync_mlflow.py).

    mlflow_sync.json: {uri: {"run_id", "offset", "artifacts", "ended"}}; "offset" is how many bytes
    of metrics.jsonl that URI has, so nothing is sent twice."""

    def __init__(self, run_dir: Path, uri: str, record: Callable[[], dict[str, Any]], live: bool):
        self.run_dir, self.uri, self.record, self.live = run_dir, uri, record, live
        self.client: Any = None
        self.run_id = self.experiment_id = None
        self.resumed = False
        self.sent = {"metrics": 0, "params": 0, "artifacts": 0, "skipped_lines": 0}
        self.tags_sent: dict[str, str] = {}
        self.state = _read_json(run_dir / SYNC_FILE)
        self.entry = self.state.setdefault(uri, {"offset": 0, "artifacts": {}})

    def _save(self) -> None:
        _write_json(self.run_dir / SYNC_FILE, self.state)

    def connect(self) -> None:
        """Find (or create) this run directory's run on this URI; log params, tags and the config."""
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        client, rec, id_file = MlflowClient(self.uri), self.record(), self.run_dir / RUN_ID_FILE
        same_store = rec.get("uri") == self.uri
        candidate = self.entry.get("run_id") or (id_file.read_text().strip() if same_store and id_file.is_file()
                                                 else None)
        run = None
        if candidate:
            try:
                run = client.get_run(candidate)
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
            if run is None or run.info.lifecycle_stage == "deleted":
                _say(f"run {candidate} is gone from {self.uri}; creating a new one", err=True)
                run = None
        if run is None:
            run = self._create_run(client, rec)
            self.entry = self.state[self.uri] = {"run_id": run.info.run_id, "offset": 0, "artifacts": {}}
        else:
            self.resumed = True
            if self.entry.get("run_id") != run.info.run_id:  # known run, sync state lost: skip what it has
                skip = {k: max(m.step for m in client.get_metric_history(run.info.run_id, k)) for k in run.data.metrics}
                self.entry = self.state[self.uri] = {"run_id": run.info.run_id, "offset": 0, "artifacts": {},
                                                     "skip_upto": skip}
            if self.live and run.info.status != "RUNNING":
                client.update_run(run.info.run_id, status="RUNNING")
                self.entry.pop("ended", None)
        self._save()
        self.client, self.run_id, self.experiment_id = client, run.info.run_id, run.info.experiment_id
        if self.live or same_store or not id_file.exists():  # a replay elsewhere keeps the live store's id
            id_file.write_text(self.run_id + "\n")
        self._log_params(run.data.params, rec.get("params", {}))
        self.tags_sent = {}
        self._log_tags(rec.get("tags", {}))
        if rec.get("config") is not None:
            client.log_text(self.run_id, yaml.safe_dump(rec["config"], sort_keys=False), "config.yaml")

    def _create_run(self, client: Any, rec: dict[str, Any]) -> Any:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking.context.registry import resolve_tags

        name = rec.get("experiment") or "Default"
        if client.get_experiment_by_name(name) is None:
            with contextlib.suppress(MlflowException):  # RESOURCE_ALREADY_EXISTS: another job just made it
                client.create_experiment(name, artifact_location=_artifact_root(self.uri, name), tags=EXPERIMENT_TAGS)
        exp = client.get_experiment_by_name(name)
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
            _say(f"resumed run {self.run_id} with changed params (MLflow keeps the first value; the new one "
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
        ended = [rec.get("status"), rec.get("end_time")]
        if rec.get("status") and self.entry.get("ended") != ended:
            self.client.set_terminated(self.run_id, status=rec["status"], end_time=rec.get("end_time"))
            self.entry["ended"] = ended
            self._save()

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
        skip, metrics, damaged = self.entry.get("skip_upto", {}), [], []
        at = self.entry["offset"]  # byte offset of the current line in metrics.jsonl, to name it
        for line in data[:end].split(b"\n")[:-1]:
            try:
                row = json.loads(line)
                step, stamp = int(row["step"]), int(float(row["time"]) * 1000)
                metrics += [Metric(str(k), float(v), stamp, step) for k, v in row["metrics"].items()
                            if step > skip.get(k, -1)]
            except (ValueError, KeyError, TypeError, AttributeError) as e:  # a damaged line (a disk full, an edit)
                damaged.append(f"byte {at}: {type(e).__name__}: {line[:80]!r}")
            at += len(line) + 1
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics, synchronous=True)
        self.sent["metrics"] += len(metrics)
        if damaged:  # not sendable, now or later: say so, and keep the count where sync_mlflow.py reports it
            self.sent["skipped_lines"] += len(damaged)
            self.entry["skipped_lines"] = self.entry.get("skipped_lines", 0) + len(damaged)
            _say(f"{len(damaged)} line(s) of {self.run_dir / METRICS_FILE} are not metrics and were not sent "
                 f"({self.entry['skipped_lines']} in all for {self.uri}); first: {damaged[0]}", err=True)
        self.entry["offset"] += end
        self._save()


class Tracker:
    """The interface, and what non-main ranks get: every method does nothing, no file is written."""

    run_id: str | None = None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None: ...

    def set_tags(self, tags: dict[str, str]) -> None: ...

    def finish(self, status: str | None = "FINISHED") -> None: ...


class _MainTracker(Tracker):
    """Rank 0: metrics.jsonl + tracking.json always; MLflow through a background thread when enabled."""

    def __init__(self, cfg: Config, run_dir: Path, world_size: int, tags: dict[str, str]):
        self.cfg, self.tcfg, self.run_dir = cfg, cfg.tracking, run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self._lock, self._wake, self._first_try = threading.Lock(), threading.Event(), threading.Event()
        self._finished = self._stopping = self._connected = self._outage = False
        self._pid = os.getpid()  # a forked child (DataLoader worker) inherits the atexit hook: not its job
        self.uri = tracking_uri() if self.tcfg.enabled else None
        rec = _read_json(run_dir / RECORD_FILE)
        rec.update(version=1, uri=self.uri or rec.get("uri"), experiment=self.tcfg.experiment,
                   run_name=self.tcfg.run_name or run_dir.resolve().name, config=to_dict(cfg),
                   params={k: _param_value(v) for k, v in flatten(to_dict(cfg)).items()},
                   tags={**rec.get("tags", {}), **default_tags(cfg, run_dir, world_size),
                         **{k: str(v) for k, v in tags.items()}},
                   artifacts=rec.get("artifacts", []), status=None, end_time=None)
        rec.setdefault("start_time", int(time.time() * 1000))
        self._record = rec
        self._save_record()
        self._metrics_fh = open(run_dir / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115
        self._thread: threading.Thread | None = None
        if not self.tcfg.enabled:
            _say(f"MLflow off (tracking.enabled=false); metrics go to {run_dir / METRICS_FILE}; "
                 f"upload later with: {SYNC_COMMAND} {run_dir}")
            return
        import mlflow  # noqa: F401  here, not in the thread: a fork (DataLoader workers) during an import can hang
        # One HTTP call takes at most ~timeout_s and MLflow does not retry it (its defaults, 120 s and 7
        # retries, would hold the thread for minutes): this thread retries later. A user's value wins.
        # (MLflow reads these from the environment only; the URI itself is passed, never set there.)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, math.ceil(self.tcfg.timeout_s))))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        _say(f"MLflow experiment '{self.tcfg.experiment}', run '{rec['run_name']}' at {self.uri}; {ui_hint(self.uri)}")
        self._syncer = _Syncer(run_dir, self.uri, self._snapshot, live=True)
        self._monitor: Any = None
        self._next_try = 0.0
        self._thread = threading.Thread(target=self._sync_loop, name="mlflow-tracking", daemon=True)
        self._thread.start()
        if not self._first_try.wait(self.tcfg.timeout_s):
            _say(f"MLflow at {self.uri} did not answer within {self.tcfg.timeout_s:g}s; training starts anyway: "
                 f"metrics are in {run_dir / METRICS_FILE} and are sent as soon as it answers", err=True)
        atexit.register(self._at_exit)

    # -- the background thread: the training thread never waits on MLflow

    def _sync_loop(self) -> None:
        while True:
            stopping = self._stopping
            if not self._connected and (stopping or time.monotonic() >= self._next_try):
                self._attempt(self._connect)
                self._first_try.set()
            if self._connected:
                self._attempt(self._syncer.push)
            if stopping:
                with contextlib.suppress(Exception):
                    if self._monitor:
                        self._monitor.finish()
                return
            self._wake.wait(None if self._connected else max(0.1, self._next_try - time.monotonic()))
            self._wake.clear()

    def _attempt(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - anything the server or the network throws
            self._connected, self._next_try = False, time.monotonic() + self.tcfg.retry_s
            if not self._outage:
                self._outage = True
                _say(f"MLflow unreachable at {self.uri} ({type(e).__name__}: {' '.join(str(e).split())[:300]}); "
                     f"training goes on, metrics keep going to {self.run_dir / METRICS_FILE}; retrying every "
                     f"{self.tcfg.retry_s:g}s; replay later with: {SYNC_COMMAND} {self.run_dir}", err=True)

    def _connect(self) -> None:
        self._syncer.connect()
        if self.run_id is None:
            _say(f"MLflow run {self._syncer.run_id} {'resumed' if self._syncer.resumed else 'created'}; "
                 f"{ui_hint(self.uri, self._syncer.experiment_id)}")
        if self._outage:
            _say(f"MLflow reachable again at {self.uri}; catching up from {METRICS_FILE}")
        self.run_id, self._connected, self._outage = self._syncer.run_id, True, False
        if self.tcfg.system_metrics and self._monitor is None and not self._stopping:
            self._monitor = False  # tried once, not again
            try:  # MLflow's own CPU/memory/disk/network (GPU with nvidia-ml-py) sampler, into this run
                from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

                self._monitor = SystemMetricsMonitor(self.run_id, resume_logging=True, tracking_uri=self.uri,
                                                     sampling_interval=self.tcfg.system_metrics_interval_s)
                self._monitor.start()
            except Exception as e:  # noqa: BLE001 - optional (psutil missing, ...): never worth a failed run
                _say(f"system metrics not logged: {type(e).__name__}: {e}", err=True)

    # -- the interface, called by the training thread

    def _snapshot(self) -> dict[str, Any]:
        with self._lock:
            return json.loads(json.dumps(self._record))

    def _save_record(self) -> None:
        with self._lock:
            _write_json(self.run_dir / RECORD_FILE, self._record)
        self._wake.set()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        values = {str(k): float(v) for k, v in metrics.items()}
        if self._metrics_fh.closed:
            self._metrics_fh = open(self.run_dir / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115
        self._metrics_fh.write(json.dumps({"step": int(step), "time": round(time.time(), 3), "metrics": values}) + "\n")
        self._metrics_fh.flush()
        self._wake.set()

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        path = Path(path).resolve()
        if path.suffix == ".safetensors" and not self.tcfg.log_model:
            return self.set_tags({"model_path": str(path)})
        with self._lock:
            items = [a for a in self._record["artifacts"] if a["path"] != str(path)]
            self._record["artifacts"] = [*items, {"path": str(path), "artifact_path": artifact_path}]
        self._save_record()

    def set_tags(self, tags: dict[str, str]) -> None:
        with self._lock:
            self._record["tags"].update({str(k): str(v) for k, v in tags.items()})
        self._save_record()

    def finish(self, status: str | None = "FINISHED") -> None:
        """Flush (bounded wait) and end the run; status None leaves it RUNNING for the requeued job."""
        if self._finished:
            return
        self._finished = True
        atexit.unregister(self._at_exit)
        with self._lock:
            self._record.update(status=status, end_time=int(time.time() * 1000) if status else None)
        self._save_record()
        self._metrics_fh.close()
        if self._thread is None:
            return
        uploads = self._connected and any(a["path"].endswith(".safetensors") for a in self._record["artifacts"])
        # A new SQLite store still creating its tables (slow on a busy machine): a process that exits
        # mid-migration leaves a store that no later job can open, so that wait is bounded generously.
        creating = not self._connected and self.uri.startswith("sqlite:") and not self._first_try.is_set()
        self._stopping = True
        self._wake.set()
        self._thread.join(self.tcfg.timeout_s + (self.tcfg.upload_timeout_s if uploads or creating else 0.0))
        if self._thread.is_alive() or not self._connected:
            _say(f"not everything reached MLflow at {self.uri}; it is all in {self.run_dir}; "
                 f"send it with: {SYNC_COMMAND} {self.run_dir}", err=True)

    def _at_exit(self) -> None:
        """The process ends without finish(): an exception escaped the trainer."""
        if os.getpid() == self._pid:
            self.finish("FAILED")


def start_tracking(cfg: Config, run_dir: Path, is_main: bool, world_size: int,
                   tags: dict[str, str] | None = None) -> Tracker:
    """Rank 0 logs; the others get a `Tracker` that does nothing. Blocks at most cfg.tracking.timeout_s;
    ``tracker.run_id`` is None until the server has answered."""
    if not is_main:
        return Tracker()
    return _MainTracker(cfg, Path(run_dir), world_size, tags or {})


def sync_run_dir(run_dir: Path | str, uri: str | None = None) -> dict[str, Any]:
    """Send to `uri` (default: `tracking_uri()`) whatever of RUN_DIR it does not have yet; again: nothing.

    Returns {"run_id", "uri", "created", "metrics", "params", "artifacts", "skipped_lines"} (counts of
    this call; skipped_lines are lines of metrics.jsonl that are not metrics, named on stderr)."""
    run_dir = Path(run_dir)
    if not (run_dir / RECORD_FILE).is_file():
        raise FileNotFoundError(f"{run_dir} has no {RECORD_FILE}: not a run directory written by pipeline.tracking")
    record = _read_json(run_dir / RECORD_FILE)
    # MLflow reads its HTTP retry count from the environment only; setdefault keeps a user's value.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # a replay has time, but not minutes
    syncer = _Syncer(run_dir, uri := tracking_uri(uri), lambda: record, live=False)
    syncer.connect()
    syncer.push()
    return {"run_id": syncer.run_id, "uri": uri, "created": not syncer.resumed, **syncer.sent}
