"""Head-based distillation (`distill.targets: heads`, pipeline/objectives/distill/head_loss.py), in process: the loss
equals, term by term, DINOv3's distillation as written here from its definitions (Sinkhorn-Knopp, the DINO
cross-entropy over crop pairs with Meta's scales, KoLeo, iBOT per image), and Meta's code when
DINOV3_OFFICIAL_REPO is set; a tiny DINOv2 run of ours (a checkpoint holding its EMA teacher whole) teaches a ViT
student through its heads: the step's loss is that formula on the two models' own outputs, a few steps lower
it, the teacher (heads included) ends bit for bit as read, the export is the student's backbone alone, and a
run stopped and resumed (the student's heads in its state) ends where the uninterrupted one does."""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from pipeline.config import ConfigError, save_config
from pipeline.data import dataset_info_of
from pipeline.model.dino import masked_rows
from pipeline.model.vit import VisionTransformer
from pipeline.objectives import build_objective, load_config
from pipeline.objectives.distill.head_loss import HeadLoss
from tests.integration.runs import run
from tests.unit.recipe_runs import SHRINK, _Engine, demo_config, foreign_file, labelled_set, randomise
from tests.unit.test_dino_official import one_rank_group
from tests.unit.test_distill import DEMO

REPO = os.environ.get("DINOV3_OFFICIAL_REPO")
official_only = pytest.mark.skipif(
    not REPO or not (Path(REPO) / "dinov3" / "loss" / "dino_clstoken_loss.py").is_file(),
    reason="set DINOV3_OFFICIAL_REPO to a checkout of facebookresearch/dinov3")


# ----------------------------------------------------------------------------- DINOv3's definitions, written out

def sinkhorn(logits: torch.Tensor, temp: float, iterations: int = 3) -> torch.Tensor:
    """SwAV's assignment as DINOv3 computes it: Q = exp(logits / temp)^T (K x B) summing to 1, then rows to 1/K
    and columns to 1/B in turn; each sample's column x B (sums to 1)."""
    q = torch.exp(logits.double() / temp).t()
    k, b = q.shape
    q = q / q.sum()
    for _ in range(iterations):
        q = q / q.sum(1, keepdim=True) / k
        q = q / q.sum(0, keepdim=True) / b
    return (q * b).t()


def cross_entropy(student: torch.Tensor, target: torch.Tensor, temp: float = 0.1) -> torch.Tensor:
    """Per row: -sum_k target(k) log softmax(student / temp)(k)."""
    return -(target * F.log_softmax(student.double() / temp, dim=-1)).sum(-1)


def koleo(x: torch.Tensor) -> torch.Tensor:
    """-mean_i log ||x_i - x_j(i)|| over the L2-normalised rows, j(i) the nearest other row."""
    x = F.normalize(x.double(), dim=-1)
    d = torch.cdist(x, x)
    d.fill_diagonal_(math.inf)
    return -torch.log(d.min(1).values + 1e-8).mean()


def reference_terms(s_global, s_local, s_cls, s_patch, t_global, t_patch, masks, w, ignore_diagonal, temp=0.07):
    """DINOv3's distillation loss (multidist_meta_arch.py's teacher outputs, ssl_meta_arch.py's compute_losses) of
    crop-major (2B, ...) global outputs, (nB, K) local ones, dense (2B, N, K) patch-head outputs of which `masks`
    (2B, N) says the scored positions; `w` the weights (dino, ibot, koleo)."""
    b = t_global.shape[0] // 2
    tq = sinkhorn(t_global, temp).view(2, b, -1)  # both global crops' class tokens normalised together
    sg, n = s_global.view(2, b, -1), s_local.shape[0] // b
    sl = s_local.view(n, b, -1)
    g_pairs = [(s, t) for s in range(2) for t in range(2) if not (ignore_diagonal and s == t)]
    pairs = len(g_pairs) + 2 * n
    terms = {"dino_global_crops_loss": w[0] * sum(cross_entropy(sg[s], tq[t]).mean() for s, t in g_pairs) / pairs,
             "dino_local_crops_loss": w[0] * sum(cross_entropy(sl[s], tq[t]).mean() for s in range(n)
                                                 for t in range(2)) / pairs,
             "koleo_loss": w[2] * (koleo(s_cls[:b]) + koleo(s_cls[b:]))}
    tp = torch.zeros(*masks.shape, t_patch.shape[-1], dtype=torch.float64)
    tp[masks] = sinkhorn(t_patch[masks], temp)  # over the masked positions of every crop
    per_crop = [cross_entropy(s_patch[i][masks[i]], tp[i][masks[i]]).mean() if masks[i].any() else torch.tensor(0.0)
                for i in range(masks.shape[0])]
    terms["ibot_loss"] = w[1] * torch.stack(per_crop).double().mean()
    return terms


