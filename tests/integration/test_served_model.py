"""A run's backbone as an MLflow Model (pipeline/tracking/served.py): logged and registered at the end of a run
with tracking.register, then served by `mlflow models serve -m models:/NAME/1 --env-manager local` on loopback (a
real server, a real HTTP request), its answer the vectors launch/embed.py writes for the same images."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.integration.runs import ROOT, env, free_port, run_here, supervised

pytestmark = pytest.mark.slow
NAME = "tiny-vit"


def _embed(run_dir: Path, shards: Path, out: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """launch/embed.py's main in this process (one rank, no workers): {key: (cls, mean_patch)}."""
    from pipeline.run.embed import read_embeddings

    sys.path.insert(0, str(ROOT / "launch"))
    try:
        from embed import main as embed_main
    finally:
        sys.path.pop(0)
    assert embed_main(["--from", str(run_dir), "--data", str(shards), "--out", str(out), "--splits", "val",
                       "--workers", "0"]) == 0
    table = read_embeddings(out)
    return {k: (np.asarray(c, np.float32), np.asarray(m, np.float32))
            for k, c, m in zip(table["key"].to_pylist(), table["cls"].to_pylist(), table["mean_patch"].to_pylist())}


def _images(shards: Path) -> tuple[list[str], np.ndarray]:
    """The first val shard's samples, decoded as the reader decodes them: keys and uint8 (N, H, W, 3)."""
    from pipeline.config import DataConfig
    from pipeline.data import dataset_info_of, tario

    shard = dataset_info_of(DataConfig(path=str(shards))).split("val").shards[0]
    raws = list(tario.iter_raw_samples(str(shards / shard)))
    return [f"val/{r.key}" for r in raws], np.stack([np.asarray(tario.sample_image(r)) for r in raws])


def _serve(uri: str, port: int) -> subprocess.Popen:
    """`mlflow models serve` as docs/tracking.md types it, in the venv (its uvicorn on PATH, as activated)."""
    bin_dir = str(Path(sys.executable).parent)
    proc = subprocess.Popen([str(Path(bin_dir) / "mlflow"), "models", "serve", "-m", f"models:/{NAME}/1",
                             "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)],
                            env={**env(), "MLFLOW_TRACKING_URI": uri, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2):
                return proc
        except OSError:
            time.sleep(0.5)
    raise AssertionError("mlflow models serve did not answer /ping in 180 s")


def test_the_registered_model_served_over_http_answers_with_the_vectors_embed_gives(shards, tmp_path) -> None:
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir = tmp_path / "run"
    done = run_here("pretrain.py", "configs/pretrain/demo.yaml",
                    [*supervised(shards, run_dir, 1, steps=4), "train.eval_every=4", f"eval.sets.synth={shards}",
                     "tracking.enabled=true", f"tracking.register={NAME}"],
                    extra_env={"MLFLOW_TRACKING_URI": uri})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"registered {NAME} version 1 (models:/{NAME}/1)" in done.stdout, done.stdout[-3000:]

    # The Model Registry: version 1 from the run's artifact `model`, the run's k-NN in its description.
    client = MlflowClient(uri)
    (version,) = client.search_model_versions(f"name = '{NAME}'")
    assert str(version.version) == "1" and version.source.endswith("/model")
    knn = [json.loads(line)["metrics"]["eval/synth/knn_top1"] for line in (run_dir / "metrics.jsonl").open()
           if "eval/synth/knn_top1" in line][-1]
    assert f"eval/synth/knn_top1 {100 * knn:.2f}%" in version.description, version.description
    mlmodel = (run_dir / "mlflow" / "model" / "MLmodel").read_text()
    assert "signature:" in mlmodel and "saved_input_example_info" in mlmodel, mlmodel

    # A store that missed the run's end (down then, or another one) gets the model and its registration from the
    # replay, once.
    from pipeline.tracking import sync_run_dir

    other = f"sqlite:///{tmp_path / 'other.db'}"
    sync_run_dir(run_dir, other), sync_run_dir(run_dir, other)
    (replayed,) = MlflowClient(other).search_model_versions(f"name = '{NAME}'")
    assert replayed.description == version.description

    expected = _embed(run_dir, shards, tmp_path / "emb")
    keys, images = _images(shards)
    server = _serve(uri, port := free_port())
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations",
                                         json.dumps({"inputs": images.tolist()}).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            got = json.loads(answer.read())["predictions"]
    finally:
        os.killpg(server.pid, 9)
        server.wait()
    cls, mean_patch = np.asarray(got["cls"], np.float32), np.asarray(got["mean_patch"], np.float32)
    assert cls.shape == (len(keys), 32) and mean_patch.shape == (len(keys), 32)
    # The same transform, normalisation and forward on the same batch: equal to the last bit.
    assert np.array_equal(cls, np.stack([expected[k][0] for k in keys]))
    assert np.array_equal(mean_patch, np.stack([expected[k][1] for k in keys]))
