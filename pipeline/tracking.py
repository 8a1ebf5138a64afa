"""MLflow tracking: one run per training job, resumed across requeues, never in training's way.

    tracker = start_tracking(cfg, run_dir, is_main=env.is_main, world_size=env.world_size)
    tracker.log_metrics({"train/loss": 2.3}, step=10)
    tracker.log_artifact(run_dir / "model.safetensors")
    tracker.finish()                # "FINISHED"; finish(None) leaves the run RUNNING for a requeue

Where: ``MLFLOW_TRACKING_URI`` when set (a team server), else where MLflow itself looks by default,
``./mlflow.db`` with artifacts in ``./mlruns``, so a plain ``mlflow ui`` in the same folder shows
every run. The experiment is tagged as a machine-learning (not GenAI) experiment.

The run directory is the record; MLflow is a copy of it. The training thread only appends to
``RUN_DIR/metrics.jsonl`` and keeps ``RUN_DIR/tracking.json`` (params, tags, artifacts, status),
whatever MLflow's state. A background thread copies both to MLflow (`_Syncer`), remembering per
tracking URI how far it got (``RUN_DIR/mlflow_sync.json``: a byte offset into metrics.jsonl). A
server that is down or slow costs training nothing: the thread says so once, retries every
``tracking.retry_s`` and catches up when the server is back; whatever is still unsent when the job
ends is sent by ``python launch/sync_mlflow.py RUN_DIR`` (the same `_Syncer`: nothing twice).

Resuming: ``RUN_DIR/mlflow_run_id`` names the run; a requeued job continues it. MLflow refuses to
change a logged param, so a value changed on resume becomes tag ``param_override.<key>``.
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from pipeline.config import Config, flatten, to_dict

METRICS_FILE = "metrics.jsonl"
RECORD_FILE = "tracking.json"
RUN_ID_FILE = "mlflow_run_id"
SYNC_FILE = "mlflow_sync.json"
LOCK_FILE = ".mlflow_sync.lock"
DEFAULT_DB = "mlflow.db"  # MLflow's own default store (mlflow.store.tracking.DEFAULT_TRACKING_URI)
UI_COMMAND = "mlflow ui"
UI_QUERY = "?workflowType=machine_learning"  # MLflow 3's switch from its GenAI pages to training runs
SYNC_COMMAND = "python launch/sync_mlflow.py"
# Tells MLflow 3's UI what the experiment holds (mlflow.experimentKind; "custom_model_development"
# is the UI's "Machine learning" kind, as opposed to GenAI apps and agents).
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
MAX_PARAM_VALUE = 6000  # mlflow.utils.validation: longer values are refused, not truncated
READ_CHUNK = 1 << 20  # bytes of metrics.jsonl sent per call, so a long outage is caught up gradually
_REJECTED = {"INVALID_PARAMETER_VALUE", "BAD_REQUEST"}  # retrying the same batch cannot help


def _say(msg: str, err: bool = False) -> None:
    print(f"[tracking] {msg}", file=sys.stderr if err else sys.stdout, flush=True)


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI, else MLflow's default store ./mlflow.db (made absolute: one spelling per store)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if not uri:
        return f"sqlite:///{Path.cwd() / DEFAULT_DB}"
    path = _sqlite_path(uri)
    return f"sqlite:///{path.resolve()}" if path is not None and not path.is_absolute() else uri


def _sqlite_path(uri: str) -> Path | None:
    raw = uri[len("sqlite:///"):].partition("?")[0] if uri.startswith("sqlite:///") else ""
    return Path(raw) if raw and raw != ":memory:" else None


def ui_hint(uri: str, experiment_id: str | None = None) -> str:
    """How to look at the runs: plain `mlflow ui` for the default store, the server's page otherwise."""
    page = f"/#/experiments/{experiment_id}/runs{UI_QUERY}" if experiment_id else f"/{UI_QUERY}"
    if uri.startswith("http"):
        return f"open {uri.rstrip('/')}{page}"
    db = _sqlite_path(uri)
    if db is not None and db.parent == Path.cwd():
        return f"browse with: {UI_COMMAND} (in {db.parent}), then open http://127.0.0.1:5000{page}"
    return f"browse with: {UI_COMMAND} --backend-store-uri {uri}"