def problem(b=3, n_local=2, n=6, k=16, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    masks = torch.rand(2 * b, n, generator=g) < 0.4
    masks[0] = False  # an unmasked crop counts 0 in iBOT's mean, as Meta's
    masks[1, :2] = True
    # The teacher's logits of the size a head gives (exp(logit / 0.07) stays finite in float32, as in training).
    return r(2 * b, k) * 2, r(n_local * b, k) * 2, r(2 * b, d), r(2 * b, n, k) * 2, r(2 * b, k) * 0.5, r(2 * b, n, k) * 0.5, masks


def ours(s_global, s_local, s_cls, s_patch, t_global, t_patch, masks, w, ignore_diagonal):
    loss = HeadLoss(t_global.shape[1], t_patch.shape[-1], *w, teacher_temp=0.07, ignore_diagonal=ignore_diagonal)
    indices, valid = masked_rows(masks, masks.numel() // 2)  # a gather padded past the masked rows
    rows = lambda x: x.flatten(0, 1).index_select(0, indices)  # noqa: E731
    t_cls, t_masked = loss.teacher_targets(t_global, rows(t_patch), masks, valid)
    student = {"global": s_global, "local": s_local, "global_cls": s_cls, "masked": rows(s_patch)}
    return loss(student, t_cls, t_masked, masks, indices, valid)


@pytest.mark.parametrize("ignore_diagonal", [True, False])
def test_the_head_loss_is_dinov3s_distillation_term_by_term(ignore_diagonal):
    inputs, w = problem(), (1.0, 0.7, 0.1)
    mine = ours(*inputs, w, ignore_diagonal)
    want = reference_terms(*inputs, w, ignore_diagonal)
    assert set(mine) == set(want)
    for name in want:
        torch.testing.assert_close(mine[name].double(), want[name], atol=1e-5, rtol=1e-5, msg=name)
    # A weight of 0 drops its term; the terms sum to what the objective adds.
    assert set(ours(*inputs, (1.0, 0.0, 0.0), ignore_diagonal)) == {"dino_global_crops_loss", "dino_local_crops_loss"}


@pytest.fixture(scope="module")
def official():
    sys.path.insert(0, REPO)
    try:
        import dinov3.loss

        yield dinov3.loss
    finally:
        sys.path.remove(REPO)
        for name in [n for n in sys.modules if n == "dinov3" or n.startswith("dinov3.")]:
            del sys.modules[name]


@official_only
@pytest.mark.parametrize("ignore_diagonal", [True, False])
def test_the_head_loss_is_metas_compute_losses(official, ignore_diagonal):
    """Meta's DINOLoss (its Sinkhorn-Knopp and its crop-pair cross-entropy), iBOTPatchLoss's Sinkhorn-Knopp and
    forward_masked, KoLeoLoss, scaled as ssl_meta_arch.compute_losses scales them."""
    s_global, s_local, s_cls, s_patch, t_global, t_patch, masks = problem()
    w, b, n = (1.0, 0.7, 0.1), 3, 2
    mine = ours(s_global, s_local, s_cls, s_patch, t_global, t_patch, masks, w, ignore_diagonal)
    dino, ibot = official.DINOLoss(16), official.iBOTPatchLoss(16)
    t_cls = dino.sinkhorn_knopp_teacher(t_global, teacher_temp=0.07).unflatten(0, (2, b))
    with one_rank_group():  # Meta's iBOT Sinkhorn-Knopp all-reduces without asking
        t_masked = official.ibot_patch_loss.SinkhornKnoppTeacher()(t_patch[masks], 0.07, masks.sum())
    g_terms = 2 if ignore_diagonal else 4
    scale_g, scale_l = g_terms / (g_terms + 2 * n), 2 * n / (g_terms + 2 * n)
    theirs = {
        "dino_global_crops_loss": w[0] * scale_g * dino(s_global.unflatten(0, (2, b)), t_cls, ignore_diagonal=ignore_diagonal),
        "dino_local_crops_loss": w[0] * scale_l * dino(s_local.unflatten(0, (n, b)), t_cls),
        "koleo_loss": w[2] * 2 * sum(official.KoLeoLoss()(x) for x in s_cls.unflatten(0, (2, b))) / 2,
        "ibot_loss": w[1] * ibot.forward_masked(s_patch[masks], t_masked, masks, n_masked_patches=int(masks.sum())),
    }
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name].float(), atol=1e-5, rtol=1e-5, msg=name)


# ----------------------------------------------------------------------------- from a DINOv2 run of ours

