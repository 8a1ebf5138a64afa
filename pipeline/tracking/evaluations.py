"""launch/evaluate.py's MLflow runs: one per checkpoint evaluated, nested under the source run (the run
whose run directory was judged; MLflow's `mlflow.parentRunId` tag: the UI shows them under it, to expand
and compare), and with several checkpoints one more, "<data> vs step", whose metrics are logged at each
pretraining step (MLflow's chart of a metric against step) with the same curves as a PNG artifact.

Rank 0 only, after the figures are printed: a store that cannot be reached costs a warning, not the table.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline.tracking.sync import experiment, recorded_run_id, say, tracking_uri, ui_hint

EXPERIMENT = "vit-pipeline"  # a weights file's evaluations (no source run): the project's default experiment


def log_evaluations(source: Path, data: str, results: list[tuple[str, int | None, dict[str, float]]],
                    params: dict[str, str]) -> list[str]:
    """Log (checkpoint name, pretraining step, metrics) of each checkpoint; the new runs' ids. Metric names
    are eval/<data>/<name>, as a run's eval.sets logs them."""
    from mlflow.entities import Metric, RunTag
    from mlflow.tracking import MlflowClient

    uri = tracking_uri()
    client = MlflowClient(uri)
    parent = recorded_run_id(source, uri) if source.is_dir() else None
    exp_id = client.get_run(parent).info.experiment_id if parent else experiment(client, uri, EXPERIMENT).experiment_id
    nest = {"mlflow.parentRunId": parent} if parent else {}
    made = []

    def new_run(name: str, note: str) -> str:
        tags = {**nest, "source_path": str(source), "evaluation_data": data, "mlflow.note.content": note}
        run = client.create_run(exp_id, run_name=name, tags=tags)
        for key, value in params.items():
            client.log_param(run.info.run_id, key, value)
        made.append(run.info.run_id)
        return run.info.run_id

    now = int(time.time() * 1000)
    for name, step, metrics in results:
        run_id = new_run(f"evaluate {data} @ {name}", f"`launch/evaluate.py` of `{source}` ({name}) on `{data}`.")
        client.log_batch(run_id, metrics=[Metric(f"eval/{data}/{k}", v, now, step or 0) for k, v in metrics.items()],
                         tags=[RunTag("checkpoint", name)])
        client.set_terminated(run_id)
    steps = [r for r in results if r[1] is not None]
    if len(steps) > 1:
        run_id = new_run(f"evaluate {data} vs step", f"Accuracy on `{data}` against the pretraining step of `{source}`.")
        client.log_batch(run_id, metrics=[Metric(f"eval/{data}/{k}", v, now, step) for _, step, m in steps
                                          for k, v in m.items()])
        with tempfile.TemporaryDirectory() as tmp:
            png = plot_vs_step(steps, data, Path(tmp) / f"{data}_vs_step.png")
            client.log_artifact(run_id, str(png))
        client.set_terminated(run_id)
    say(f"logged {len(made)} MLflow run(s)" + (f" under run {parent}" if parent else "") + f"; {ui_hint(uri, exp_id)}")
    return made


def plot_vs_step(steps: list[tuple[str, int | None, dict[str, float]]], data: str, path: Path) -> Path:
    """Top-1 of each protocol against the pretraining step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    for key, label in (("knn_top1", "k-NN (k=20)"), ("linear_top1", "linear probe")):
        points = [(s, 100 * m[key]) for _, s, m in steps if key in m]
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.set(xlabel="pretraining step", ylabel="top-1 (%)", title=f"{data}: accuracy against pretraining step")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def params_of(args: Any) -> dict[str, str]:
    return {"source": str(args.source), "data": str(args.data), "protocols": ",".join(args.protocols)}
