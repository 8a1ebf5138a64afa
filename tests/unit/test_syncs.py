"""No host read in a training step: each recipe at ZeRO-1 and ZeRO-3, through the real trainer (benchmarks/
syncs.py, one process over gloo, tiny models in bf16), makes 0 device-to-host reads per non-log step; the
counter sees DeepSpeed's and the trainer's reads where they are still made (train.check_finite=true); and
the read-free optimizer step (pipeline/train/ds_compat.py: read_free_steps) clips exactly as DeepSpeed's and
zeroes a non-finite step's gradients instead of skipping it, counted by the trainer's watch.

All in one subprocess (deepspeed.zero.Init patches torch while ZeRO-3 builds): about 40 s of CPU."""

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys
import torch
from benchmarks.syncs import measure
from benchmarks.engine import init_single_process
from pipeline.config import load_config
from pipeline.derived import deepspeed_config
from pipeline.model.vit import model_kwargs_from_config
from pipeline.objectives.supervised.objective import loss_fn
from pipeline.run.step import NonFiniteWatch, backward_and_step, build_engine, build_model
from pipeline.train import ds_compat

out = {"after": measure(["supervised", "mae", "dinov2", "dinov3"], [1, 3], log=lambda *_: None)["recipes"],
       "check_finite": measure(["supervised"], [1], ["train.check_finite=true"], log=lambda *_: None)["recipes"]}
init_single_process()
TINY = ["model.variant=vit_ti16", "model.img_size=16", "model.patch_size=4", "model.embed_dim=32", "model.depth=2",
        "model.num_heads=2", "model.num_classes=4", "deepspeed.bf16=true", "train.grad_clip=0.05",
        "train.micro_batch_size=4", "train.grad_accum_steps=1", "train.lr=1e-2"]

def trained(stage, check_finite, nan_step):
    cfg = load_config(None, [*TINY, f"deepspeed.zero_stage={stage}", f"train.check_finite={check_finite}"])
    ds = deepspeed_config(cfg, 1)
    kwargs = model_kwargs_from_config(cfg.model)
    engine = build_engine(cfg, build_model(cfg, kwargs, ds), 2, ds)[0]
    watch = NonFiniteWatch(3, engine.device)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, 16, 16, generator=g).bfloat16(), torch.randint(0, 4, (4,), generator=g)
    for i in range(3):
        loss = loss_fn(engine(x).float(), y, 0.0) * (float("nan") if i == nan_step else 1.0)
        backward_and_step(engine, loss)
        watch.after_step(engine, loss.detach())
    params = [ds_compat.full_fp32_param(p) for p in engine.module.parameters()]
    return torch.cat([p.flatten() for p in params]), watch.counts.tolist()

for stage in (1, 3):
    deepspeed_way, _ = trained(stage, True, None)
    read_free, counts = trained(stage, False, None)
    poisoned, nan_counts = trained(stage, False, 1)
    out[f"zero{stage}"] = {"max_diff": (deepspeed_way - read_free).abs().max().item(), "counts": counts,
                           "nan_finite": bool(torch.isfinite(poisoned).all()), "nan_counts": nan_counts,
                           "nan_moved": (poisoned - read_free).abs().max().item()}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def result():
    from tests.integration.runs import ROOT, env, free_port

    one_rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env={**env(), **one_rank}, capture_output=True,
                         text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("recipe", ["supervised", "mae", "dinov2", "dinov3"])
def test_no_device_read_in_a_non_log_step(result, recipe, stage):
    f = result["after"][f"{recipe}.zero{stage}"]
    assert f["device_per_step"] == 0, f["sites"]
    assert f["host_per_step"] >= 2  # the preemption agreement's flags: counted, as host reads
    assert f["log_step_device"] > 0  # a log step reads its window, as it should


@pytest.mark.slow
def test_the_counter_sees_the_reads_train_check_finite_keeps(result):
    """With train.check_finite=true: the trainer's read per micro batch and DeepSpeed's overflow check."""
    f = result["check_finite"]["supervised.zero1"]
    assert f["device_per_step"] >= 4, f
    assert any("all_finite" in s for s in f["sites"]) and any("has_overflow" in s for s in f["sites"]), f["sites"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_read_free_step_clips_as_deepspeed_and_zeroes_a_non_finite_step(result, stage):
    f = result[f"zero{stage}"]
    assert f["max_diff"] == 0.0  # finite steps: DeepSpeed's clipped update, bit for bit
    assert f["counts"] == [0.0, 0.0, 0.0]
    assert f["nan_finite"] and 0 < f["nan_moved"]  # the NaN step taken with zero gradients: weights stay finite
    assert f["nan_counts"] == [1.0, 0.0, 1.0]  # counted once; not in a row at the end; most in a row 1