def headed_run(recipe: str, run_dir: Path, data: Path):
    """A run directory of `recipe` with a complete checkpoint as the trainer leaves one for this purpose: its
    config.yaml and, in DeepSpeed's model-states file, the objective's state holding the EMA teacher whole
    (random weights). Returns the teacher."""
    small = ["dino.local_crops_number=2", "dino.head_n_prototypes=128", "dino.head_hidden_dim=64",
             "dino.head_bottleneck_dim=32"]  # tiny heads, two local crops: a step in a second on a busy CPU
    cfg = load_config(demo_config(recipe), [*SHRINK, f"data.path={data}", f"run.dir={run_dir}", *small])
    obj = build_objective(cfg, dataset_info_of(cfg.data))
    torch.manual_seed(0)
    obj.build_all(obj.model_kwargs())
    randomise(obj.teacher)
    tag = run_dir / "checkpoints" / "step_0000002"
    tag.mkdir(parents=True)
    save_config(cfg, run_dir / "config.yaml")
    torch.save({"objective": {"teacher": obj.teacher.state_dict()}}, tag / "mp_rank_00_model_states.pt")
    files = {"mp_rank_00_model_states.pt": (tag / "mp_rank_00_model_states.pt").stat().st_size}
    (tag / "complete.json").write_text(json.dumps({"tag": tag.name, "files": files}))
    return obj.teacher.eval()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return labelled_set(tmp_path_factory.mktemp("set") / "labelled")


@pytest.fixture(scope="module")
def dino_run(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("teacher")
    return root / "dino-run", headed_run("dinov2", root / "dino-run", data)


def distiller(data: Path, teacher: Path, *extra: str):
    cfg = load_config(DEMO, [*SHRINK, f"data.path={data}", f"distill.teacher={teacher}", "distill.targets=auto",
                             "model.embed_dim=32",
                             "model.num_heads=2", *extra])
    obj = build_objective(cfg, dataset_info_of(cfg.data))
    kwargs = obj.model_kwargs()
    torch.manual_seed(0)
    return obj, obj.build_all(kwargs), kwargs


def batch(obj, size: int = 4, seed: int = 0):
    """A micro batch of the objective's own view (the teacher run's multi-crop and masks) of random images."""
    rng = np.random.default_rng(seed)
    samples = [obj.view(Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)), seed * 100 + i)
               for i in range(size)]
    return [torch.stack(parts) for parts in zip(*samples)]


