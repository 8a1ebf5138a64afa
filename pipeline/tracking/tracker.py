"""The live tracker of a training job: rank 0 writes the run directory, a background thread copies it to
MLflow (`pipeline.tracking.sync`), and no call of the training thread waits on the network."""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.config import Config, to_dict
from pipeline.tracking.sync import (
    METRICS_FILE,
    RECORD_FILE,
    SYNC_COMMAND,
    Syncer,
    param_value,
    read_json,
    recorded_run_id,
    say,
    tracking_uri,
    ui_hint,
    write_json,
)

# What an MLflow error's code says of the server: these are a failure to reach it or its own trouble; any other
# code (INVALID_PARAMETER_VALUE, PERMISSION_DENIED, ...) is the server's answer to what we sent.
UNREACHED_CODES = {"INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED", "ENDPOINT_NOT_FOUND"}


def failure_said(uri: str, e: BaseException) -> str:
    """A failed call to MLflow in a few words: 'MLflow unreachable at URI (...)' for a network fault or the
    server's own trouble, 'MLflow at URI answered CODE: message' when it refused what we sent (a parameter
    name it does not take, a permission), so that a refusal is not mistaken for an outage."""
    text = " ".join(str(e).split())[:300]
    code = getattr(e, "error_code", None)
    if isinstance(code, str) and code not in UNREACHED_CODES:
        return f"MLflow at {uri} answered {code}: {text}"
    return f"MLflow unreachable at {uri} ({type(e).__name__}: {text})"


def refused_for_good(e: BaseException) -> bool:
    """Whether MLflow answered (a code of its own, not an outage's): the same request gets the same answer, so a
    refused start is not worth retrying (MLflow 3 answers a file: store INVALID_PARAMETER_VALUE, every time)."""
    code = getattr(e, "error_code", None)
    return isinstance(code, str) and code not in UNREACHED_CODES


def remedy(uri: str) -> str:
    """What to change, where the store's kind says it: MLflow 3 keeps file: stores read-only."""
    if uri.startswith("file:") or "://" not in uri:
        return (" (MLflow 3 takes no new runs in a file: store: set MLFLOW_TRACKING_URI=sqlite:///mlflow.db, or "
                "MLFLOW_ALLOW_FILE_STORE=true to keep the file store)")
    return ""


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'train': {'lr': 1}} -> {'train.lr': 1}: MLflow params. A list of named sections by name:
    data.sources [{'name': 'web', 'weight': 0.3}] -> {'data.sources.web.weight': 0.3}."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, list) and v and all(isinstance(x, dict) and "name" in x for x in v):
            v = {str(x["name"]): {key: y for key, y in x.items() if key != "name"} for x in v}
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _parent_tags(source: str) -> dict[str, str]:
    """A fine-tune's link to its pretraining run: the source path and the run id recorded beside it.

    A plain tag, not mlflow.parentRunId: that one nests the fine-tune under its parent in the runs
    table (hidden until expanded), while a tag keeps both as rows to compare side by side."""
    path = Path(source).expanduser().resolve()
    tags, note = {"source_path": str(path)}, f"Fine-tuned from `{path}`."
    here = path if path.is_dir() else path.parent
    for folder in (here, *here.parents[:2]):  # run dir, or a file in it or in its checkpoints/<tag>/
        record = read_json(folder / RECORD_FILE)
        # Its id in the store this fine-tune logs to, else in the store it logged to itself.
        parent = (recorded_run_id(folder, tracking_uri()) or recorded_run_id(folder, record.get("uri"))
                  if record else None)
        if parent:
            tags["parent_run_id"] = parent
            tags["parent_run_name"] = str(record.get("run_name", folder.name))
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



class Tracker:
    """The interface, and what non-main ranks get: every method does nothing, no file is written."""

    run_id: str | None = None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None: ...

    def set_tags(self, tags: dict[str, str]) -> None: ...

    def log_model(self, folder: Path, artifact_path: str, register: str | None, description: str) -> None: ...

    def finish(self, status: str | None = "FINISHED") -> None: ...


