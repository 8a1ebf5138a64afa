"""Parameter groups at every ZeRO stage, the logged lr, and hyperparameters re-applied on resume."""

import os
import subprocess
import sys

import pytest
import torch

from pipeline.model.vit import VisionTransformer, model_kwargs_from_config
from pipeline.objectives import load_config
from pipeline.train.optim import apply_hparams, build_optimizer, build_scheduler, param_groups, peak_group_lr

TINY = ["model.variant=vit_ti16", "model.img_size=16", "model.patch_size=4", "model.embed_dim=32", "model.depth=2",
        "model.num_heads=2", "model.num_classes=4", "deepspeed.bf16=false", "train.weight_decay=0.5"]

# Builds the model as the trainer does (ZeRO-3: inside deepspeed.zero.Init, which needs a process group)
# and prints the names of the decayed parameters. One subprocess per stage: zero.Init patches torch.
DECAYED = """
import json, sys
from pipeline.objectives import load_config
from pipeline.derived import deepspeed_config
from pipeline.model.vit import model_kwargs_from_config
from pipeline.train.optim import no_weight_decay
from pipeline.dist import init_distributed
from pipeline.run.trainer import build_model
init_distributed()  # one rank over gloo, from the environment the test sets
cfg = load_config(None, sys.argv[3:] + ["deepspeed.zero_stage=" + sys.argv[1]])
kwargs = model_kwargs_from_config(cfg.model, 4)
model = build_model(cfg, kwargs, deepspeed_config(cfg, 1))
partitioned = any(hasattr(p, "ds_shape") for p in model.parameters())
print(json.dumps({"partitioned": partitioned,
                  "decayed": sorted(n for n, p in model.named_parameters() if not no_weight_decay(model, n, p))}))
"""


