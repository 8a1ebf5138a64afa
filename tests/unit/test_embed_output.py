"""What launch/embed.py hands over, in-process: a folder `pandas.read_parquet(OUT)` reads whole (as
docs/evaluation.md writes it), one row per sample, keys unique across splits, each row naming the file
make_shards made the sample from (KEY.src; shards without it read as before, the name null). And the
launchers docs/evaluation.md runs under `deepspeed` take the --local_rank its launcher appends."""

from __future__ import annotations

import importlib.util
import tarfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from pipeline.config import DataConfig
from pipeline.data import tario
from pipeline.data.info import read_dataset_info
from pipeline.data.shards import folder_source, synthetic_source, write_dataset
from pipeline.dist import detect_env
from pipeline.model.vit import VisionTransformer
from pipeline.run.backbone import Backbone
from pipeline.run.embed import MANIFEST, embed

ROOT = Path(__file__).resolve().parents[2]


def photo_folder(root: Path) -> Path:
    """20 images under two class folders, one of them nested: names a user would look for."""
    for i in range(20):
        folder = root / "photos" / ("cats" if i % 2 else "dogs") / ("2024" if i < 4 else "")
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((8, 8, 3), 10 * i, np.uint8)).save(folder / f"IMG_{i:03d}.png")
    return root / "photos"


def backbone() -> Backbone:
    kwargs = dict(img_size=8, patch_size=4, embed_dim=16, depth=1, num_heads=2, num_classes=0)
    return Backbone(VisionTransformer(**kwargs).eval(), kwargs, DataConfig(), Path("tiny.safetensors"), None, None)


def test_pandas_reads_the_folder_whole_with_unique_keys_and_the_source_file_names(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    photos = photo_folder(tmp_path)
    shards = tmp_path / "shards"
    write_dataset(folder_source(str(photos), val_fraction=0.2), shards, max_samples_per_shard=6, progress=False,
                  log=lambda s: None)
    info = read_dataset_info(shards)
    out = tmp_path / "emb"
    counts = embed(backbone(), str(shards), sorted(info.splits), str(out), detect_env({}), "cpu", batch=4,
                   num_workers=0)
    assert counts["written_all"] == 20 and (out / MANIFEST).is_file()

    df = pd.read_parquet(out)  # docs/evaluation.md's call, on the folder as written
    assert len(df) == 20 and df["key"].is_unique
    assert sorted(df["split"].unique()) == ["train", "val"] and set(df["key"].str.split("/").str[0]) == {"train", "val"}
    files = sorted(p.relative_to(photos).as_posix() for p in photos.rglob("*.png"))
    assert sorted(df["source"]) == files and "cats/2024/IMG_001.png" in files
    assert np.stack(df["cls"]).shape == (20, 16)


def test_shards_without_source_names_still_read_and_embed_with_a_null_name(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    shards = tmp_path / "synthetic"
    write_dataset(synthetic_source(size=8, num_samples=12, num_classes=2), shards, progress=False, log=lambda s: None)
    with tarfile.open(read_dataset_info(shards).splits["train"].shards[0]) as tar:
        assert not any(n.endswith(".src") for n in tar.getnames())  # a source of no files: nothing recorded
    assert all(tario.source_name(s) is None for s in tario.iter_raw_samples(read_dataset_info(shards).split("train").shards[0]))
    embed(backbone(), str(shards), ["train", "val"], str(tmp_path / "emb"), detect_env({}), "cpu", num_workers=0)
    df = pd.read_parquet(tmp_path / "emb")
    assert len(df) == 12 and df["key"].is_unique and df["source"].isna().all()


@pytest.mark.parametrize("script", ["embed.py", "evaluate.py"])
def test_the_launchers_docs_run_under_deepspeed_take_its_local_rank(script, tmp_path, capsys):
    """`deepspeed --num_gpus 2 launch/embed.py ...` appends --local_rank=0: argparse must not stop there."""
    spec = importlib.util.spec_from_file_location(f"launch_{script[:-3]}", ROOT / "launch" / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--local_rank=0", "--from", str(tmp_path / "missing"), "--data", str(tmp_path), "--out", str(tmp_path / "o")]
    if script == "evaluate.py":
        argv = argv[:-2]
    code = module.main(argv)
    err = capsys.readouterr().err
    assert code == 1 and "unrecognized arguments" not in err and "missing" in err


def test_evaluate_names_a_set_as_the_run_named_it_in_eval_sets(tmp_path):
    """So that evaluate.py's curves meet the run's own eval/<name>/... in MLflow; else the folder's name."""
    spec = importlib.util.spec_from_file_location("launch_evaluate", ROOT / "launch" / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    run, data = tmp_path / "run", tmp_path / "sets" / "digits-v2"
    run.mkdir()
    data.mkdir(parents=True)
    (run / "config.yaml").write_text(f"eval:\n  sets:\n    other: /elsewhere\n    digits: {data}/\n")
    assert module.parse(["--from", str(run), "--data", str(data)]).name == "digits"  # the run's name for it
    assert module.parse(["--from", str(run), "--data", str(tmp_path)]).name == tmp_path.name  # not one of its sets
    assert module.parse(["--from", str(run), "--data", str(data), "--name", "mine"]).name == "mine"
