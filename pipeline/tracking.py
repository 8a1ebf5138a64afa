"""MLflow tracking: one run per training job, resumed across requeues, never in training's way.

    tracker = start_tracking(cfg, run_dir, is_main=env.is_main, world_size=env.world_size)
    tracker.log_metrics({"loss": 2.3, "lr": 1e-3}, step=10)
    tracker.log_artifact(run_dir / "model.safetensors")
    tracker.finish()                # "FINISHED"; finish(None) leaves the run RUNNING for a requeue

Where: ``MLFLOW_TRACKING_URI`` when set (a team server), else an embedded SQLite store in the
working directory, ``./mlruns/mlflow.db``, with artifacts in ``./mlruns/artifacts`` (`UI_COMMAND`
opens it).

The run directory is the record; MLflow is a copy of it. The training thread only appends to
``RUN_DIR/metrics.jsonl`` (one JSON line per `log_metrics` call) and keeps ``RUN_DIR/tracking.json``
(params, tags, artifacts, final status); both are written whatever MLflow's state. A background
thread (`_Worker`) copies them to MLflow with a `_Syncer`, remembering how far it got per tracking
URI in ``RUN_DIR/mlflow_sync.json`` (a byte offset into metrics.jsonl). A server that is down or
slow therefore costs training nothing: the worker says so once, retries every
``tracking.retry_s``, and catches up from the file when the server is back. Whatever was still
unsent when the job ended is sent by ``python launch/sync_mlflow.py RUN_DIR`` (the same `_Syncer`,
so replaying twice sends nothing twice).

Resuming: ``RUN_DIR/mlflow_run_id`` names the run; a requeued job continues it (status back to
RUNNING, params that did not change are left alone, a changed value is recorded as tag
``param_override.<key>`` because MLflow refuses to change a logged param).
"""

from __future__ import annotations

import atexit
import contextlib
import getpass
import json
import math
import os
import re
import socket
import subprocess
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
DEFAULT_DB = Path("mlruns") / "mlflow.db"
ARTIFACTS_DIR = "artifacts"
UI_COMMAND = "mlflow ui --backend-store-uri sqlite:///mlruns/mlflow.db --default-artifact-root ./mlruns/artifacts"
SYNC_COMMAND = "python launch/sync_mlflow.py"

# MLflow's limits (mlflow.utils.validation): per log_batch call, and per param value.
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000
MAX_KEY = 250
READ_CHUNK = 1 << 20  # bytes of metrics.jsonl sent per step, so a long outage is caught up gradually
_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")
# Errors where retrying the same request cannot help: drop that batch (it stays in metrics.jsonl).
_REJECTED = {"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "INVALID_STATE"}


def _say(msg: str, err: bool = False) -> None:
    print(f"[tracking] {msg}", file=sys.stderr if err else sys.stdout, flush=True)


# ----------------------------------------------------------------------------- where to log


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI, else the embedded store ./mlruns/mlflow.db (absolute, so chdir is harmless)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if uri:
        return normalize_uri(uri)
    db = Path.cwd() / DEFAULT_DB
    return f"sqlite:///{db}"


def normalize_uri(uri: str) -> str:
    """sqlite:///relative.db -> sqlite:////abs/relative.db: one spelling per store (the sync state is keyed by it)."""
    path = _sqlite_path(uri)
    if path is not None and not path.is_absolute():
        query = uri.partition("?")[2]
        return f"sqlite:///{path.resolve()}" + (f"?{query}" if query else "")
    return uri


def _sqlite_path(uri: str) -> Path | None:
    if not uri.startswith("sqlite:///"):
        return None
    raw = uri[len("sqlite:///"):].partition("?")[0]
    return Path(raw) if raw and raw != ":memory:" else None


def ui_hint(uri: str) -> str:
    """How to look at the runs: the `mlflow ui` command for the embedded store, the server's address otherwise."""
    db = _sqlite_path(uri)
    if db is None:
        return f"open {uri} in a browser" if uri.startswith("http") else f"tracking URI {uri}"
    if db == Path.cwd() / DEFAULT_DB:
        return f"browse with: {UI_COMMAND}   (from {Path.cwd()})"
    return (f"browse with: mlflow ui --backend-store-uri sqlite:///{db} "
            f"--default-artifact-root {db.parent / ARTIFACTS_DIR}")


def _artifact_root(uri: str, experiment: str) -> str | None:
    """Artifacts beside a SQLite store (mlruns/artifacts/<experiment>); a server decides for itself."""
    db = _sqlite_path(uri)
    if db is None:
        return None
    slug = re.sub(r"[^\w.-]+", "_", experiment).strip("_") or "default"
    return str(db.parent / ARTIFACTS_DIR / slug)


def _bound_http_calls(timeout_s: float) -> None:
    """One HTTP call to the server takes at most ~timeout_s, and MLflow does not retry on its own
    (its defaults, 120 s and 7 retries with backoff, would hold the worker for minutes); the
    worker retries later instead. A value the user exported wins."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, math.ceil(timeout_s))))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")


# ----------------------------------------------------------------------------- tags


def _git_tags() -> dict[str, str]:
    """Commit of the code that runs (this package's checkout); nothing when it is not a git checkout."""
    repo = Path(__file__).resolve().parent.parent

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=5)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {}
        commit = head.stdout.strip()
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip() != ""
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"git_commit": commit, "mlflow.source.git.commit": commit, "git_dirty": str(dirty).lower()}


