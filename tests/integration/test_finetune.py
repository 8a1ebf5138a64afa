"""Fine-tuning end to end through the launcher: 2 ranks, ZeRO-3, from a run stopped before export."""

import json
import subprocess

import pytest
from safetensors.torch import load_file

from tests.integration.runs import (
    PYTHON,
    ROOT,
    TINY,
    assert_same_weights,
    env,
    metrics,
    run,
    run_here,
    weights,
)

pytestmark = pytest.mark.dist


def test_finetune_from_an_unexported_run_at_twice_the_resolution_with_zero3(tmp_path, shards):
    pre_dir, ft_dir = tmp_path / "pre", tmp_path / "ft"
    pre = run_here("pretrain.py", "configs/pretrain/demo.yaml",
                   [*TINY, f"data.path={shards}", f"run.dir={pre_dir}", "train.steps=4", "train.ckpt_every=2"])
    assert pre.returncode == 0, pre.stderr[-3000:]
    # launch/export_weights.py consolidates the checkpoint to the very weights the trainer exported.
    exported = weights(pre_dir)
    (pre_dir / "model.safetensors").unlink()  # as if preempted before the export
    out = subprocess.run([PYTHON, "launch/export_weights.py", str(pre_dir), "--out", str(tmp_path / "w.safetensors")],
                         cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert_same_weights(exported, load_file(str(tmp_path / "w.safetensors")))

    ft = run("finetune.py", "configs/finetune/demo.yaml",
             [*TINY, f"data.path={shards}", f"run.dir={ft_dir}", "train.steps=6", "train.warmup_steps=1",
              "train.eval_every=3", "deepspeed.zero_stage=3"], extra=["--from", str(pre_dir), "--res", "32"])
    assert ft.returncode == 0, ft.stdout[-3000:] + ft.stderr[-3000:]
    assert "position embeddings 16 -> 8x8 grid tokens" in ft.stdout
    assert "finetune: vit_ti16 (32, 32) | world size 2" in ft.stdout
    assert (ft_dir / "model.safetensors").is_file()
    record = json.loads((ft_dir / "tracking.json").read_text())
    assert record["tags"]["kind"] == "finetune" and record["tags"]["source_path"] == str(pre_dir.resolve())
    assert any("eval/top1" in m["metrics"] for m in metrics(ft_dir))


def test_bad_res_is_a_clear_error(tmp_path):
    out = run_here("finetune.py", "configs/finetune/demo.yaml", [], extra=["--from", str(tmp_path), "--res", "big"])
    assert out.returncode == 2 and "--res 'big': expected a size like 384 or 384x512" in out.stderr
