"""The MLflow UI as a user sees it: a demo pretraining run and a fine-tune from it, served by `mlflow server`.

One short pretraining and one short fine-tune (the demo configs on the digits shards, a single
process each) log to `mlflow.db` in a temporary folder; `mlflow server` started there with no store
flags (what plain `mlflow ui` there opens) then answers the REST API (runs, flattened params, metric
histories, the fine-tune's link to its parent), and headless Chromium opens the experiment page as
a user does from the link a job prints, the compare page's loss and top-1 curves of both runs
overlaid, the chart view, and the run-compare table. The screenshots and each page's HTML go
to tests/.artifacts/ (mlflow_experiment.png, mlflow_curves.png, mlflow_charts.png, mlflow_compare.png).

The README's pictures (docs/img/) are two of these, from longer runs:
    VIT_UI_STEPS=300,150 pytest tests/integration/test_mlflow_ui.py
    cp tests/.artifacts/mlflow_experiment.png docs/img/mlflow-experiment.png
    cp tests/.artifacts/mlflow_curves.png docs/img/mlflow-compare.png
Without Chromium the browser tests skip; `bash tests/ui/install_chromium.sh` installs it."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.tracking import recorded_run_id
from tests.integration.runs import PYTHON, ROOT, free_port, make_synthetic_shards, run_here
from tests.ui.screenshot import find_chromium, shoot

pytestmark = pytest.mark.dist

ARTIFACTS = ROOT / "tests" / ".artifacts"
MLFLOW = str(Path(PYTHON).with_name("mlflow"))
EXPERIMENT = "vit-pipeline-demo"  # tracking.experiment of both demo configs
# The browser reaches the server under this name (mapped to 127.0.0.1 inside Chromium only). On
# localhost MLflow 3 opens its "Assistant" side panel on first load, which a team server does not
# do; a non-local name shows the page as most users see it. The server must then allow that Host
# and Origin (MLflow 3's DNS-rebinding and CORS checks).
UI_HOST = "mlflow.test"
SERVER_START_S = 150  # `mlflow server` imports a lot: ~20-50 s on a busy 2-core box
BROWSER_TIMEOUT_S = 90  # for a page to show what it should
# Steps of the pretraining and the fine-tune: short by default; longer for the README's pictures.
PRE_STEPS, FT_STEPS = (int(n) for n in os.environ.get("VIT_UI_STEPS", "20,10").split(","))


# ----------------------------------------------------------------------------- runs and server


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Iterator[dict]:
    """Digits shards, a 20-step pretraining and a 10-step fine-tune at 64 px logged to SQLite, and
    `mlflow server` on that store (started once the pretraining has made the store, so that its
    start overlaps the fine-tune); the server is stopped, with its process group, at the end."""
    tmp = tmp_path_factory.mktemp("mlflow_ui")
    data = tmp / "digits"
    if importlib.util.find_spec("sklearn") is not None:  # the real demo data (pip install .[demo])
        subprocess.run([PYTHON, str(ROOT / "launch/make_shards.py"), "--source", "digits", "--out", str(data),
                        "--no-progress"], check=True, cwd=ROOT, capture_output=True)
    else:
        make_synthetic_shards(data, size=32, samples=400, classes=10, per_shard=100)
    db = tmp / "mlflow.db"  # where `mlflow ui` started in tmp looks by default (jobs started there need no URI)
    mlflow_env = {"MLFLOW_TRACKING_URI": f"sqlite:///{db}"}  # the jobs run from the repository root
    # Generous tracking waits: a new SQLite store takes seconds to create its tables on a loaded box,
    # and this test is about what ends up in MLflow, not about how long a job waits for it.
    common = ["tracking.timeout_s=60", f"data.path={data}", "data.num_workers=0"]  # what MLflow shows, not the loader
    pre_dir, ft_dir = tmp / "demo-pretrain", tmp / "demo-finetune"  # the run directory names the run

    pre = run_here("pretrain.py", "configs/pretrain/demo.yaml",
                   [*common, f"run.dir={pre_dir}", f"train.steps={PRE_STEPS}", f"train.eval_every={PRE_STEPS // 5}",
                    f"train.warmup_steps={PRE_STEPS // 5}", f"train.ckpt_every={PRE_STEPS}",
                    f"train.log_every={max(2, PRE_STEPS // 30)}"], extra_env=mlflow_env)
    assert pre.returncode == 0, pre.stdout[-3000:] + pre.stderr[-3000:]

    port, log = free_port(), tmp / "mlflow_server.log"
    proc = _start_server(db, tmp, port, log)
    try:
        ft = run_here("finetune.py", "configs/finetune/demo.yaml",
                      [*common, f"run.dir={ft_dir}", f"train.steps={FT_STEPS}", f"train.eval_every={FT_STEPS // 5}",
                       f"train.warmup_steps={FT_STEPS // 5}", f"train.ckpt_every={FT_STEPS}",
                       f"train.log_every={max(2, FT_STEPS // 30)}"], extra=["--from", str(pre_dir), "--res", "64"],
                      extra_env=mlflow_env)
        assert ft.returncode == 0, ft.stdout[-3000:] + ft.stderr[-3000:]
        base = f"http://127.0.0.1:{port}"
        _wait_until_up(proc, base, log)
        yield {"tmp": tmp, "db": db, "pre_dir": pre_dir, "ft_dir": ft_dir, "base": base, "port": port,
               "pre_id": recorded_run_id(pre_dir), "ft_id": recorded_run_id(ft_dir)}
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def server(demo) -> str:
    return demo["base"]


def _start_server(db: Path, tmp: Path, port: int, log: Path) -> subprocess.Popen:
    # No --backend-store-uri, no --default-artifact-root: MLflow's defaults (./mlflow.db, ./mlruns) in tmp.
    cmd = [MLFLOW, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--allowed-hosts", f"127.0.0.1:{port},localhost:{port},{UI_HOST}:{port}",
           "--cors-allowed-origins", f"http://{UI_HOST}:{port}"]
    # No job runner: MLflow 3 otherwise starts a huey consumer with 8 worker processes (GenAI scoring
    # jobs), nothing this page needs, and too much for a 2-core box.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    with open(log, "w") as fh:
        # Its own session: `mlflow server` runs uvicorn as a child, and both must go at the end.
        return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _wait_until_up(proc: subprocess.Popen, base: str, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while True:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                if r.status == 200:
                    return
        if proc.poll() is not None:
            pytest.fail(f"mlflow server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"mlflow server did not answer within {SERVER_START_S}s:\n{log.read_text()[-3000:]}")
        time.sleep(1)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # the group is the one start_new_session made for it
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    else:  # the server is gone; a child that outlived it would still hold the group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def _api(base: str, path: str, body: dict | None = None, **query) -> dict:
    url = f"{base}/api/2.0/mlflow/{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{url}: HTTP {e.code}: {e.read()[:500]!r}") from None


def _history(base: str, run_id: str, key: str) -> list[tuple[int, float]]:
    out = _api(base, "metrics/get-history", run_id=run_id, metric_key=key, max_results=1000)
    return sorted((int(m["step"]), float(m["value"])) for m in out.get("metrics", []))


@pytest.fixture(scope="module")
def experiment_id(server) -> str:
    return _api(server, "experiments/get-by-name", experiment_name=EXPERIMENT)["experiment"]["experiment_id"]


# ----------------------------------------------------------------------------- what the server answers


def test_both_runs_with_params_metrics_and_the_parent_link(demo, server, experiment_id):
    found = _api(server, "runs/search", {"experiment_ids": [experiment_id], "max_results": 50})["runs"]
    runs = {r["info"]["run_name"]: r for r in found}
    assert set(runs) == {"demo-pretrain", "demo-finetune"}, sorted(runs)
    pre, ft = runs["demo-pretrain"], runs["demo-finetune"]
    assert pre["info"]["run_id"] == demo["pre_id"] and ft["info"]["run_id"] == demo["ft_id"]
    for r in (pre, ft):
        assert r["info"]["status"] == "FINISHED", r["info"]

    params = {name: {p["key"]: p["value"] for p in r["data"].get("params", [])} for name, r in runs.items()}
    p_pre, p_ft = params["demo-pretrain"], params["demo-finetune"]
    # The resolved config, flattened: the architecture is shared, the recipe and resolution differ.
    assert p_pre["model.embed_dim"] == p_ft["model.embed_dim"] == "96"
    assert p_pre["model.depth"] == p_ft["model.depth"] == "4"
    assert (p_pre["model.img_size"], p_ft["model.img_size"]) == ("32", "64")
    assert float(p_pre["train.lr"]) == pytest.approx(2e-3) and float(p_ft["train.lr"]) == pytest.approx(0.03)
    assert (p_pre["train.optimizer"], p_ft["train.optimizer"]) == ("adamw", "sgd")
    assert p_pre["train.steps"] == str(PRE_STEPS) and p_ft["train.steps"] == str(FT_STEPS)
    assert p_pre["deepspeed.zero_stage"] == "1"

    tags = {name: {t["key"]: t["value"] for t in r["data"].get("tags", [])} for name, r in runs.items()}
    t_pre, t_ft = tags["demo-pretrain"], tags["demo-finetune"]
    assert (t_pre["kind"], t_ft["kind"]) == ("pretrain", "finetune")
    assert "parent_run_id" not in t_pre
    assert t_ft["parent_run_id"] == demo["pre_id"]
    assert t_ft["parent_run_name"] == "demo-pretrain"
    assert t_ft["source_path"] == str(demo["pre_dir"].resolve())
    assert demo["pre_id"] in t_ft["mlflow.note.content"]  # the description the run page shows

    # Metric histories, with the optimizer step as MLflow's step.
    every = max(2, PRE_STEPS // 30), max(2, FT_STEPS // 30)
    assert [s for s, _ in _history(server, demo["pre_id"], "train/loss")] == list(range(every[0], PRE_STEPS + 1, every[0]))
    assert [s for s, _ in _history(server, demo["ft_id"], "train/loss")] == list(range(every[1], FT_STEPS + 1, every[1]))
    assert [s for s, _ in _history(server, demo["pre_id"], "eval/top1")] == [PRE_STEPS // 5 * k for k in range(1, 6)]
    assert [s for s, _ in _history(server, demo["ft_id"], "eval/top1")] == [FT_STEPS // 5 * k for k in range(1, 6)]
    for run_id in (demo["pre_id"], demo["ft_id"]):
        for key in ("train/lr", "train/grad_norm", "perf/images_per_s", "eval/loss", "eval/top5"):
            assert _history(server, run_id, key), f"{run_id} has no {key}"
        assert all(0.0 <= v <= 1.0 for _, v in _history(server, run_id, "eval/top1"))

    # The experiment says what it holds: training runs ("Machine learning" in MLflow 3's UI), not GenAI traces.
    experiment = _api(server, "experiments/get", experiment_id=pre["info"]["experiment_id"])["experiment"]
    assert {t["key"]: t["value"] for t in experiment.get("tags", [])}.get("mlflow.experimentKind") == (
        "custom_model_development")
    # Artifacts, listed through the server: the resolved config and the exported weights.
    for run_id in (demo["pre_id"], demo["ft_id"]):
        listed = {f["path"] for f in _api(server, "artifacts/list", run_id=run_id).get("files", [])}
        assert {"config.yaml", "model.safetensors"} <= listed, listed


# ----------------------------------------------------------------------------- what the browser shows
# tests/ui/screenshot.py drives Chromium over the DevTools protocol: it waits until the page shows
# the expected texts (MLflow's UI loads its chart library lazily, so a fixed delay is not enough),
# can click toggles, then captures. The pictures stay in tests/.artifacts/ with the page's HTML.

COMPARE_CLICKS = (  # what a user does on the compare page to see what differs
    '[aria-label="collapse Visualizations"]',  # a parallel-coordinates plot of arbitrary params
    '[aria-label="collapse Artifacts"]',
    'button[aria-label="Parameters - Show diff only"]',
    'button[aria-label="Metrics - Show diff only"]',
    'button[aria-label="Tags - Show diff only"]',
)
HIDE_PLOTLY_TOOLBAR = ".modebar { display: none !important; }"  # shown over every chart when headless


def _browse(url: str, name: str, size: tuple[int, int], expect: tuple[str, ...], clicks=()) -> str:
    """Screenshot `url` to tests/.artifacts/NAME.png once it shows every text of `expect` and `clicks` are
    done; return its HTML as captured (after the clicks)."""
    if find_chromium() is None:
        pytest.skip("no Chromium on PATH (bash tests/ui/install_chromium.sh installs Debian's chromium)")
    png, html = ARTIFACTS / f"{name}.png", ARTIFACTS / f"{name}.html"
    png.unlink(missing_ok=True)
    shown = shoot(url, png, size, list(expect), timeout=BROWSER_TIMEOUT_S, css=HIDE_PLOTLY_TOOLBAR,
                  click=list(clicks), dom=html, host_map={UI_HOST: "127.0.0.1"})
    assert png.is_file(), f"Chromium wrote no screenshot of {url}"
    dom = html.read_text()
    assert "INTERNAL_ERROR" not in dom and "Request error" not in dom and "Error while loading" not in dom, (
        f"the page shows an error; see {png}")
    # `shown`: every text of `expect` was on the page (before the clicks), and every click found its element.
    assert shown, f"{url} did not show all of {list(expect)} within {BROWSER_TIMEOUT_S}s (or a click missed); see {png}"
    _assert_plausible_png(png, *size)
    return dom


def _assert_plausible_png(png: Path, width: int, height: int) -> None:
    from PIL import Image

    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{png} is not a PNG"
    assert len(data) > 20_000, f"{png} is only {len(data)} bytes: a blank page?"
    with Image.open(png) as img:
        assert img.size == (width, height)
        colours = img.convert("RGB").getcolors(maxcolors=1 << 20) or []
    assert len(colours) > 200, f"{png} has {len(colours)} colours: blank or still loading?"


def test_compare_page_shows_both_runs_side_by_side(demo, experiment_id):
    # MLflow 3's route (RoutePaths.compareRuns / getCompareRunPageRoute): hash router, JSON lists in the query.
    query = urllib.parse.urlencode({"runs": json.dumps([demo["pre_id"], demo["ft_id"]]),
                                    "experiments": json.dumps([experiment_id])})
    url = f"http://{UI_HOST}:{demo['port']}/#/compare-runs?{query}"
    expect = ("Comparing 2 Runs", "demo-pretrain", "demo-finetune", demo["pre_id"], demo["ft_id"],
              "model.embed_dim", "train.lr", "eval/top1")
    dom = _browse(url, "mlflow_compare", (1400, 1400), expect, COMPARE_CLICKS)
    # With "Show diff only": what differs between the two (resolution, recipe) is listed side by side.
    for text in ("model.img_size", "train.optimizer", "adamw", "sgd", "eval/top1"):
        assert text in dom, f"{text!r} not among the differences on the compare page"


def test_experiment_page_opens_on_the_training_runs(demo, experiment_id):
    # The link a job prints (tracking.ui_hint), as a user opens it the first time: MLflow 3 would
    # otherwise show its GenAI overview (traces), empty for training runs.
    url = f"http://{UI_HOST}:{demo['port']}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
    dom = _browse(url, "mlflow_experiment", (1400, 800), ("demo-pretrain", "demo-finetune", "Run Name"))
    assert "No traces" not in dom


def test_compare_shows_loss_and_top1_curves_overlaid(demo, experiment_id):
    # Compare -> a metric: MLflow 3's metric page (Routes.getMetricPageRoute), both runs, both metrics.
    as_json = {"runs": [demo["pre_id"], demo["ft_id"]], "metric": "train/loss", "experiments": [experiment_id],
               "plot_metric_keys": ["train/loss", "eval/top1"], "plot_layout": {}, "deselected_curves": [],
               "last_linear_y_axis_range": []}
    plain = {"x_axis": "step", "y_axis_scale": "linear", "line_smoothness": "1", "show_point": "true"}
    query = "&".join([*(f"{k}={urllib.parse.quote(json.dumps(v))}" for k, v in as_json.items()),
                      *(f"{k}={v}" for k, v in plain.items())])
    url = f"http://{UI_HOST}:{demo['port']}/#/metric?{query}&workflowType=machine_learning"
    expect = ("train/loss vs eval/top1", "demo-pretrain (train/loss)", "demo-finetune (eval/top1)")
    _browse(url, "mlflow_curves", (1400, 900), expect)


def test_runs_chart_view_overlays_both_runs(demo, experiment_id):
    # The experiment's runs with their metric charts. workflowType=machine_learning: MLflow 3 otherwise
    # opens an experiment on its GenAI overview (traces, latency), empty for training runs.
    url = (f"http://{UI_HOST}:{demo['port']}/#/experiments/{experiment_id}/runs"
           "?workflowType=machine_learning&compareRunsMode=CHART")
    _browse(url, "mlflow_charts", (1400, 1000), ("demo-pretrain", "demo-finetune", "eval/top1", "eval/loss"))