def steps(obj, model, batches: list, state: tuple | None = None, keep_after: int | None = None):
    """AdamW steps of the objective's loss, as the trainer takes them, from `state` (what a checkpoint holds: the
    model, the student's heads in it, AdamW's state and the objective's) when given; the losses, the engine and
    the state after `keep_after` steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if state is not None:
        model.load_state_dict(state[0])
        opt.load_state_dict(state[1])
        obj.load_state_dict(state[2])
    engine, losses, kept = _Engine(model), [], None
    engine.device = torch.device("cpu")
    for i, images in enumerate(batches):
        obj.before_step(engine, i)
        loss = obj.loss(engine, images, torch.zeros(len(images[0])), None)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if i + 1 == keep_after:
            kept = ({k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(opt.state_dict()),
                    obj.state_dict())
    return losses, engine, kept


def test_a_dinov2_run_teaches_through_its_heads_and_resumes(data, dino_run):
    path, teacher = dino_run
    obj, model, kwargs = distiller(data, path)  # distill.targets auto: this teacher has heads
    assert obj.heads and obj.teacher.heads
    t = teacher.dino_head
    assert model.dino_head.last_layer.weight_v.shape[0] == t.last_layer.weight_v.shape[0]  # sized as the teacher's
    assert model.dino_head.mlp[0].in_features == 32  # from the student's width
    images = batch(obj, size=2)
    # The step's loss is the formula on the two models' own outputs (crop-major, masks at the same positions).
    g, loc, masks = (x.transpose(0, 1).flatten(0, 1) for x in images)
    with torch.no_grad():
        tok = teacher.backbone.forward_tokens(g)
        sk = model.backbone.forward_tokens(g)
        want = reference_terms(model.dino_head(sk.cls_token), model.dino_head(model.backbone.forward_tokens(loc).cls_token),
                               sk.cls_token, model.ibot_head(sk.patch_tokens), teacher.dino_head(tok.cls_token),
                               teacher.patch_head(tok.patch_tokens), masks, (1.0, 1.0, 0.1), True)
    assert masks.any()
    before = {k: v.clone() for k, v in obj.teacher.module.state_dict().items()}
    assert any(k.startswith("dino_head.") for k in before)  # the teacher's heads are the run's
    for k, v in teacher.state_dict().items():
        assert torch.equal(before[k], v), k
    losses, engine, at_1 = steps(obj, model, [images] * 3, keep_after=1)
    torch.testing.assert_close(torch.tensor(losses[0]), sum(want.values()).float(), atol=1e-5, rtol=1e-5)
    assert losses[-1] < losses[0], losses
    assert obj.teacher_forwards == 3
    assert set(obj.train_metrics()) == set(want)
    after = obj.teacher.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # frozen: bit for bit, heads included
    assert not any(p.requires_grad for p in obj.teacher.module.parameters())
    # The export is the student's backbone alone (no heads), in the ViT's names.
    state = obj.exported_weights(engine)
    vit = VisionTransformer(**{k: v for k, v in kwargs.items() if k not in ("teacher_dim", "heads")})
    assert set(state) == set(vit.state_dict())
    assert obj.flops_per_image(kwargs) > 0
    # Stopped after step 1 and resumed in a new objective and model: where the uninterrupted run ended, bit for bit.
    assert any(k.startswith("ibot_head.") for k in at_1[0])  # the student's heads are in its state (the checkpoint)
    whole = model.state_dict()
    again, fresh, _ = distiller(data, path)
    steps(again, fresh, [images] * 2, state=at_1)
    for k, v in fresh.state_dict().items():
        torch.testing.assert_close(v, whole[k], atol=0, rtol=0, msg=k)


def test_heads_of_a_teacher_without_them_and_unaligned_grids_are_one_line(data, dino_run, tmp_path):
    meta = foreign_file("meta_dinov2", tmp_path / "meta")
    with pytest.raises(ConfigError, match=r"distill.targets=heads: distill.teacher=.*not a run directory") as e:
        distiller(data, meta.path, "distill.targets=heads", "model.img_size=28")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"model.patch_size: a 4x4 token grid .* teacher's patches 8x8"):
        distiller(data, dino_run[0], "model.patch_size=8")
    obj, model, _ = distiller(data, dino_run[0], "distill.targets=features")  # asked: the features, as any teacher
    assert not obj.heads and isinstance(model.cls_proj, torch.nn.Linear)


@pytest.mark.slow  # two 1-rank DeepSpeed runs, each a process of its own (one engine per process: 34369a5)
def test_a_head_distillation_trains_exports_and_resumes_under_deepspeed(data, dino_run, tmp_path):
    """The trainer's run (one process, ZeRO-1): the loader's multi-crop view, the student's heads in each checkpoint
    and not in the export (the backbone, as read back by the reader of every command), no teacher weights saved;
    a run stopped at step 2 of 3 and resumed ends bit for bit where the uninterrupted one ended."""
    from pipeline.objectives import config_files
    from pipeline.objectives.backbone import load_backbone
    from pipeline.train import checkpoint as ckpt

    run_dir = tmp_path / "run"
    args = ["--config", DEMO, *SHRINK, f"data.path={data}", f"distill.teacher={dino_run[0]}", "distill.targets=auto",
            "model.embed_dim=32", "model.num_heads=2", "distill.knn_k=0", f"run.dir={run_dir}", "train.steps=3",
            "train.global_batch_size=4", "train.micro_batch_size=2", "train.ckpt_every=1", "train.keep_last=3",
            "train.eval_every=100", "train.log_every=1", "train.warmup_steps=0"]
    threads = {"OMP_NUM_THREADS": "1"}  # both runs alike (their sums' order)
    done = run("pretrain.py", DEMO, args[2:], ranks=1, extra_env=threads)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    whole = ckpt.consolidate(run_dir, ckpt.tag_for(3))
    assert any(k.startswith("dino_head.") for k in whole) and any(k.startswith("ibot_head.") for k in whole)
    assert "teacher" not in ckpt.read_client_state(run_dir, ckpt.tag_for(3))["objective"]  # its digest alone
    exported = load_backbone(run_dir, config_files()).model.state_dict()
    assert set(exported) == {k[len("backbone."):] for k in whole if k.startswith("backbone.")}
    for k, v in exported.items():
        assert torch.equal(v, whole[f"backbone.{k}"]), k
    logged = (run_dir / "metrics.jsonl").read_text()
    assert "train/ibot_loss" in logged and "train/koleo_loss" in logged
    # MLflow's model_variant tag names what is trained, as the start line does: the student, not model.variant alone
    tags = json.loads((run_dir / "tracking.json").read_text())["tags"]
    assert tags["model_variant"] == "vit_ti16 (student)" and "pretrain: vit_ti16 (student)" in done.stdout, tags
    # The run as it was stopped after step 2 (a copy without its step 3), resumed: where the uninterrupted one ended.
    stopped = tmp_path / "stopped"
    shutil.copytree(run_dir, stopped, ignore=shutil.ignore_patterns("lock", ckpt.tag_for(3), "model.safetensors"))
    done = run("pretrain.py", DEMO, [*args[2:], f"run.dir={stopped}"], ranks=1, extra_env=threads)
    assert done.returncode == 0 and "steps 2->3" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    resumed = ckpt.consolidate(stopped, ckpt.tag_for(3))
    for k, v in whole.items():
        torch.testing.assert_close(resumed[k], v, atol=0, rtol=0, msg=k)
