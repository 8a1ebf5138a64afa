"""`python launch/bench.py quality --smoke` (issue 69's Done-when: a smoke mode in `make test`): the benchmark's
whole chain on 600 real Fashion-MNIST images (Debian's dataset-fashion-mnist, installed by `make test`): the
baselines, the fine-tunes from random weights, one self-supervised recipe pretrained, judged by evaluate.py
and fine-tuned, every figure in its row of the CSV given, the table and the picture drawn from those rows, the
repository's CSV untouched. The other presets (supervised, MAE, DINOv3) are pretrained a few steps each in
pytest's process with the benchmark's own smoke overrides, so every preset the table names starts.

Time: the bench's chain is 10 processes (each imports torch and DeepSpeed), about 3 minutes on the 2-core
machine; the three in-process runs some 20 s (docs/testing.md)."""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import quality, quality_render
from pipeline.data.idx import FASHION_MNIST_DIR
from tests.integration.runs import ROOT, env, run_here

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fmnist_smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if not Path(FASHION_MNIST_DIR).is_dir():
        if os.environ.get("VIT_PIPELINE_REQUIRE_DATASETS") == "1":
            pytest.fail(f"{FASHION_MNIST_DIR} missing with VIT_PIPELINE_REQUIRE_DATASETS=1")
        pytest.skip(f"{FASHION_MNIST_DIR} missing: apt-get install dataset-fashion-mnist (make test does)")
    return quality.prepare_data(tmp_path_factory.mktemp("quality-data"), smoke=True)


def test_the_quality_smoke_writes_every_figure_and_the_table(tmp_path: Path, fmnist_smoke: dict[str, Path]) -> None:
    repo_csv = ROOT / "results" / "benchmarks.csv"
    before = hashlib.sha256(repo_csv.read_bytes()).hexdigest()
    out = subprocess.run([sys.executable, "launch/bench.py", "--csv", str(tmp_path / "q.csv"), "quality", "--smoke",
                          "--recipes", "dinov2", "--data-dir", str(fmnist_smoke[""].parent),
                          "--runs-dir", str(tmp_path / "runs"), "--quality-threads", "1"],
                         cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1800)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "eval step 4" in out.stdout and "[quality] $ python launch/finetune.py" in out.stdout  # progress shown
    with open(tmp_path / "q.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    figures = {json.loads(r["figures"])["recipe"]: json.loads(r["figures"]) for r in rows}
    assert [r["bench"] for r in rows] == ["quality"] * 4 and list(figures) == ["pixels", "random-vit", "scratch",
                                                                                "dinov2"]
    wanted = {"pixels": ["knn", "linear", "knn_1pct", "linear_1pct"],
              "random-vit": ["knn", "linear", "knn_1pct", "linear_1pct"],
              "scratch": ["ft10", "ft100"],
              "dinov2": ["knn", "linear", "knn_1pct", "linear_1pct", "ft10", "ft100"]}
    for recipe, keys in wanted.items():
        for key in keys:
            value = figures[recipe][key]
            assert isinstance(value, float) and 0 <= value <= 1 and math.isfinite(value), (recipe, key, value)
        assert figures[recipe]["smoke"] is True
    dino = figures["dinov2"]
    assert dino["steps"] == 4 and dino["epochs"] == round(4 * 16 / 400, 2) and dino["pretrain_s"] > 0
    assert [p[0] for p in dino["curve"]] == [2, 4]  # the in-training k-NN at each evaluation
    assert figures["pixels"]["knn"] > 0.5  # real images: raw pixels are far above chance even with 400 of them
    assert hashlib.sha256(repo_csv.read_bytes()).hexdigest() == before  # the smoke's rows stayed in its CSV

    page = "\n".join(quality_render.section(rows))
    assert "| dinov2 | 1 | 4 (0.16) |" in page and "smoke" in page and "raw pixels" in page
    smoke_off = [dict(r, figures=json.dumps(dict(json.loads(r["figures"]), smoke=False))) for r in rows]
    assert quality_render.draw(smoke_off, tmp_path / "quality.png")
    assert (tmp_path / "quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("recipe", ["supervised", "mae", "dinov3"])
def test_every_other_preset_starts_with_the_bench_smoke_overrides(tmp_path: Path, fmnist_smoke: dict[str, Path],
                                                                  recipe: str) -> None:
    preset = quality.RECIPES[recipe]
    data = fmnist_smoke[""]
    out = run_here("pretrain.py", preset.preset, [f"data.path={data}", f"eval.sets.fmnist={data}",
                                                   f"run.dir={tmp_path / recipe}", "tracking.enabled=false",
                                                   "data.num_workers=0", *quality.SMOKE, *preset.smoke])
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert quality.curve(tmp_path / recipe, "eval/fmnist/knn_top1")  # judged on the set during training
    assert (tmp_path / recipe / "model.safetensors").exists()