class _MainTracker(Tracker):
    """Rank 0: metrics.jsonl + tracking.json always; MLflow through a background thread when enabled."""

    def __init__(self, cfg: Config, run_dir: Path, world_size: int, tags: dict[str, str]):
        self.cfg, self.tcfg, self.run_dir = cfg, cfg.tracking, run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self._lock, self._wake, self._first_try = threading.Lock(), threading.Event(), threading.Event()
        self._finished = self._stopping = self._connected = self._outage = self._refused = False
        self._pid = os.getpid()  # a forked child (DataLoader worker) inherits the atexit hook: not its job
        self.uri = tracking_uri() if self.tcfg.enabled else None
        rec = read_json(run_dir / RECORD_FILE)
        rec.update(version=1, uri=self.uri or rec.get("uri"), experiment=self.tcfg.experiment,
                   run_name=self.tcfg.run_name or run_dir.resolve().name, config=to_dict(cfg),
                   params={k: param_value(v) for k, v in flatten(to_dict(cfg)).items()},
                   tags={**rec.get("tags", {}), **default_tags(cfg, run_dir, world_size),
                         **{k: str(v) for k, v in tags.items()}},
                   artifacts=rec.get("artifacts", []), status=None, end_time=None)
        rec.setdefault("start_time", int(time.time() * 1000))
        self._record = rec
        self._save_record()
        self._metrics_fh = open(run_dir / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115
        self._thread: threading.Thread | None = None
        if not self.tcfg.enabled:
            say(f"MLflow off (tracking.enabled=false); metrics go to {run_dir / METRICS_FILE}; "
                 f"upload later with: {SYNC_COMMAND} {run_dir}")
            return
        import mlflow  # noqa: F401  here, not in the thread: a fork (DataLoader workers) during an import can hang
        # One HTTP call takes at most ~timeout_s and MLflow does not retry it (its defaults, 120 s and 7
        # retries, would hold the thread for minutes): this thread retries later. A user's value wins.
        # (MLflow reads these from the environment only; the URI itself is passed, never set there.)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, math.ceil(self.tcfg.timeout_s))))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        say(f"MLflow experiment '{self.tcfg.experiment}', run '{rec['run_name']}' at {self.uri}; {ui_hint(self.uri)}")
        self._syncer = Syncer(run_dir, self.uri, self._snapshot, live=True)
        self._monitor: Any = None
        self._next_try = 0.0
        self._thread = threading.Thread(target=self._sync_loop, name="mlflow-tracking", daemon=True)
        self._thread.start()
        if not self._first_try.wait(self.tcfg.timeout_s):
            say(f"MLflow at {self.uri} did not answer within {self.tcfg.timeout_s:g}s; training starts anyway: "
                 f"metrics are in {run_dir / METRICS_FILE} and are sent as soon as it answers", err=True)
        atexit.register(self._at_exit)

    # -- the background thread: the training thread never waits on MLflow

    def _sync_loop(self) -> None:
        while True:
            stopping = self._stopping
            if not self._connected and not self._refused and (stopping or time.monotonic() >= self._next_try):
                self._attempt(self._connect)
                self._first_try.set()
            if self._connected:
                self._attempt(self._syncer.push)
            if stopping:
                with contextlib.suppress(Exception):
                    if self._monitor:
                        self._monitor.finish()
                return
            self._wake.wait(None if self._connected or self._refused else max(0.1, self._next_try - time.monotonic()))
            self._wake.clear()

    def _attempt(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - anything the server or the network throws
            self._connected, self._next_try = False, time.monotonic() + self.tcfg.retry_s
            if fn == self._connect and refused_for_good(e):  # refused at the start: said once, never retried
                self._refused = True
                say(f"{failure_said(self.uri, e)}; not retried: it would answer the same{remedy(self.uri)}; "
                    f"training goes on, metrics keep going to {self.run_dir / METRICS_FILE}; replay them later with: "
                    f"{SYNC_COMMAND} {self.run_dir}", err=True)
            elif not self._outage:
                self._outage = True
                say(f"{failure_said(self.uri, e)}; training goes on, metrics keep going to {self.run_dir / METRICS_FILE}; retrying every "
                     f"{self.tcfg.retry_s:g}s; replay later with: {SYNC_COMMAND} {self.run_dir}", err=True)

    def _connect(self) -> None:
        self._syncer.connect()
        if self.run_id is None:
            say(f"MLflow run {self._syncer.run_id} {'resumed' if self._syncer.resumed else 'created'}; "
                 f"{ui_hint(self.uri, self._syncer.experiment_id)}")
        if self._outage:
            say(f"MLflow reachable again at {self.uri}; catching up from {METRICS_FILE}")
        self.run_id, self._connected, self._outage = self._syncer.run_id, True, False
        if self.tcfg.system_metrics and self._monitor is None and not self._stopping:
            self._monitor = False  # tried once, not again
            try:  # MLflow's own CPU/memory/disk/network (GPU with nvidia-ml-py) sampler, into this run
                from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

                self._monitor = SystemMetricsMonitor(self.run_id, resume_logging=True, tracking_uri=self.uri,
                                                     sampling_interval=self.tcfg.system_metrics_interval_s)
                self._monitor.start()
            except Exception as e:  # noqa: BLE001 - optional (psutil missing, ...): never worth a failed run
                say(f"system metrics not logged: {type(e).__name__}: {e}", err=True)

    # -- the interface, called by the training thread

    def _snapshot(self) -> dict[str, Any]:
        with self._lock:
            return json.loads(json.dumps(self._record))

    def _save_record(self) -> None:
        with self._lock:
            write_json(self.run_dir / RECORD_FILE, self._record)
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

    def log_model(self, folder: Path, artifact_path: str, register: str | None, description: str) -> None:
        """An MLflow Model folder (pipeline/tracking/served.py) to upload as `artifact_path`, and to register as a
        new version of `register` when given."""
        item = {"path": str(Path(folder).resolve()), "artifact_path": artifact_path, "register": register,
                "description": description}
        with self._lock:
            models = [m for m in self._record.get("models", []) if m["artifact_path"] != artifact_path]
            self._record["models"] = [*models, item]
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
        uploads = self._connected and (any(a["path"].endswith(".safetensors") for a in self._record["artifacts"])
                                       or bool(self._record.get("models")))
        # A new SQLite store still creating its tables (slow on a busy machine): a process that exits
        # mid-migration leaves a store that no later job can open, so that wait is bounded generously.
        creating = not self._connected and self.uri.startswith("sqlite:") and not self._first_try.is_set()
        self._stopping = True
        self._wake.set()
        self._thread.join(self.tcfg.timeout_s + (self.tcfg.upload_timeout_s if uploads or creating else 0.0))
        if self._thread.is_alive() or not self._connected:
            say(f"not everything reached MLflow at {self.uri}; it is all in {self.run_dir}; "
                 f"send it with: {SYNC_COMMAND} {self.run_dir}", err=True)

    def _at_exit(self) -> None:
        """The process ends without finish(): an exception escaped the trainer."""
        if os.getpid() == self._pid:
            self.finish("FAILED")


START_METRIC = "run/world_size"  # logged once at every start of a run: its records count the starts


def start_metrics(run_dir: Path, step: int, world_size: int) -> dict[str, float]:
    """What rank 0 logs at `step` when a run starts or restarts, so that the UI shows when an (elastic or
    requeued) job shrank, grew and lost work: run/world_size; run/restarts, the starts already recorded in
    RUN_DIR/metrics.jsonl; run/lost_steps, how far past `step` (the checkpoint resumed from) the last
    incarnation had logged. Steps are logged every train.log_every, so the true loss may be up to
    log_every - 1 more. Read from metrics.jsonl, the run's own record: no state of its own to keep. A line
    cut short by a killed writer is skipped."""
    starts, last = 0, step
    with contextlib.suppress(FileNotFoundError), open(run_dir / METRICS_FILE, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
                starts += START_METRIC in rec["metrics"]
                last = max(last, int(rec["step"]))
            except (ValueError, KeyError, TypeError):
                continue
    return {START_METRIC: float(world_size), "run/restarts": float(starts), "run/lost_steps": float(last - step)}


def start_tracking(cfg: Config, run_dir: Path, is_main: bool, world_size: int,
                   tags: dict[str, str] | None = None) -> Tracker:
    """Rank 0 logs; the others get a `Tracker` that does nothing. Blocks at most cfg.tracking.timeout_s;
    ``tracker.run_id`` is None until the server has answered."""
    if not is_main:
        return Tracker()
    return _MainTracker(cfg, Path(run_dir), world_size, tags or {})


