"""A fine-tune of a DINOv3 run as a user types it: `launch/finetune.py --from RUN --res 32`, no --config (the
paper's recipe on the run's config). Its final evaluation forced to fail, the last step's checkpoint is on
disk; started again, the run evaluates that step (the run's eval.sets, taken from the source and said so),
exports and ends 0."""

import subprocess

import pytest
import torch

from pipeline.config import save_config
from pipeline.model.dinov3 import build_backbone
from pipeline.model.variants import model_kwargs_from_config
from pipeline.model.weights import save_weights
from pipeline.objectives import load_config
from pipeline.train import checkpoint as ckpt
from tests.integration.runs import PYTHON, ROOT, env, metrics, run_here

pytestmark = pytest.mark.slow


def dinov3_run(run_dir, data, eval_set):
    """A finished DINOv3 run directory as the trainer leaves it (config.yaml, the teacher backbone exported):
    label-free pretraining data, one labelled set in eval.sets."""
    run_dir.mkdir()
    cfg = load_config(ROOT / "configs/pretrain/dinov3_demo.yaml",
                      ["model.img_size=16", "model.embed_dim=32", "model.depth=2", "model.num_heads=2",
                       f"data.path={data}", f"eval.sets.synth={eval_set}", f"run.dir={run_dir}"])
    save_config(cfg, run_dir / "config.yaml")
    torch.manual_seed(0)
    save_weights(build_backbone(model_kwargs_from_config(cfg.model, num_classes=0)).state_dict(),
                 run_dir / "model.safetensors")


def finetune(source, overrides, fault=None):
    argv = [PYTHON, *(["tests/integration/inject.py"] if fault else []), "launch/finetune.py", "--from", str(source),
            "--res", "32", *overrides]
    return subprocess.run(argv, cwd=ROOT, env={**env(), "FAULT": fault or "", "FAULT_RANK": "0"},
                          capture_output=True, text=True, timeout=600)


def test_a_dinov3_fine_tune_saves_before_its_final_evaluation_and_judges_the_runs_sets(tmp_path, label_free, shards):
    source, ft_dir = tmp_path / "dinov3", tmp_path / "ft"
    dinov3_run(source, label_free, shards)
    # The recipe's train section (its 500-step warm-up kept: a warning) at a size that runs in seconds.
    overrides = [f"data.path={shards}", f"run.dir={ft_dir}", "data.num_workers=0", "train.steps=3",
                 "train.global_batch_size=16", "train.micro_batch_size=8", "train.eval_every=0",
                 "train.log_every=1"]
    failed = finetune(source, overrides, fault="fail-final-eval")
    assert failed.returncode == 1, failed.stdout[-3000:] + failed.stderr[-3000:]
    assert "inject: rank 0's final evaluation (step 3) failed" in failed.stderr
    assert ckpt.newest_complete_tag(ft_dir) == "step_0000003"  # nothing trained is lost
    assert not (ft_dir / "model.safetensors").exists()
    out = failed.stdout
    assert f"its data.path={shards} (yours)" not in out and "data.path (yours)" in out
    assert "its eval.sets (synth; eval.sets={} leaves them out)" in out
    assert "warning: train.warmup_steps=500 >= train.steps=3" in out

    # The restart: the recorded source and config (in this process: the failure above was the wrapper's process).
    again = run_here("finetune.py", None, [f"run.dir={ft_dir}"], extra=["--from", str(source), "--res", "32"])
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    judged = [m for m in metrics(ft_dir) if "eval/synth/knn_top1" in m["metrics"]]
    assert [m["step"] for m in judged] == [3] and "eval/top1" in judged[0]["metrics"]
    assert (ft_dir / "model.safetensors").is_file()