def _parent_tags(source: str) -> dict[str, str]:
    """A fine-tune's link to its pretraining run: the source path, and the run id found beside it.

    A custom tag rather than mlflow.parentRunId: that one nests the fine-tune under the pretraining
    run in the UI's table (hidden until expanded, and only within one experiment), while a plain tag
    keeps both as rows to select and compare side by side, and can be filtered on
    (``tags.parent_run_id = '...'``).
    """
    path = Path(source).expanduser().resolve()
    tags = {"source_path": str(path)}
    here = path if path.is_dir() else path.parent
    for folder in (here, *here.parents[:2]):  # run dir, or a file in it or in its checkpoints/<tag>/
        id_file = folder / RUN_ID_FILE
        if id_file.is_file() and id_file.read_text().strip():
            tags["parent_run_id"] = id_file.read_text().strip()
            tags["parent_run_dir"] = str(folder)
            with contextlib.suppress(OSError, ValueError):
                name = json.loads((folder / RECORD_FILE).read_text()).get("run_name")
                if name:
                    tags["parent_run_name"] = str(name)
            break
    return tags


def default_tags(cfg: Config, run_dir: Path, world_size: int) -> dict[str, str]:
    """What to filter and group runs by: kind, variant, scale, code version, where it ran."""
    tags = {
        "kind": cfg.run.kind,
        "model_variant": cfg.model.variant,
        "world_size": str(world_size),
        "zero_stage": str(cfg.deepspeed.zero_stage),
        "run_dir": str(run_dir.resolve()),
        "host": socket.gethostname(),
        "mlflow.source.name": sys.argv[0] if sys.argv and sys.argv[0] else "python",
        "mlflow.source.type": "JOB",
    }
    with contextlib.suppress(Exception):
        tags["mlflow.user"] = getpass.getuser()
    tags.update(_git_tags())
    slurm = {"slurm_job_id": "SLURM_JOB_ID", "slurm_nodelist": "SLURM_JOB_NODELIST",
             "slurm_restart_count": "SLURM_RESTART_COUNT"}
    for tag, var in slurm.items():
        value = os.environ.get(var) or (os.environ.get("SLURM_NODELIST") if tag == "slurm_nodelist" else None)
        if value and os.environ.get("SLURM_JOB_ID"):
            tags[tag] = value
    if cfg.run.kind == "finetune" and cfg.finetune.source:
        tags.update(_parent_tags(cfg.finetune.source))
        parent = tags.get("parent_run_id")
        tags["mlflow.note.content"] = (
            f"Fine-tuned from `{tags['source_path']}`" + (f" (pretraining run `{parent}`)." if parent else "."))
    return tags


