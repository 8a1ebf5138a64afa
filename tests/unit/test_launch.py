"""pipeline/launch.py's defaults: `launch/finetune.py --res 384` with no --from and no --config."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml

from pipeline.config import Config, load_config, save_config
from pipeline.launch import check_data, finished_pretrain_runs, parse_args, resolve_finetune_defaults

REPO = Path(__file__).resolve().parents[2]


def make_run(root: Path, name: str, kind: str = "pretrain", finished: bool = True, age_s: float = 0) -> Path:
    cfg = load_config(REPO / "configs/pretrain/demo.yaml", [f"run.kind={kind}", f"run.dir=runs/{name}"])
    run = root / "runs" / name
    run.mkdir(parents=True)
    save_config(cfg, run / "config.yaml")
    if finished:
        (run / "model.safetensors").write_bytes(b"w")
        stamp = time.time() - age_s
        os.utime(run / "model.safetensors", (stamp, stamp))
    return run


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)


def test_newest_finished_pretraining_run_is_the_default_source(tmp_path, capsys):
    make_run(tmp_path, "old", age_s=100)
    make_run(tmp_path, "newest-unfinished", finished=False)
    make_run(tmp_path, "newer-finetune", kind="finetune")
    make_run(tmp_path, "new", age_s=10)
    assert [r.name for r in finished_pretrain_runs()] == ["new", "old"]
    args = parse_args("finetune", ["--res", "64", "--config", "configs/finetune/demo.yaml"])
    assert resolve_finetune_defaults(args) == []  # --config given: only --from is filled in
    assert Path(args.source) == Path("runs/new")
    out = capsys.readouterr().out
    assert "--from runs/new: the newest finished pretraining run" in out and "runs/old" in out


def test_nothing_to_start_from_is_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        resolve_finetune_defaults(parse_args("finetune", ["--res", "384"]))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass --from" in err


def test_without_config_the_paper_recipe_on_the_source_architecture_and_data(tmp_path):
    source = make_run(tmp_path, "demo")
    args = parse_args("finetune", ["--res", "64", "train.steps=7"])
    defaults = resolve_finetune_defaults(args)
    cfg = load_config(None, [*defaults, *args.overrides, "run.kind=finetune", "model.img_size=64"])
    recipe = yaml.safe_load((REPO / "configs/finetune/vit_b16_384.yaml").read_text())["train"]
    src = load_config(source / "config.yaml")
    assert (cfg.model.embed_dim, cfg.model.depth, cfg.model.patch_size) == (96, 4, 4)   # the source's
    assert cfg.data == src.data                                                          # its data set
    assert (cfg.train.optimizer, cfg.train.lr, cfg.train.momentum) == (recipe["optimizer"], recipe["lr"],
                                                                       recipe["momentum"])
    assert cfg.train.steps == 7                                                          # overrides win
    assert cfg.tracking.experiment == src.tracking.experiment
    assert cfg.run.dir == "runs/demo-ft64" and cfg.model.img_size == 64
    assert isinstance(cfg, Config)


def test_missing_shards_name_the_command(capsys):
    with pytest.raises(SystemExit):
        check_data("data/digits", "configs/pretrain/demo.yaml")
    err = capsys.readouterr().err
    assert "python launch/make_shards.py --source digits --out data/digits" in err
