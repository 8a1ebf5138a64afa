"""The model EMA (train.ema_decay) in real runs on CPU (gloo): supervised at ZeRO-3 on 2 ranks, preempted
and resumed, it ends bit for bit where the uninterrupted run's EMA ends (within fp32 rounding when resumed
on 1 rank), evaluated beside the model and exported in its place; MAE at ZeRO-3 in bf16 keeps one that is,
step after step, timm's ModelEmaV3 of the weights of each step's checkpoint."""

import shutil

import pytest
import torch
from timm.utils.model_ema import ModelEmaV3
from torch import nn

from pipeline.train import checkpoint as ckpt
from tests.integration.runs import (
    TINY,
    WORKERS,
    assert_same_weights,
    metrics,
    run,
    run_and_signal,
    run_here,
    weights,
)

CONFIG = "configs/pretrain/demo.yaml"
EMA = ["train.ema_decay=0.9", "train.ema_warmup=true", "train.ema_warmup_gamma=2.0"]


def base(shards, run_dir, zero, steps, *extra):
    return [*TINY, *EMA, f"data.path={shards}", f"run.dir={run_dir}", f"deepspeed.zero_stage={zero}",
            f"train.steps={steps}", "train.eval_every=0", *extra]


def final_eval(run_dir) -> dict:
    return [m["metrics"] for m in metrics(run_dir) if "eval/samples" in m["metrics"]][-1]


@pytest.mark.dist
@pytest.mark.slow
def test_zero3_ema_resumes_bit_exact_on_2_ranks_and_on_1_within_fp32_rounding(shards, tmp_path):
    fp32 = ["deepspeed.bf16=false", "train.ckpt_every=4"]  # fp32: 2 ranks -> 1 is comparable (docs/training.md)
    ref_dir = tmp_path / "ref"
    ref = run("pretrain.py", CONFIG, base(shards, ref_dir, 3, 12, *fp32))
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    assert "model.safetensors holds the model EMA (train.ema_decay=0.9)" in ref.stdout
    assert "| EMA | loss" in ref.stdout  # the EMA's eval line beside the model's

    run_dir = tmp_path / "preempted"
    code, out = run_and_signal("pretrain.py", CONFIG, base(shards, run_dir, 3, 12, *fp32), when="step 4/12")
    assert code == 75, out[-3000:]
    one_rank = tmp_path / "one_rank"
    shutil.copytree(run_dir, one_rank)
    # Loader workers in the resumed run, none in the reference: the same batches.
    resumed = run("pretrain.py", CONFIG, base(shards, run_dir, 3, 12, *fp32, WORKERS))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout

    # The exported EMA and the raw weights the checkpoints keep: both as the uninterrupted run's, bit for bit.
    assert_same_weights(weights(ref_dir), weights(run_dir))
    raw = ckpt.consolidate(run_dir)
    assert_same_weights(ckpt.consolidate(ref_dir), raw)
    ema = weights(run_dir)
    assert ema.keys() == raw.keys()  # the model's names: fine-tuning reads it as any export
    assert not torch.equal(ema["blocks.0.attn.qkv.weight"], raw["blocks.0.attn.qkv.weight"])  # an average
    final = final_eval(run_dir)
    assert {"eval/top1", "eval/top1_ema", "eval/loss_ema"} <= final.keys()
    assert final["eval/samples_ema"] == final["eval/samples"]

    # On 1 rank: the EMA's full tensors load into the re-partitioned shadow; it ends within fp32 rounding.
    single = run_here("pretrain.py", CONFIG, base(shards, one_rank, 3, 12, *fp32))
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
    assert "layout changed (world size 2 -> 1)" in single.stdout
    assert "holds no model EMA" not in single.stdout
    ema_diff = max_diff(weights(ref_dir), weights(one_rank))
    print(f"ZeRO-3 x2 -> x1: max |diff| to the uninterrupted run: EMA {ema_diff:.3e}, "
          f"raw {max_diff(ckpt.consolidate(ref_dir), ckpt.consolidate(one_rank)):.3e}")
    assert ema_diff < 1e-6


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


class Weights(nn.Module):
    """A state dict as a module (timm's EMA walks `state_dict()`)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        super().__init__()
        for k, v in state.items():
            self.register_parameter(k.replace(".", "__"), nn.Parameter(v.clone(), requires_grad=False))


@pytest.mark.slow
def test_mae_ema_at_zero3_in_bf16_is_timms_of_the_weights_after_each_step(shards, tmp_path):
    run_dir = tmp_path / "mae"
    mae = ["model.objective=mae", "mae.decoder_embed_dim=16", "mae.decoder_depth=1", "mae.decoder_num_heads=2",
           "mae.knn_train_samples=64", "mae.recon_images=2", "train.ckpt_every=1", "train.keep_last=10"]
    out = run_here("pretrain.py", "configs/pretrain/mae_demo.yaml", base(shards, run_dir, 3, 5, *mae))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    final = final_eval(run_dir)
    assert {"eval/recon_loss", "eval/recon_loss_ema", "eval/knn_top1", "eval/knn_top1_ema"} <= final.keys()

    # The forward's weights are bf16, the optimizer's fp32 (what a checkpoint consolidates to) rounded; the
    # trainer's float32 EMA of them is timm's float32 EMA (dtype=torch.float32) of the rounded checkpoints.
    fixed = ("pos_embed", "decoder_pos_embed")  # MAE's sin-cos tables, exported exact (fp32_buffers)
    steps = [{k: v.bfloat16() for k, v in ckpt.consolidate(run_dir, f"step_{s:07d}").items() if k not in fixed}
             for s in range(1, 6)]
    theirs = ModelEmaV3(Weights(steps[0]), decay=0.9, use_warmup=True, warmup_gamma=2.0, dtype=torch.float32,
                        foreach=False)
    for step, state in enumerate(steps, start=1):  # timm's train.py: update(model, step=num_updates)
        theirs.update(Weights(state), step=step)
    exported = weights(run_dir)
    assert set(fixed) <= exported.keys()
    assert_same_weights({k: v for k, v in exported.items() if k not in fixed},
                        {k.replace("__", "."): v for k, v in theirs.module.state_dict().items()})
    assert not torch.equal(exported["blocks.0.attn.qkv.weight"], steps[-1]["blocks.0.attn.qkv.weight"].float())