# ----------------------------------------------------------------------------- run-dir files


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        _say(f"{path} is unreadable; starting it afresh", err=True)
        return {}
    return data if isinstance(data, dict) else {}


@contextlib.contextmanager
def _locked(run_dir: Path) -> Iterator[None]:
    """Serialise the live worker and sync_mlflow.py on one run directory (advisory; POSIX only)."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock, replay while the job runs is then the user's risk
        yield
        return
    with open(run_dir / LOCK_FILE, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _param_value(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return text[:MAX_PARAM_VALUE]


def _metric_key(key: str) -> str:
    """MLflow refuses names outside [/\\w.- :]; replace such characters rather than lose the batch."""
    key = _BAD_KEY_CHARS.sub("_", key).strip("/")[:MAX_KEY]
    return key or "_"


# ----------------------------------------------------------------------------- syncing


class _Syncer:
    """Brings one tracking URI up to date with one run directory.

    Used by the live worker (record from memory) and by sync_mlflow.py (record from tracking.json).
    Progress per URI lives in mlflow_sync.json: {uri: {"run_id", "offset", "artifacts", "ended"}};
    "offset" is how many bytes of metrics.jsonl that URI has, so nothing is sent twice.
    """

    def __init__(self, run_dir: Path, uri: str, record: Callable[[], dict[str, Any]], live: bool):
        self.run_dir, self.uri, self.record, self.live = run_dir, uri, record, live
        self.client: Any = None
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.resumed = False
        self.sent = {"metrics": 0, "params": 0, "artifacts": 0}
        self._tags_sent: dict[str, str] = {}

    # -- state file

    def _entry(self, state: dict[str, Any]) -> dict[str, Any]:
        entry = state.setdefault(self.uri, {})
        entry.setdefault("offset", 0)
        entry.setdefault("artifacts", {})
        return entry

    def _load(self) -> dict[str, Any]:
        return _read_json(self.run_dir / SYNC_FILE)

    def _save(self, state: dict[str, Any]) -> None:
        _write_json(self.run_dir / SYNC_FILE, state)

    # -- connecting

    def connect(self) -> None:
        """Find (or create) the run for this run directory on this URI; log params, tags, config."""
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        client = MlflowClient(self.uri)
        rec = self.record()
        with _locked(self.run_dir):
            state = self._load()
            entry = self._entry(state)
            candidate = entry.get("run_id")
            if not candidate and normalize_uri(rec.get("uri") or "") == self.uri:
                id_file = self.run_dir / RUN_ID_FILE
                candidate = id_file.read_text().strip() if id_file.is_file() else None
            run = None
            if candidate:
                try:
                    run = client.get_run(candidate)
                except MlflowException as e:
                    if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                        raise
                    _say(f"run {candidate} does not exist at {self.uri}; creating a new one", err=True)
            if run is not None and run.info.lifecycle_stage == "deleted":
                _say(f"run {candidate} was deleted at {self.uri}; creating a new one", err=True)
                run = None
            if run is None:
                run = self._create_run(client, rec)
                state[self.uri] = entry = {"run_id": run.info.run_id, "offset": 0, "artifacts": {}}
            else:
                self.resumed = True
                if entry.get("run_id") != run.info.run_id:
                    # Known run, unknown progress (sync state lost): skip the steps it already has.
                    entry.update(run_id=run.info.run_id, offset=0, artifacts={},
                                 skip_upto={m.key: m.step for m in run.data._metric_objs})
                if self.live and run.info.status != "RUNNING":
                    client.update_run(run.info.run_id, status="RUNNING")
                    entry.pop("ended", None)
            self._save(state)
            self.client, self.run_id, self.experiment_id = client, run.info.run_id, run.info.experiment_id
            id_file = self.run_dir / RUN_ID_FILE
            if self.live or normalize_uri(rec.get("uri") or "") == self.uri or not id_file.exists():
                id_file.write_text(self.run_id + "\n")  # a replay elsewhere keeps the live store's id
            self._log_params(run.data.params, rec.get("params", {}))
            self._tags_sent = {}
            self._push_tags(rec)
            if rec.get("config") is not None:
                client.log_text(self.run_id, yaml.safe_dump(rec["config"], sort_keys=False), "config.yaml")

    def _create_run(self, client: Any, rec: dict[str, Any]) -> Any:
        from mlflow.exceptions import MlflowException

        name = rec.get("experiment") or "Default"
        exp = client.get_experiment_by_name(name)
        if exp is None:
            try:
                client.create_experiment(name, artifact_location=_artifact_root(self.uri, name))
            except MlflowException as e:
                if e.error_code != "RESOURCE_ALREADY_EXISTS":  # another job just made it
                    raise
            exp = client.get_experiment_by_name(name)
        if exp.lifecycle_stage == "deleted":
            raise RuntimeError(f"experiment '{name}' is deleted at {self.uri}: restore it "
                               f"(mlflow experiments restore --experiment-id {exp.experiment_id}) "
                               "or set tracking.experiment to another name")
        tags = {k: str(v)[:MAX_TAG_VALUE] for k, v in rec.get("tags", {}).items()}  # mlflow.user -> owner
        return client.create_run(exp.experiment_id, start_time=rec.get("start_time"), tags=tags,
                                 run_name=rec.get("run_name"))

    def _log_params(self, existing: dict[str, str], params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        new, overrides = [], {}
        for key, value in params.items():
            text = _param_value(value)
            if key not in existing:
                new.append(Param(key[:MAX_KEY], text))
            elif existing[key] != text:
                overrides[f"param_override.{key}"[:MAX_KEY]] = text[:MAX_TAG_VALUE]
        for i in range(0, len(new), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=new[i:i + MAX_PARAMS_PER_BATCH], synchronous=True)
        self.sent["params"] += len(new)
        if overrides:
            _say(f"resumed run {self.run_id} with changed params (MLflow keeps the first value; "
                 f"the new one is tag param_override.<key>): {', '.join(k[15:] for k in overrides)}")
            self._log_tags(overrides)

    def _log_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k[:MAX_KEY], str(v)[:MAX_TAG_VALUE]) for k, v in tags.items()]
        for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, tags=items[i:i + MAX_PARAMS_PER_BATCH], synchronous=True)

    def _push_tags(self, rec: dict[str, Any]) -> None:
        todo = {k: v for k, v in rec.get("tags", {}).items() if self._tags_sent.get(k) != v}
        if todo:
            self._log_tags(todo)
            self._tags_sent.update(todo)

    # -- pushing what is new

    def push(self) -> bool:
        """Send new tags, metric lines, artifacts and the final status. True when nothing is left."""
        rec = self.record()
        self._push_tags(rec)
        while self._push_metrics():
            pass
        with _locked(self.run_dir):
            state = self._load()
            entry = self._entry(state)
            for item in rec.get("artifacts", []):
                self._push_artifact(state, entry, item)
            ended = [rec.get("status"), rec.get("end_time")]
            if rec.get("status") and entry.get("ended") != ended:
                self.client.set_terminated(self.run_id, status=rec["status"], end_time=rec.get("end_time"))
                entry["ended"] = ended
                self._save(state)
        return True

    def _push_artifact(self, state: dict[str, Any], entry: dict[str, Any], item: dict[str, Any]) -> None:
        path = Path(item["path"])
        try:
            st = path.stat()
        except OSError:
            return  # gone (a cleaned-up checkpoint); nothing to send
        signature = f"{st.st_size}:{st.st_mtime_ns}"
        if entry["artifacts"].get(str(path)) == signature:
            return
        self.client.log_artifact(self.run_id, str(path), item.get("artifact_path"))
        entry["artifacts"][str(path)] = signature
        self.sent["artifacts"] += 1
        self._save(state)

    def _push_metrics(self) -> bool:
        """Send the next chunk of metrics.jsonl past this URI's offset; True if there may be more."""
        from mlflow.entities import Metric
        from mlflow.exceptions import MlflowException

        path = self.run_dir / METRICS_FILE
        with _locked(self.run_dir):
            state = self._load()
            entry = self._entry(state)
            offset = entry["offset"]
            try:
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    data = fh.read(READ_CHUNK)
            except FileNotFoundError:
                return False
            end = data.rfind(b"\n") + 1  # a line being written right now waits for the next round
            if end == 0:
                if len(data) == READ_CHUNK:  # one absurd line longer than a chunk: skip it
                    entry["offset"] = offset + len(data)
                    self._save(state)
                    return True
                return False
            skip = entry.get("skip_upto", {})
            metrics = []
            for line in data[:end].splitlines():
                try:
                    row = json.loads(line)
                    step, stamp = int(row["step"]), int(float(row["time"]) * 1000)
                    for key, value in row["metrics"].items():
                        key = _metric_key(key)
                        if key in skip and step <= skip[key]:
                            continue
                        metrics.append(Metric(key, float(value), stamp, step))
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue  # a damaged line (disk full, killed mid-write) is not worth a stall
            for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
                try:
                    self.client.log_batch(self.run_id, metrics=metrics[i:i + MAX_METRICS_PER_BATCH],
                                          synchronous=True)
                except MlflowException as e:
                    if e.error_code not in _REJECTED:
                        raise
                    _say(f"MLflow rejected {len(metrics[i:i + MAX_METRICS_PER_BATCH])} metric points "
                         f"({e.message[:200]}); they stay in {path}", err=True)
            self.sent["metrics"] += len(metrics)
            entry["offset"] = offset + end
            self._save(state)
            return len(data) == READ_CHUNK