@pytest.mark.slow  # a DeepSpeed process per ZeRO stage: 15 s
def test_decayed_set_is_the_same_at_every_zero_stage():
    from tests.integration.runs import ROOT, env, free_port

    results = {}
    for stage in (0, 1, 2, 3):
        one_rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT)}
        out = subprocess.run([sys.executable, "-c", DECAYED, str(stage), "-", *TINY], cwd=ROOT,
                             env={**env(), **one_rank}, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        results[stage] = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert results[3]["partitioned"]  # ZeRO-3 really built 1-D placeholders
    decayed = set(results[0]["decayed"])
    assert {"blocks.0.attn.qkv.weight", "blocks.1.mlp.fc2.weight", "head.weight", "patch_embed.proj.weight"} <= decayed
    assert not any(n.endswith((".bias", "pos_embed", "cls_token")) or "norm" in n for n in decayed)
    for stage in (1, 2, 3):
        assert set(results[stage]["decayed"]) == decayed, f"ZeRO-{stage}"


def model_and_cfg(*overrides):
    cfg = load_config(None, [*TINY, *overrides])
    torch.manual_seed(0)
    return VisionTransformer(**model_kwargs_from_config(cfg.model)), cfg


def test_logged_lr_is_the_peak_group_under_layer_decay():
    model, cfg = model_and_cfg("train.layer_decay=0.5", "train.lr=1e-3", "train.warmup_steps=0",
                               "train.schedule=constant")
    groups = param_groups(model, cfg.train, depth=2)
    opt = build_optimizer(groups, cfg.train)
    build_scheduler(opt, cfg.train)
    assert min(g["lr"] for g in opt.param_groups) == pytest.approx(1e-3 * 0.5 ** 3)  # the embeddings' group
    assert peak_group_lr(opt.param_groups) == pytest.approx(1e-3)


def test_resumed_optimizer_follows_the_config_not_the_checkpoint():
    model, old = model_and_cfg("train.layer_decay=0.5", "train.lr=1e-3", "train.steps=10", "train.warmup_steps=2")
    opt = build_optimizer(param_groups(model, old.train, depth=2), old.train)
    sched = build_scheduler(opt, old.train)
    for _ in range(4):
        opt.step()
        sched.step()
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()

    # A restart with new values: the checkpoint's state_dicts bring the old ones back...
    _, new = model_and_cfg("train.layer_decay=0.8", "train.lr=2e-3", "train.steps=10", "train.warmup_steps=2",
                           "train.weight_decay=0.1")
    built = param_groups(model, new.train, depth=2)
    opt2 = build_optimizer(built, new.train)
    sched2 = build_scheduler(opt2, new.train)
    opt2.load_state_dict(saved_opt)
    sched2.load_state_dict(saved_sched)
    assert peak_group_lr(opt2.param_groups) == pytest.approx(peak_group_lr(opt.param_groups))
    # ...and apply_hparams makes the config win, at the same point of the schedule.
    for g in opt2.param_groups:  # as DeepSpeed's ZeRO-3 universal load leaves them: group 0's keys everywhere
        g.update({k: v for k, v in opt2.param_groups[0].items() if k != "params"})
    apply_hparams(opt2.param_groups, built, sched2, new.train, depth=2)
    fresh = build_optimizer(param_groups(model, new.train, depth=2), new.train)
    fresh_sched = build_scheduler(fresh, new.train)
    for _ in range(4):
        fresh_sched.step()
    assert [g["lr"] for g in opt2.param_groups] == pytest.approx([g["lr"] for g in fresh.param_groups])
    assert [g["weight_decay"] for g in opt2.param_groups] == [g["weight_decay"] for g in fresh.param_groups]
    sched2.step()
    fresh_sched.step()
    assert [g["lr"] for g in opt2.param_groups] == pytest.approx([g["lr"] for g in fresh.param_groups])


@pytest.mark.slow  # DeepSpeed's CPU Adam loaded: 3 s
def test_offload_optimizer_is_deepspeeds_cpu_adam_with_the_same_groups():
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        pytest.skip("TORCH_EXTENSIONS_DIR unset")
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    model, cfg = model_and_cfg()
    groups = param_groups(model, cfg.train, depth=2)
    opt = build_optimizer(groups, cfg.train, offload=True)
    assert isinstance(opt, DeepSpeedCPUAdam)
    assert [g["weight_decay"] for g in opt.param_groups] == [g["weight_decay"] for g in groups]


def decayed_names(model: torch.nn.Module, cfg) -> set[str]:
    """The names of the parameters that `param_groups` puts in a group with weight decay."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)] for g in param_groups(model, cfg.train, depth=2) if g["weight_decay"] > 0 for p in g["params"]}


def test_supervised_decay_set_is_timms_and_deits():
    """No decay on the position embedding and the class token, nor on biases and norm weights."""
    model, cfg = model_and_cfg()
    block = {f"blocks.{i}.{w}.weight" for i in range(2) for w in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}
    assert decayed_names(model, cfg) == block | {"patch_embed.proj.weight", "head.weight"}


def test_mae_decay_set_is_official_maes():
    """Official MAE pretraining (main_pretrain.py: timm's add_weight_decay, no skip list) exempts only 1-D
    parameters and biases: the class token and the mask token are decayed; the sin-cos tables are fixed."""
    from pipeline.model.mae import MaskedAutoencoderViT

    cfg = load_config(None, TINY)
    model = MaskedAutoencoderViT(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2,
                                 decoder_embed_dim=16, decoder_depth=2, decoder_num_heads=2)
    linears = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
    block = {f"{where}.{i}.{w}.weight" for where in ("blocks", "decoder_blocks") for i in range(2) for w in linears}
    assert decayed_names(model, cfg) == block | {"patch_embed.proj.weight", "cls_token", "mask_token",
                                                 "decoder_embed.weight", "decoder_pred.weight"}
    assert "pos_embed" not in dict(model.named_parameters())  # a buffer: never trained nor decayed


def test_resume_refuses_an_optimizer_state_of_other_decay_groups_in_one_line(tmp_path):
    """A tag written before models named their own exemptions (no record: the ViT's rule applied to every
    model) resumes a ViT, and is refused for MAE, whose class token is now decayed, naming the file."""
    from pipeline.model.mae import MaskedAutoencoderViT
    from pipeline.run.resume import ResumePlan, TrainError, check_same_decay_groups
    from pipeline.train import checkpoint as ckpt

    def plan(no_weight_decay):
        state = ckpt.TrainerState(step=20, world_size=1, model={}, config={}, no_weight_decay=no_weight_decay)
        return ResumePlan("step_0000020", state, tmp_path / "checkpoints", universal=False, fallbacks=[])

    vit, _ = model_and_cfg()
    check_same_decay_groups(plan(None), vit)
    check_same_decay_groups(plan(["cls_token", "pos_embed"]), vit)
    mae = MaskedAutoencoderViT(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2,
                               decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2)
    check_same_decay_groups(plan([]), mae)
    with pytest.raises(TrainError, match=r"checkpoints/step_0000020/trainer_state.json: .*no weight decay on "
                                         r"cls_token.*this model exempts nothing"):
        check_same_decay_groups(plan(None), mae)
