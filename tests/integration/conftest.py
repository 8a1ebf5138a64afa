import json
import subprocess

import numpy as np
import pytest
from PIL import Image

from pipeline.data.sources import synthetic_image
from tests.integration.runs import PYTHON, ROOT, make_synthetic_shards, run, supervised


@pytest.fixture(scope="session")
def shards(tmp_path_factory):
    """The synthetic shards most integration tests train on (16 px, 4 classes, 320 samples in shards of 40),
    written once per session. Read-only: a test that changes shards writes its own."""
    return make_synthetic_shards(tmp_path_factory.mktemp("data") / "synthetic")


@pytest.fixture(scope="session")
def supervised_reference(shards, tmp_path_factory):
    """The uninterrupted 2-rank ZeRO-1 run of `runs.supervised` (24 steps), its run directory and output: run
    once, the end that test_pretrain.py's preempted run and test_run_remote.py's restored run both reach."""
    ref_dir = tmp_path_factory.mktemp("supervised") / "ref"
    ref = run("pretrain.py", "configs/pretrain/demo.yaml", supervised(shards, ref_dir, 1))
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    return ref_dir, ref.stdout


def _write_images(root, labels=None):
    """160 images of `shards`' kind (16 px, drawn from class i % 4) written as shards by make_shards from a
    folder: flat (no labels) or under the class folder `labels[i]`."""
    for i in range(160):
        folder = root / "images" / (f"c{labels[i]}" if labels is not None else "")
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(synthetic_image(i, i % 4, 4, (16, 16))).save(folder / f"{i:04d}.png")
    out = root / "shards"
    subprocess.run([PYTHON, str(ROOT / "launch/make_shards.py"), "--source", f"folder:{root / 'images'}", "--out",
                    str(out), "--max-samples-per-shard", "40", "--no-progress"], check=True, cwd=ROOT)
    return out


@pytest.fixture(scope="session")
def label_free(tmp_path_factory):
    """Shards without labels: what a self-supervised run trains on while eval.sets judges it."""
    out = _write_images(tmp_path_factory.mktemp("unlabelled"))
    assert json.loads((out / "dataset.json").read_text())["num_classes"] == 0
    return out


@pytest.fixture(scope="session")
def noisy_labels(tmp_path_factory):
    """The same kind of images under labels drawn at random: a labelled set a k-NN gets partly right, so
    that two runs logging the same eval.sets figures agree on something (on `shards` every k-NN is 100%)."""
    return _write_images(tmp_path_factory.mktemp("noisy"), np.random.default_rng(0).integers(0, 4, 160))