def _bound_http_calls(timeout_s: float) -> None:
    """One HTTP call takes at most ~timeout_s and is not retried by MLflow (its defaults, 120 s and 7
    retries, would hold the worker for minutes); the worker retries later. A user's value wins."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, math.ceil(timeout_s))))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")


def _parent_tags(source: str) -> dict[str, str]:
    """A fine-tune's link to its pretraining run: the source path and the run id found beside it.

    A plain tag, not mlflow.parentRunId: that one nests the fine-tune under its parent in the runs
    table (hidden until expanded), while a tag keeps both as rows to compare side by side."""
    path = Path(source).expanduser().resolve()
    tags = {"source_path": str(path)}
    here = path if path.is_dir() else path.parent
    for folder in (here, *here.parents[:2]):  # run dir, or a file in it or in its checkpoints/<tag>/
        run_id = (folder / RUN_ID_FILE).read_text().strip() if (folder / RUN_ID_FILE).is_file() else ""
        if run_id:
            tags.update(parent_run_id=run_id, parent_run_dir=str(folder))
            name = _read_json(folder / RECORD_FILE).get("run_name")
            if name:
                tags["parent_run_name"] = str(name)
            break
    parent = tags.get("parent_run_id")
    tags["mlflow.note.content"] = f"Fine-tuned from `{path}`" + (f" (pretraining run `{parent}`)." if parent else ".")
    return tags


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


@contextlib.contextmanager
def _locked(run_dir: Path) -> Iterator[None]:
    """Serialise the live worker and sync_mlflow.py on one run directory (advisory; POSIX only)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(run_dir / LOCK_FILE, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _param_value(value: Any) -> str:
    return (json.dumps(value) if isinstance(value, (list, dict)) else str(value))[:MAX_PARAM_VALUE]


class _Syncer:
    """Brings one tracking URI up to date with one run directory (live worker and sync_mlflow.py).

    mlflow_sync.json: {uri: {"run_id", "offset", "artifacts", "ended"}}; "offset" is how many bytes
    of metrics.jsonl that URI has, so nothing is sent twice."""

    def __init__(self, run_dir: Path, uri: str, record: Callable[[], dict[str, Any]], live: bool):
        self.run_dir, self.uri, self.record, self.live = run_dir, uri, record, live
        self.client: Any = None
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.resumed = False
        self.sent = {"metrics": 0, "params": 0, "artifacts": 0}
        self._tags_sent: dict[str, str] = {}

    def _state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        state = _read_json(self.run_dir / SYNC_FILE)
        entry = state.setdefault(self.uri, {})
        entry.setdefault("offset", 0)
        entry.setdefault("artifacts", {})
        return state, entry

    def _save(self, state: dict[str, Any]) -> None:
        _write_json(self.run_dir / SYNC_FILE, state)

    def connect(self) -> None:
        """Find (or create) this run directory's run on this URI; log params, tags and the config."""
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        client, rec = MlflowClient(self.uri), self.record()
        id_file = self.run_dir / RUN_ID_FILE
        same_store = rec.get("uri") == self.uri
        with _locked(self.run_dir):
            state, entry = self._state()
            candidate = entry.get("run_id") or (id_file.read_text().strip() if same_store and id_file.is_file()
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
                state[self.uri] = entry = {"run_id": run.info.run_id, "offset": 0, "artifacts": {}}
            else:
                self.resumed = True
                if entry.get("run_id") != run.info.run_id:  # known run, sync state lost: skip what it has
                    skip = {k: max(m.step for m in client.get_metric_history(run.info.run_id, k))
                            for k in run.data.metrics}
                    entry.update(run_id=run.info.run_id, offset=0, artifacts={}, skip_upto=skip)
                if self.live and run.info.status != "RUNNING":
                    client.update_run(run.info.run_id, status="RUNNING")
                    entry.pop("ended", None)
            self._save(state)
            self.client, self.run_id, self.experiment_id = client, run.info.run_id, run.info.experiment_id
            if self.live or same_store or not id_file.exists():  # a replay elsewhere keeps the live store's id
                id_file.write_text(self.run_id + "\n")
            self._log_params(run.data.params, rec.get("params", {}))
            self._tags_sent = {}
            self._push_tags(rec)
            if rec.get("config") is not None:
                client.log_text(self.run_id, yaml.safe_dump(rec["config"], sort_keys=False), "config.yaml")

    def _create_run(self, client: Any, rec: dict[str, Any]) -> Any:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking.context.registry import resolve_tags

        name = rec.get("experiment") or "Default"
        exp = client.get_experiment_by_name(name)
        if exp is None:
            try:
                client.create_experiment(name, tags=EXPERIMENT_TAGS)
            except MlflowException as e:
                if e.error_code != "RESOURCE_ALREADY_EXISTS":  # another job just made it
                    raise
            exp = client.get_experiment_by_name(name)
        if exp.lifecycle_stage == "deleted":
            raise RuntimeError(f"experiment '{name}' is deleted at {self.uri}: restore it (mlflow experiments "
                               f"restore --experiment-id {exp.experiment_id}) or set tracking.experiment")
        for key, value in EXPERIMENT_TAGS.items():
            if key not in exp.tags:  # an experiment made before (or by someone else)
                client.set_experiment_tag(exp.experiment_id, key, value)
        # MLflow's context providers: user, source name/type, git commit (the fluent API adds these itself).
        tags = {**resolve_tags(), **rec.get("tags", {})}
        return client.create_run(exp.experiment_id, start_time=rec.get("start_time"), tags=tags,
                                 run_name=rec.get("run_name"))

    def _log_params(self, existing: dict[str, str], params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        new = [Param(k, _param_value(v)) for k, v in params.items() if k not in existing]
        overrides = {f"param_override.{k}": _param_value(v) for k, v in params.items()
                     if k in existing and existing[k] != _param_value(v)}
        if new:
            self.client.log_batch(self.run_id, params=new, synchronous=True)  # MLflow chunks the batch itself
        self.sent["params"] += len(new)
        if overrides:
            _say(f"resumed run {self.run_id} with changed params (MLflow keeps the first value; the new one "
                 f"is tag param_override.<key>): {', '.join(k[15:] for k in overrides)}")
            self._log_tags(overrides)

    def _log_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()], synchronous=True)

    def _push_tags(self, rec: dict[str, Any]) -> None:
        todo = {k: v for k, v in rec.get("tags", {}).items() if self._tags_sent.get(k) != v}
        if todo:
            self._log_tags(todo)
            self._tags_sent.update(todo)

    def push(self) -> None:
        """Send new tags, metric lines, artifacts and the final status."""
        rec = self.record()
        self._push_tags(rec)
        while self._push_metrics():
            pass
        with _locked(self.run_dir):
            state, entry = self._state()
            for item in rec.get("artifacts", []):
                self._push_artifact(state, entry, item)
            ended = [rec.get("status"), rec.get("end_time")]
            if rec.get("status") and entry.get("ended") != ended:
                self.client.set_terminated(self.run_id, status=rec["status"], end_time=rec.get("end_time"))
                entry["ended"] = ended
                self._save(state)

    def _push_artifact(self, state: dict[str, Any], entry: dict[str, Any], item: dict[str, Any]) -> None:
        try:
            st = Path(item["path"]).stat()
        except OSError:
            return  # gone (a cleaned-up checkpoint): nothing to send
        signature = f"{st.st_size}:{st.st_mtime_ns}"
        if entry["artifacts"].get(item["path"]) != signature:
            self.client.log_artifact(self.run_id, item["path"], item.get("artifact_path"))
            entry["artifacts"][item["path"]] = signature
            self.sent["artifacts"] += 1
            self._save(state)

    def _push_metrics(self) -> bool:
        """Send the next chunk of metrics.jsonl past this URI's offset; True if there may be more."""
        from mlflow.entities import Metric
        from mlflow.exceptions import MlflowException

        with _locked(self.run_dir):
            state, entry = self._state()
            try:
                with open(self.run_dir / METRICS_FILE, "rb") as fh:
                    fh.seek(entry["offset"])
                    data = fh.read(READ_CHUNK)
            except FileNotFoundError:
                return False
            end = data.rfind(b"\n") + 1  # a line being written right now waits for the next round
            if end == 0 and len(data) == READ_CHUNK:
                end = len(data)  # one absurd line longer than a chunk: skip it
            skip, metrics = entry.get("skip_upto", {}), []
            for line in data[:end].splitlines():
                try:
                    row = json.loads(line)
                    step, stamp = int(row["step"]), int(float(row["time"]) * 1000)
                    metrics += [Metric(k, float(v), stamp, step) for k, v in row["metrics"].items()
                                if step > skip.get(k, -1)]
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue  # a damaged line (disk full, killed mid-write) is not worth a stall
            if metrics:
                try:
                    self.client.log_batch(self.run_id, metrics=metrics, synchronous=True)
                except MlflowException as e:
                    if e.error_code not in _REJECTED:
                        raise
                    _say(f"MLflow rejected {len(metrics)} metric points ({e.message[:200]}); they stay in "
                         f"{self.run_dir / METRICS_FILE}", err=True)
            self.sent["metrics"] += len(metrics)
            entry["offset"] += end
            self._save(state)
            return end > 0 and len(data) == READ_CHUNK


class Tracker:
    """The interface, and what non-main ranks get: every method does nothing, no file is written."""

    run_id: str | None = None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        pass

    def set_tags(self, tags: dict[str, str]) -> None:
        pass

    def finish(self, status: str | None = "FINISHED") -> None:
        pass


class _Worker(threading.Thread):
    """Copies the run directory to MLflow in the background; the training thread never waits on it."""

    def __init__(self, tracker: _MainTracker, syncer: _Syncer):
        super().__init__(name="mlflow-tracking", daemon=True)
        self.tracker, self.syncer, self.tcfg = tracker, syncer, tracker.cfg.tracking
        self.wake, self.first_try = threading.Event(), threading.Event()
        self.connected = self.stopping = self.outage = False
        self.next_try = 0.0
        self.monitor: Any = None

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()

    def run(self) -> None:
        while True:
            stopping = self.stopping
            if not self.connected and (stopping or time.monotonic() >= self.next_try):
                self._attempt(self._connect)
                self.first_try.set()
            if self.connected:
                self._attempt(self.syncer.push)
            if stopping:
                if self.monitor is not None:
                    with contextlib.suppress(Exception):
                        self.monitor.finish()
                return
            self.wake.wait(None if self.connected else max(0.1, self.next_try - time.monotonic()))
            self.wake.clear()

    def _attempt(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - anything the server or the network throws
            self.connected, self.next_try = False, time.monotonic() + self.tcfg.retry_s
            if not self.outage:
                self.outage = True
                _say(f"MLflow unreachable at {self.syncer.uri} ({type(e).__name__}: {' '.join(str(e).split())[:300]}"
                     f"); training goes on, metrics keep going to {self.tracker.run_dir / METRICS_FILE}; retrying "
                     f"every {self.tcfg.retry_s:g}s; replay later with: {SYNC_COMMAND} {self.tracker.run_dir}",
                     err=True)

    def _connect(self) -> None:
        self.syncer.connect()
        self.tracker.on_connected(self.syncer)
        if self.outage:
            _say(f"MLflow reachable again at {self.syncer.uri}; catching up from {METRICS_FILE}")
        self.connected, self.outage = True, False
        if self.tcfg.system_metrics and self.monitor is None and not self.stopping:
            self._start_system_metrics()

    def _start_system_metrics(self) -> None:
        """MLflow's own CPU/memory/disk/network (and GPU, with nvidia-ml-py) sampler, into the same run."""
        try:
            import psutil  # noqa: F401  (MLflow's CPU monitor needs it)
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self.monitor = SystemMetricsMonitor(self.syncer.run_id, resume_logging=True, tracking_uri=self.syncer.uri,
                                                sampling_interval=self.tcfg.system_metrics_interval_s)
            self.monitor.start()
        except Exception as e:  # noqa: BLE001 - optional: never worth a failed run
            _say(f"system metrics not logged: {type(e).__name__}: {e}", err=True)
            self.monitor = False  # tried once; not again


class _MainTracker(Tracker):
    """Rank 0: metrics.jsonl + tracking.json always, MLflow through `_Worker` when enabled."""

    def __init__(self, cfg: Config, run_dir: Path, world_size: int, tags: dict[str, str]):
        self.cfg, self.run_dir = cfg, run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._finished = False
        self._pid = os.getpid()  # a forked child (DataLoader worker) inherits the atexit hook: not its job
        tcfg = cfg.tracking
        self.uri = tracking_uri() if tcfg.enabled else None
        rec = _read_json(run_dir / RECORD_FILE)
        rec.update(version=1, uri=self.uri or rec.get("uri"), experiment=tcfg.experiment,
                   run_name=tcfg.run_name or run_dir.resolve().name, config=to_dict(cfg),
                   params={k: _param_value(v) for k, v in flatten(to_dict(cfg)).items()},
                   tags={**rec.get("tags", {}), **default_tags(cfg, run_dir, world_size),
                         **{k: str(v) for k, v in tags.items()}},
                   artifacts=rec.get("artifacts", []), status=None, end_time=None)
        rec.setdefault("start_time", int(time.time() * 1000))
        self._record = rec
        self._save_record()
        self._metrics_fh = open(run_dir / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115
        self._worker: _Worker | None = None
        if not tcfg.enabled:
            _say(f"MLflow off (tracking.enabled=false); metrics go to {run_dir / METRICS_FILE}; "
                 f"upload later with: {SYNC_COMMAND} {run_dir}")
            return
        try:  # imported here, not in the worker: a fork (DataLoader workers) while a thread imports can hang
            import mlflow  # noqa: F401
        except ImportError:
            _say(f"mlflow is not installed: metrics go to {run_dir / METRICS_FILE} only "
                 f"(pip install mlflow, then: {SYNC_COMMAND} {run_dir})", err=True)
            return
        _bound_http_calls(tcfg.timeout_s)
        _say(f"MLflow experiment '{tcfg.experiment}', run '{rec['run_name']}' at {self.uri}; {ui_hint(self.uri)}")
        self._worker = _Worker(self, _Syncer(run_dir, self.uri, self._snapshot, live=True))
        self._worker.start()
        if not self._worker.first_try.wait(tcfg.timeout_s):
            _say(f"MLflow at {self.uri} did not answer within {tcfg.timeout_s:g}s; training starts anyway: "
                 f"metrics are in {run_dir / METRICS_FILE} and are sent as soon as it answers", err=True)
        atexit.register(self._at_exit)

    def on_connected(self, syncer: _Syncer) -> None:
        if self.run_id is None:
            _say(f"MLflow run {syncer.run_id} {'resumed' if syncer.resumed else 'created'}; "
                 f"{ui_hint(self.uri, syncer.experiment_id)}")
        self.run_id = syncer.run_id

    def _snapshot(self) -> dict[str, Any]:
        with self._lock:
            return json.loads(json.dumps(self._record))

    def _save_record(self) -> None:
        with self._lock:
            _write_json(self.run_dir / RECORD_FILE, self._record)

    def _changed(self) -> None:
        self._save_record()
        if self._worker is not None:
            self._worker.wake.set()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        values = {}
        for key, value in metrics.items():
            try:
                values[str(key)] = float(value)
            except (TypeError, ValueError):
                pass  # not a number: nothing MLflow could plot
        if self._metrics_fh.closed:
            self._metrics_fh = open(self.run_dir / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115
        self._metrics_fh.write(json.dumps({"step": int(step), "time": round(time.time(), 3), "metrics": values}) + "\n")
        self._metrics_fh.flush()
        if self._worker is not None:
            self._worker.wake.set()

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        path = Path(path).resolve()
        if path.suffix == ".safetensors" and not self.cfg.tracking.log_model:
            self.set_tags({"model_path": str(path)})
            return
        with self._lock:
            items = [a for a in self._record["artifacts"] if a["path"] != str(path)]
            self._record["artifacts"] = [*items, {"path": str(path), "artifact_path": artifact_path}]
        self._changed()

    def set_tags(self, tags: dict[str, str]) -> None:
        with self._lock:
            self._record["tags"].update({str(k): str(v) for k, v in tags.items()})
        self._changed()

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
        if self._worker is None:
            return
        tcfg = self.cfg.tracking
        uploads = self._worker.connected and any(a["path"].endswith(".safetensors") for a in self._record["artifacts"])
        self._worker.stop()
        self._worker.join(tcfg.timeout_s + (tcfg.upload_timeout_s if uploads else 0.0))
        if self._worker.is_alive() or not self._worker.connected:
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

    Returns {"run_id", "uri", "created", "metrics", "params", "artifacts"} (counts sent now)."""
    run_dir = Path(run_dir)
    if not (run_dir / RECORD_FILE).is_file():
        raise FileNotFoundError(f"{run_dir} has no {RECORD_FILE}: not a run directory written by pipeline.tracking")
    record = _read_json(run_dir / RECORD_FILE)
    if uri:
        os.environ["MLFLOW_TRACKING_URI"] = uri
    uri = tracking_uri()
    # A replay has time (no training waits on it) but should not spend minutes on a server that is down.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    syncer = _Syncer(run_dir, uri, lambda: record, live=False)
    syncer.connect()
    syncer.push()
    return {"run_id": syncer.run_id, "uri": uri, "created": not syncer.resumed, **syncer.sent}