# ----------------------------------------------------------------------------- trackers


class Tracker:
    """The interface, and what non-main ranks get: every method does nothing, no file is written."""

    @property
    def run_id(self) -> str | None:
        return None

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
        self.tracker, self.syncer = tracker, syncer
        self.wake = threading.Event()
        self.first_try = threading.Event()  # start_tracking waits on this, bounded
        self.connected = False
        self._stopping = False
        self._next_try = 0.0
        self._outage = False
        self._monitor: Any = None

    def stop(self) -> None:
        self._stopping = True
        self.wake.set()

    def run(self) -> None:
        while True:
            stopping = self._stopping
            if not self.connected and (stopping or time.monotonic() >= self._next_try):
                self._attempt(self._connect)
                self.first_try.set()
            if self.connected:
                if stopping:
                    self._stop_system_metrics()
                self._attempt(self.syncer.push)
            if stopping:
                self._stop_system_metrics()
                return
            wait = None if self.connected else max(0.1, self._next_try - time.monotonic())
            self.wake.wait(wait)
            self.wake.clear()

    def _attempt(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - anything the server or the network throws
            self.connected = False
            self._next_try = time.monotonic() + self.tracker.cfg.tracking.retry_s
            if not self._outage:
                self._outage = True
                detail = " ".join(str(e).split())[:300]
                _say(f"MLflow unreachable at {self.syncer.uri} ({type(e).__name__}: {detail}); training "
                     f"goes on, metrics keep going to {self.tracker.run_dir / METRICS_FILE}; retrying every "
                     f"{self.tracker.cfg.tracking.retry_s:g}s; replay later with: "
                     f"{SYNC_COMMAND} {self.tracker.run_dir}", err=True)

    def _connect(self) -> None:
        was_out = self._outage
        self.syncer.connect()
        self.connected, self._outage = True, False
        self.tracker._connected(self.syncer)
        if was_out:
            _say(f"MLflow reachable again at {self.syncer.uri}; catching up from {METRICS_FILE}")
        self._start_system_metrics()

    # -- MLflow's own system metrics (CPU, memory, disk, network; GPU with nvidia-ml-py)

    def _start_system_metrics(self) -> None:
        tcfg = self.tracker.cfg.tracking
        if not tcfg.system_metrics or self._stopping:
            return
        if self._monitor is not None and self._monitor._process is not None and self._monitor._process.is_alive():
            return
        try:
            import psutil  # noqa: F401  (MLflow's CPU monitor needs it)
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
        except ImportError:
            self.tracker._warn_once("psutil", "psutil is not installed: no system metrics (pip install psutil)")
            return
        try:
            self._monitor = SystemMetricsMonitor(
                self.syncer.run_id, sampling_interval=tcfg.system_metrics_interval_s,
                resume_logging=True, tracking_uri=self.syncer.uri)
            self._monitor.start()
        except Exception as e:  # noqa: BLE001
            self.tracker._warn_once("sysmetrics", f"system metrics not logged: {e}")
            self._monitor = None

    def _stop_system_metrics(self) -> None:
        if self._monitor is not None:
            with contextlib.suppress(Exception):
                self._monitor.finish()
            self._monitor = None


class _MainTracker(Tracker):
    """Rank 0: metrics.jsonl + tracking.json always, MLflow through `_Worker` when enabled."""

    def __init__(self, cfg: Config, run_dir: Path, world_size: int, tags: dict[str, str]):
        self.cfg, self.run_dir = cfg, run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._run_id: str | None = None
        self._finished = False
        self._pid = os.getpid()  # a forked child (DataLoader worker) inherits the atexit hook: not its job
        tcfg = cfg.tracking
        self.uri = tracking_uri() if tcfg.enabled else None

        rec = _read_json(run_dir / RECORD_FILE)
        rec.update(
            version=1,
            uri=self.uri if self.uri is not None else rec.get("uri"),
            experiment=tcfg.experiment,
            run_name=tcfg.run_name or run_dir.resolve().name,
            config=to_dict(cfg),
            params={k: _param_value(v) for k, v in flatten(to_dict(cfg)).items()},
            tags={**rec.get("tags", {}), **default_tags(cfg, run_dir, world_size),
                  **{k: str(v) for k, v in (tags or {}).items()}},
            artifacts=rec.get("artifacts", []),
            status=None,
            end_time=None,
        )
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
        if _sqlite_path(self.uri) is not None:
            with contextlib.suppress(OSError):  # if it cannot be made, the worker reports it (once)
                _sqlite_path(self.uri).parent.mkdir(parents=True, exist_ok=True)
        _say(f"MLflow experiment '{tcfg.experiment}', run '{rec['run_name']}' at {self.uri}; {ui_hint(self.uri)}")
        syncer = _Syncer(run_dir, self.uri, self._snapshot, live=True)
        self._worker = _Worker(self, syncer)
        self._worker.start()
        if not self._worker.first_try.wait(tcfg.timeout_s):
            why = ("is still opening (a new SQLite store creates its tables on first use)"
                   if _sqlite_path(self.uri) else f"did not answer within {tcfg.timeout_s:g}s")
            _say(f"MLflow at {self.uri} {why}; training starts anyway: metrics are in "
                 f"{run_dir / METRICS_FILE} and are sent as soon as it answers", err=True)
        atexit.register(self._at_exit)

    # -- called from the worker

    def _connected(self, syncer: _Syncer) -> None:
        first = self._run_id is None
        self._run_id = syncer.run_id
        if first:
            how = "resumed" if syncer.resumed else "created"
            link = ""
            if self.uri and self.uri.startswith("http"):
                link = f": {self.uri.rstrip('/')}/#/experiments/{syncer.experiment_id}/runs/{syncer.run_id}"
            _say(f"MLflow run {syncer.run_id} {how}{link}")

    def _snapshot(self) -> dict[str, Any]:
        with self._lock:
            return json.loads(json.dumps(self._record))

    def _save_record(self) -> None:
        with self._lock:
            _write_json(self.run_dir / RECORD_FILE, self._record)

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _say(msg, err=True)

    # -- the interface

    @property
    def run_id(self) -> str | None:
        return self._run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        values = {}
        for key, value in metrics.items():
            try:
                values[str(key)] = float(value)
            except (TypeError, ValueError):
                self._warn_once(f"metric:{key}", f"metric '{key}' is not a number ({value!r}); not logged")
        if self._metrics_fh.closed:
            self._metrics_fh = open(self.run_dir / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115
        self._metrics_fh.write(json.dumps({"step": int(step), "time": round(time.time(), 3),
                                           "metrics": values}) + "\n")
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
            self._record["artifacts"] = items + [{"path": str(path), "artifact_path": artifact_path}]
        self._save_record()
        if self._worker is not None:
            self._worker.wake.set()

    def set_tags(self, tags: dict[str, str]) -> None:
        with self._lock:
            self._record["tags"].update({str(k): str(v) for k, v in tags.items()})
        self._save_record()
        if self._worker is not None:
            self._worker.wake.set()

    def finish(self, status: str | None = "FINISHED") -> None:
        """Flush (bounded wait) and end the run; status None leaves it RUNNING for the requeued job."""
        if self._finished:
            return
        self._finished = True
        with contextlib.suppress(Exception):
            atexit.unregister(self._at_exit)
        with self._lock:
            self._record["status"] = status
            self._record["end_time"] = int(time.time() * 1000) if status else None
        self._save_record()
        self._metrics_fh.close()
        if self._worker is None:
            return
        tcfg = self.cfg.tracking
        uploads = self._worker.connected and self._uploads_pending()
        self._worker.stop()
        self._worker.join(tcfg.timeout_s + (tcfg.upload_timeout_s if uploads else 0.0))
        if self._worker.is_alive() or not self._worker.connected:
            _say(f"not everything reached MLflow at {self.uri}; it is all in {self.run_dir}; "
                 f"send it with: {SYNC_COMMAND} {self.run_dir}", err=True)

    def _uploads_pending(self) -> bool:
        """Artifacts this store does not have yet (the model at the end of a run, typically)."""
        done = _read_json(self.run_dir / SYNC_FILE).get(self.uri, {}).get("artifacts", {})
        for item in self._snapshot()["artifacts"]:
            with contextlib.suppress(OSError):
                st = Path(item["path"]).stat()
                if done.get(item["path"]) != f"{st.st_size}:{st.st_mtime_ns}":
                    return True
        return False

    def _at_exit(self) -> None:
        """The process ends without finish(): an exception escaped the trainer."""
        if os.getpid() == self._pid:
            self.finish("FAILED")


def start_tracking(cfg: Config, run_dir: Path, is_main: bool, world_size: int,
                   tags: dict[str, str] | None = None) -> Tracker:
    """The tracker for this process: rank 0 logs, the others get a `Tracker` that does nothing.

    Blocks at most ``cfg.tracking.timeout_s`` (waiting for the run to be created or resumed);
    ``tracker.run_id`` is None until the server has answered.
    """
    if not is_main:
        return Tracker()
    return _MainTracker(cfg, Path(run_dir), world_size, tags or {})


# ----------------------------------------------------------------------------- replay


def sync_run_dir(run_dir: Path | str, uri: str | None = None) -> dict[str, Any]:
    """Send to `uri` (default: `tracking_uri()`) whatever of RUN_DIR it does not have yet.

    Creates the run when this URI never saw it, appends otherwise; calling it again sends nothing.
    Returns {"run_id", "uri", "created", "metrics", "params", "artifacts"} (counts sent now).
    """
    run_dir = Path(run_dir)
    record_path = run_dir / RECORD_FILE
    if not record_path.is_file():
        raise FileNotFoundError(f"{run_dir} has no {RECORD_FILE}: not a run directory written by "
                                "pipeline.tracking")
    record = _read_json(record_path)
    uri = normalize_uri(uri) if uri else tracking_uri()
    if _sqlite_path(uri) is not None:
        _sqlite_path(uri).parent.mkdir(parents=True, exist_ok=True)
    import mlflow  # noqa: F401

    # A replay has time (no training waits on it) but should not spend 4 minutes on a server that is down.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    syncer = _Syncer(run_dir, uri, lambda: record, live=False)
    syncer.connect()
    syncer.push()
    return {"run_id": syncer.run_id, "uri": uri, "created": not syncer.resumed, **syncer.sent}
