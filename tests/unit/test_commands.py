"""pipeline/commands.py's defaults: `launch/finetune.py --res 384` with no --from and no --config."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml

from pipeline.commands import check_data, finetune_config, finished_pretrain_runs, parse_finetune_args
from pipeline.config import Config, save_config
from pipeline.objectives import load_config

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
    (tmp_path / "configs" / "finetune").mkdir(parents=True)
    (tmp_path / "configs" / "finetune" / "demo.yaml").write_text((REPO / "configs/finetune/demo.yaml").read_text())
    args = parse_finetune_args(["--res", "64", "--config", "configs/finetune/demo.yaml"])
    cfg, where = finetune_config(args)  # --config given: only --from is filled in
    assert Path(args.source) == Path("runs/new") and cfg.finetune.source == "runs/new"
    assert where == "configs/finetune/demo.yaml" and cfg.train == load_config(REPO / "configs/finetune/demo.yaml").train
    assert cfg.run.kind == "finetune" and cfg.model.img_size == 64
    out = capsys.readouterr().out
    assert "--from runs/new: the newest finished pretraining run" in out and "runs/old" in out


def test_nothing_to_start_from_is_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        finetune_config(parse_finetune_args(["--res", "384"]))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass --from" in err


def test_without_config_the_paper_recipe_on_the_source_architecture_and_data(tmp_path):
    source = make_run(tmp_path, "demo")
    args = parse_finetune_args(["--res", "64", "train.steps=7"])
    cfg, _ = finetune_config(args)  # built as data: the recipe's train section on the source's config
    recipe = yaml.safe_load((REPO / "configs/finetune/vit_b16_384.yaml").read_text())["train"]
    src = load_config(source / "config.yaml")
    assert (cfg.model.embed_dim, cfg.model.depth, cfg.model.patch_size) == (96, 4, 4)   # the source's
    assert cfg.data == src.data                                                          # its data set
    assert (cfg.train.optimizer, cfg.train.lr, cfg.train.momentum) == (recipe["optimizer"], recipe["lr"],
                                                                       recipe["momentum"])
    assert cfg.train.steps == 7                                                          # overrides win
    assert cfg.tracking.experiment == src.tracking.experiment
    assert cfg.run.dir == "runs/demo-ft64" and cfg.model.img_size == 64
    assert (cfg.run.kind, Path(cfg.finetune.source)) == ("finetune", Path("runs/demo"))
    assert isinstance(cfg, Config)


def test_a_wrong_override_on_the_recipe_is_one_line(tmp_path, capsys):
    make_run(tmp_path, "demo")
    with pytest.raises(SystemExit) as stop:
        finetune_config(parse_finetune_args(["--res", "64", "train.lrr=1"]))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown key 'train.lrr'" in err


def test_a_restart_keeps_the_source_recorded_at_the_first_start(tmp_path, capsys):
    first = make_run(tmp_path, "first", age_s=100)
    ft_dir = tmp_path / "runs" / "ft"
    ft_dir.mkdir()
    cfg = load_config(REPO / "configs/finetune/demo.yaml", ["run.kind=finetune", f"finetune.source={first}",
                                                             "run.dir=runs/ft"])
    save_config(cfg, ft_dir / "config.yaml")
    (ft_dir / "checkpoints" / "step_0000010").mkdir(parents=True)  # it trained: a complete checkpoint
    (ft_dir / "checkpoints" / "step_0000010" / "complete.json").write_text('{"files": {}}')
    make_run(tmp_path, "newer")  # finished since: it must not become the restarted run's source
    args = parse_finetune_args(["--res", "64", "run.dir=runs/ft"])
    cfg, where = finetune_config(args)
    assert cfg.finetune.source == str(first) and where == "runs/ft/config.yaml"
    assert "recorded in runs/ft/config.yaml" in capsys.readouterr().out


def test_a_torn_tag_binds_no_source(tmp_path):
    """recorded_finetune_source asks what resume asks (checkpoint.newest_complete_tag), not whether a
    complete.json exists: a tag whose complete.json lists a missing file trained nothing to continue."""
    from pipeline.commands import recorded_finetune_source

    ft_dir = tmp_path / "runs" / "ft"
    ft_dir.mkdir(parents=True)
    save_config(load_config(REPO / "configs/finetune/demo.yaml", ["run.kind=finetune", "finetune.source=/a.pth"]),
                ft_dir / "config.yaml")
    tag = ft_dir / "checkpoints" / "step_0000010"
    tag.mkdir(parents=True)
    (tag / "complete.json").write_text('{"files": {"mp_rank_00_model_states.pt": 10}}')  # the file is gone
    assert recorded_finetune_source(ft_dir) is None
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"0123456789")
    assert recorded_finetune_source(ft_dir) == "/a.pth"


def test_missing_shards_name_the_command(capsys):
    with pytest.raises(SystemExit):
        check_data("data/digits", "configs/pretrain/demo.yaml")
    err = capsys.readouterr().err
    assert "python launch/make_shards.py --source digits --out data/digits" in err


def test_a_fine_tune_of_a_run_on_label_free_data_asks_for_labelled_data_in_one_line(tmp_path, capsys):
    """The recipe takes the source's data.path; a self-supervised run's is often label-free: one line that
    asks for data.path (not a suggestion to pretrain on it), before anything starts; given, it is said."""
    source = make_run(tmp_path, "dino")
    pile = tmp_path / "pile"
    pile.mkdir()
    (pile / "dataset.json").write_text('{"num_classes": 0, "splits": {}}')
    cfg = load_config(source / "config.yaml", [f"data.path={pile}", "eval.sets.digits=data/digits"])
    save_config(cfg, source / "config.yaml")
    with pytest.raises(SystemExit) as stop:
        finetune_config(parse_finetune_args(["--res", "64"]))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"data.path={pile} (taken from runs/dino/config.yaml) has no labels" in err
    assert "pass data.path=LABELLED_SHARDS" in err and "pretrain" not in err
    cfg, _ = finetune_config(parse_finetune_args(["--res", "64", "data.path=data/labelled"]))
    assert cfg.data.path == "data/labelled" and cfg.eval.sets == {"digits": "data/digits"}
    said = capsys.readouterr().out
    assert "data.path (yours), its eval.sets (digits; eval.sets={} leaves them out)" in said


def test_a_warm_up_as_long_as_the_run_and_a_batch_of_most_of_the_set_are_warnings():
    from pipeline.run.step import schedule_warnings

    cfg = load_config(REPO / "configs/finetune/vit_b16_384.yaml", ["train.steps=10"])  # its 500-step warm-up
    warm, batch = schedule_warnings(cfg, train_samples=160, global_batch=512)
    assert warm.startswith("warning: train.warmup_steps=500 >= train.steps=10: the learning rate rises")
    assert batch.startswith("warning: train.global_batch_size=512 against 160 training samples")
    assert "train.global_batch_size=16" in batch  # a power of two of at most an eighth of the set
    assert schedule_warnings(load_config(REPO / "configs/finetune/vit_b16_384.yaml"), 1_000_000, 512) == []
