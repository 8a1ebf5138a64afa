"""The DINOv2 objective's parts on one process: the multi-crop view is a function of the seed, the model
says its decay groups, layers and roles (patch embedding lr, prototypes), the prototypes do not move while
frozen (lr 0) and do after, a resume keeps the roles' lr multipliers, the schedules have DINOv2's
end points, the centres move once per step from the teacher outputs, the PCA image, the config checks."""

from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.config import ConfigError
from pipeline.data.multicrop import MultiCropConfig
from pipeline.model.dino import DINOv2Model
from pipeline.model.dino_head import dino_head_flops as _head_flops
from pipeline.model.vit import model_flops
from pipeline.objectives import OBJECTIVES, load_config
from pipeline.objectives.dino.cost import expected_masked_patches
from pipeline.objectives.dino.evaluate import pca_rgb
from pipeline.objectives.dino.objective import DINOv2, dinov2_model_kwargs
from pipeline.objectives.dino.view import MultiCropView
from pipeline.train.optim import apply_hparams, build_optimizer, build_scheduler, param_groups
from tests.integration.runs import assert_teacher_not_collapsed

TINY = ["model.objective=dinov2", "model.variant=vit_ti16", "model.img_size=16", "model.patch_size=4",
        "model.embed_dim=32", "model.depth=2", "model.num_heads=2", "dino.local_crops_number=2",
        "dino.local_crops_size=8", "dino.head_n_prototypes=64", "dino.head_hidden_dim=32",
        "dino.head_bottleneck_dim=16", "train.steps=100", "train.weight_decay=0.04",
        "dino.teacher_temp_warmup_steps=30", "dino.freeze_last_layer_steps=2"]


def objective(*extra: str) -> DINOv2:
    return OBJECTIVES["dinov2"](load_config(None, [*TINY, *extra]), SimpleNamespace(num_classes=0))


def image(seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (20, 24, 3), dtype=np.uint8))


def test_view_is_a_function_of_the_seed_with_crops_and_masks_of_the_configured_shapes():
    view = MultiCropView(MultiCropConfig(global_crops_size=16, local_crops_number=3, local_crops_size=8), (4, 4),
                         mask_probability=1.0, mask_ratio=(0.3, 0.5))
    g, local, masks = view(image(), 123)
    assert g.shape == (2, 3, 16, 16) and local.shape == (3, 3, 8, 8) and masks.shape == (2, 16)
    assert masks.dtype == torch.bool and masks.sum(1).min() >= 1  # probability 1: both crops masked
    again = view(image(), 123)
    assert all(torch.equal(a, b) for a, b in zip((g, local, masks), again))
    other = view(image(), 124)
    assert not torch.equal(g, other[0]) and not torch.equal(masks, other[2])
    none = MultiCropView(MultiCropConfig(global_crops_size=16, local_crops_number=0), (4, 4), 0.0, (0.1, 0.5))
    _, local, masks = none(image(), 1)
    assert local.shape == (0, 3, 98, 98) and not masks.any()


def test_model_decay_groups_layers_patch_embed_lr_and_prototype_groups():
    """Meta's get_params_groups_with_decay: no decay only on biases, norms and LayerScale gammas (the
    position table, class and mask tokens are decayed); layer 0 for the embeddings, i + 1 for block i, the
    heads at scale 1; the patch embedding's lr x dino.patch_embed_lr_mult on top of layer decay; the
    prototypes (last_layer) in groups of their own, for the freeze."""
    obj = objective("train.layer_decay=0.9", "train.lr=1.0")
    model = obj.build_all(obj.model_kwargs())
    groups = param_groups(model, obj.cfg.train, depth=2)
    names = {id(p): n for n, p in model.named_parameters()}
    by_name = {names[id(p)]: g for g in groups for p in g["params"]}
    assert set(by_name) == set(names.values())  # every trainable parameter in exactly one group
    assert sum(len(g["params"]) for g in groups) == len(names)
    decayed = {n for n, g in by_name.items() if g["weight_decay"] > 0}
    assert {"backbone.pos_embed", "backbone.cls_token", "backbone.mask_token", "backbone.patch_embed.proj.weight",
            "dino_head.last_layer.weight_g", "dino_head.last_layer.weight_v"} <= decayed
    assert not any(n.endswith(".bias") or "norm" in n or "gamma" in n for n in decayed)
    assert by_name["backbone.pos_embed"]["layer"] == 0 and by_name["backbone.mask_token"]["layer"] == 0
    assert by_name["backbone.blocks.1.attn.qkv.weight"]["layer"] == 2
    assert by_name["dino_head.last_layer.weight_v"]["layer"] == 3 and by_name["dino_head.last_layer.weight_v"]["decay"]
    # Which names get x0.2 (the patch embedding, nothing else), which are the frozen prototypes.
    x02 = {n for n, g in by_name.items() if g.get("lr_mult") == 0.2}
    assert x02 == {"backbone.patch_embed.proj.weight", "backbone.patch_embed.proj.bias"}
    assert by_name["backbone.patch_embed.proj.weight"]["lr"] == pytest.approx(0.9 ** 3 * 0.2)
    assert by_name["backbone.pos_embed"]["lr"] == pytest.approx(0.9 ** 3)  # same layer, no multiplier
    assert by_name["dino_head.mlp.0.weight"]["lr"] == pytest.approx(1.0)
    last = {n for n, g in by_name.items() if g.get("role") == "last_layer"}
    assert last == {"dino_head.last_layer.weight_g", "dino_head.last_layer.weight_v"}
    assert by_name["dino_head.last_layer.weight_v"]["lr"] == pytest.approx(1.0)  # frozen by the objective, per step
    # The groups do not depend on the multiplier's value (a resume may change it): x1 is still its own group.
    one = objective("train.layer_decay=0.9", "dino.patch_embed_lr_mult=1.0")
    same = param_groups(one.build_all(one.model_kwargs()), one.cfg.train, depth=2)
    assert [g["name"] for g in same] == [g["name"] for g in groups]
    # A separate iBOT head's prototypes are last-layer too.
    sep = objective("dino.ibot_separate_head=true")
    model = sep.build_all(sep.model_kwargs())
    names = {id(p): n for n, p in model.named_parameters()}
    last = {names[id(p)] for g in param_groups(model, sep.cfg.train, depth=2) if g.get("role") == "last_layer"
            for p in g["params"]}
    assert last == {f"{h}.last_layer.weight_{w}" for h in ("dino_head", "ibot_head") for w in "gv"}
    # The teacher starts as the student and is not trained.
    assert all(torch.equal(s, t) for s, t in zip(model.state_dict().values(), sep.teacher.state_dict().values()))
    assert not any(p.requires_grad for p in sep.teacher.parameters())


def _metas_rule(name: str, depth: int, decay_rate: float, patch_embed_mult: float) -> tuple[float, bool, bool]:
    """Meta's dinov2/utils/param_groups.py, written out for one parameter under its name in our student
    (`backbone.`, `dino_head.`, `ibot_head.`): (lr multiplier, decayed, last layer). In the backbone layer 0
    is the embeddings and tokens, block i is layer i + 1, anything else depth + 1; the heads are not
    layer-decayed. No weight decay on biases and on any name with "norm" or "gamma" (LayerScale) in it."""
    layer = depth + 1
    if name.startswith("backbone."):
        if any(k in name for k in ("pos_embed", "patch_embed", "mask_token", "cls_token", "reg_token")):
            layer = 0
        elif ".blocks." in name:
            layer = int(name.split(".blocks.")[1].split(".")[0]) + 1
        lr = decay_rate ** (depth + 1 - layer)
    else:
        lr = 1.0
    if "patch_embed" in name:
        lr *= patch_embed_mult
    decayed = not (name.endswith(".bias") or "norm" in name or "gamma" in name)
    return lr, decayed, "last_layer" in name


@pytest.mark.parametrize("extra", [[], ["model.reg_tokens=4", "model.init_values=1e-5", "model.mlp_layer=swiglu",
                                        "dino.ibot_separate_head=true"]], ids=["plain", "registers-swiglu"])
def test_param_groups_are_metas_rule_written_out(extra):
    """The always-run twin of test_dino_official.py's comparison with Meta's function (which needs its
    checkout): every student parameter's lr multiplier, weight decay and last-layer flag by the rule,
    registers, LayerScale and SwiGLU included."""
    obj = objective("model.depth=3", "train.layer_decay=0.9", "train.lr=1.0", *extra)
    model = obj.build_all(obj.model_kwargs())
    names = [n for n, _ in model.named_parameters()]
    if extra:  # the parts this case is for are there: registers, LayerScale, SwiGLU (gate and value packed
        # in fc1), the separate iBOT head
        params = dict(model.named_parameters())
        assert {"backbone.reg_token", "backbone.blocks.0.ls1.gamma", "ibot_head.last_layer.weight_v"} <= set(names)
        assert params["backbone.blocks.2.mlp.fc1.weight"].shape[0] == 2 * params["backbone.blocks.2.mlp.fc2.weight"].shape[1]
    groups = {n: g for g in param_groups(model, obj.cfg.train, depth=3) for p in g["params"]
              for n, q in model.named_parameters() if q is p}
    assert sorted(groups) == sorted(names)
    for name in names:
        lr, decayed, last = _metas_rule(name, 3, 0.9, obj.cfg.dino.patch_embed_lr_mult)
        g = groups[name]
        assert g["lr_scale"] == pytest.approx(lr), name
        assert (g["weight_decay"] > 0) == decayed, name
        assert (g.get("role") == "last_layer") == last, name


def test_prototypes_do_not_move_while_frozen_and_do_after():
    """dino.freeze_last_layer_steps=2: the prototypes' groups run at lr 0 for steps 0 and 1 (AdamW with
    weight decay 0.04: neither the update nor the decay moves them), although their gradients are
    computed; from step 2 they move. The rest moves from step 0. The trainer's order: before_step, loss,
    backward, optimizer step, schedule step, after_step."""
    obj = objective("dino.mask_probability=1.0", "train.lr=1e-2", "train.warmup_steps=0")
    model = obj.build_all(obj.model_kwargs())
    opt = build_optimizer(param_groups(model, obj.cfg.train, depth=2), obj.cfg.train)
    sched = build_scheduler(opt, obj.cfg.train)
    engine = FakeEngine(model, opt.param_groups)
    view = obj.train_view(obj.model_kwargs()).sample
    batch = tuple(torch.stack(part) for part in zip(*[view(image(i), i) for i in range(4)]))
    last = model.dino_head.last_layer
    for step in range(4):
        before = [last.weight_g.detach().clone(), last.weight_v.detach().clone()]
        trunk = model.backbone.blocks[0].attn.qkv.weight.detach().clone()
        obj.before_step(engine, step)
        obj.loss(engine, batch, torch.zeros(4), None).backward()
        assert last.weight_v.grad.abs().sum() > 0  # computed, as Meta's
        lrs = {g.get("role", ""): g["lr"] for g in opt.param_groups}
        assert (lrs["last_layer"] == 0.0) == (step < 2) and lrs[""] > 0
        opt.step()
        sched.step()
        opt.zero_grad()
        obj.after_step(engine, step + 1)
        moved = not (torch.equal(before[0], last.weight_g) and torch.equal(before[1], last.weight_v))
        assert moved == (step >= 2), step
        assert not torch.equal(trunk, model.backbone.blocks[0].attn.qkv.weight)


def test_resume_reapplies_the_patch_embed_multiplier_after_a_universal_load():
    """`apply_hparams` re-derives each group's lr from the model's roles, also when DeepSpeed's universal
    load has copied group 0's values (its role, its lr_mult) into every group, and follows a multiplier
    changed on resume."""
    old = objective("train.layer_decay=0.9", "train.lr=1e-3", "train.warmup_steps=2")
    model = old.build_all(old.model_kwargs())
    opt = build_optimizer(param_groups(model, old.cfg.train, depth=2), old.cfg.train)
    sched = build_scheduler(opt, old.cfg.train)
    for _ in range(3):
        opt.step()
        sched.step()
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()
    new = objective("train.layer_decay=0.9", "train.lr=1e-3", "train.warmup_steps=2", "dino.patch_embed_lr_mult=0.5")
    model2 = new.build_all(new.model_kwargs())
    built = param_groups(model2, new.cfg.train, depth=2)
    opt2 = build_optimizer(built, new.cfg.train)
    sched2 = build_scheduler(opt2, new.cfg.train)
    opt2.load_state_dict(saved_opt)
    sched2.load_state_dict(saved_sched)
    assert opt2.param_groups[0].get("role") == "patch_embed"  # group 0 sorts first: (no decay, layer 0, patch_embed)
    for g in opt2.param_groups:  # as DeepSpeed's ZeRO-3 universal load leaves them
        g.update({k: v for k, v in opt2.param_groups[0].items() if k != "params"})
    apply_hparams(opt2.param_groups, built, sched2, new.cfg.train, depth=2)
    fresh = build_optimizer(param_groups(model2, new.cfg.train, depth=2), new.cfg.train)
    fresh_sched = build_scheduler(fresh, new.cfg.train)
    for _ in range(3):
        fresh_sched.step()
    for g, f in zip(opt2.param_groups, fresh.param_groups, strict=True):
        assert g["lr"] == pytest.approx(f["lr"]) and g.get("role") == f.get("role"), f["name"]
        assert g.get("lr_mult") == f.get("lr_mult") and g["weight_decay"] == f["weight_decay"]
    patch = [g for g in opt2.param_groups if g.get("role") == "patch_embed"]
    assert patch and all(g["lr_scale"] == pytest.approx(0.9 ** 3 * 0.5) for g in patch)


def test_schedules_have_dinov2_end_points():
    obj = objective()
    assert obj.teacher_temp(0) == pytest.approx(0.04) and obj.teacher_temp(15) == pytest.approx(0.055)
    assert obj.teacher_temp(30) == obj.teacher_temp(99) == pytest.approx(0.07)
    assert obj.momentum(0) == pytest.approx(0.992) and obj.momentum(50) == pytest.approx(0.996)
    assert obj.momentum(100) == pytest.approx(1.0)
    assert obj.weight_decay(0) == pytest.approx(0.04) and obj.weight_decay(100) == pytest.approx(0.4)


class FakeEngine(torch.nn.Module):
    """What `loss`/`after_step` use of a DeepSpeed engine: module, device, optimizer groups, forward."""

    def __init__(self, module, groups):
        super().__init__()
        self.module, self.device = module, torch.device("cpu")
        self.optimizer = SimpleNamespace(param_groups=groups)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_a_step_applies_the_schedules_and_moves_centres_and_teacher_once():
    obj = objective("dino.mask_probability=1.0")
    model = obj.build_all(obj.model_kwargs())
    groups = [{"decay": True, "weight_decay": 0.04}, {"decay": False, "weight_decay": 0.0},
              {"decay": True, "weight_decay": 0.04, "role": "last_layer", "lr": 0.5}]
    engine = FakeEngine(model, groups)
    view = obj.train_view(obj.model_kwargs()).sample
    samples = [view(image(i), i) for i in range(4)]
    batch = tuple(torch.stack(part) for part in zip(*samples))
    obj.step = 60
    obj.before_step(engine, 60)
    loss = obj.loss(engine, batch, torch.zeros(4), None)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert groups[0]["weight_decay"] == pytest.approx(obj.weight_decay(60)) and groups[1]["weight_decay"] == 0.0
    assert groups[2]["lr"] == 0.5  # past dino.freeze_last_layer_steps: the schedule's lr, left alone
    assert obj.dino_loss.center.abs().sum() == 0  # the centre moves at the step's end, not per micro batch
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)
    before = obj.teacher.backbone.cls_token.clone()
    obj.after_step(engine, 61)
    assert obj.step == 61 and obj.dino_loss.center.abs().sum() > 0 and obj.ibot_loss.center.abs().sum() > 0
    m = obj.momentum(60)
    expected = m * before + (1 - m) * model.backbone.cls_token.detach()
    assert torch.allclose(obj.teacher.backbone.cls_token, expected, atol=1e-7)
    # Its state round-trips into a fresh objective.
    state = obj.state_dict()
    fresh = objective("dino.mask_probability=1.0")
    fresh.build_all(fresh.model_kwargs())
    fresh.load_state_dict(state)
    assert fresh.step == 61 and torch.equal(fresh.dino_loss.center, obj.dino_loss.center)
    assert torch.equal(fresh.teacher.backbone.cls_token, obj.teacher.backbone.cls_token)
    with pytest.raises(ValueError, match="not written by a model.objective=dinov2 run"):
        fresh.load_state_dict({})


@pytest.mark.slow  # two objectives built and stepped per centring: about 8 s
@pytest.mark.parametrize("centering", ["centering", "sinkhorn_knopp"])
def test_ibot_on_a_fixed_size_gather_is_the_loss_of_the_masked_patches_and_reads_nothing(centering, monkeypatch):
    """The masked patches gathered at mask_bound rows (masked.py: no host read) give the loss, and after the
    step the centres, that `patch_tokens[masks]` gave (the gather of the data's size, a read in forward and
    backward), within 1e-6; and that gather is the only read the loss made."""
    from pipeline.objectives.dino import objective as dino_objective
    from pipeline.train.host_reads import HostReads

    def step(gather: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
        obj = objective("dino.mask_probability=1.0", f"dino.centering={centering}", "dino.koleo_loss_weight=0")
        torch.manual_seed(0)
        model = obj.build_all(obj.model_kwargs())
        engine = FakeEngine(model, [{"decay": True, "weight_decay": 0.04}])
        view = obj.train_view(obj.model_kwargs()).sample
        batch = tuple(torch.stack(part) for part in zip(*[view(image(i), i) for i in range(4)]))
        if not gather:  # the data-sized gather: no indices, no padding
            monkeypatch.setattr(dino_objective, "masked_rows", lambda masks, bound: (None, None))
        obj.before_step(engine, 5)
        with HostReads() as reads:
            loss = obj.loss(engine, batch, torch.zeros(4), None)
            loss.backward()
            obj.after_step(engine, 6)
        monkeypatch.undo()
        return loss.detach(), obj.ibot_loss.center, reads.device

    fixed, centre, reads = step(gather=True)
    data_sized, data_centre, data_reads = step(gather=False)
    assert abs(fixed.item() - data_sized.item()) < 1e-6
    assert (centre.abs().sum() > 0) == (centering == "centering")  # Sinkhorn-Knopp moves no centre
    torch.testing.assert_close(centre, data_centre, atol=1e-6, rtol=0)
    assert reads == 0 and data_reads > 0  # the data-sized gathers read (and the counter sees them)


def test_mask_bound_holds_every_mask_block_mask_draws():
    """The fixed gather's size is a bound, not a guess: no image's mask exceeds int(N x mask_ratio[1])."""
    from pipeline.data.multicrop import block_mask
    from pipeline.objectives.dino.masked import mask_bound, masked_rows

    masks = torch.stack([block_mask(seed, (6, 6), 1.0, (0.1, 0.5)).flatten() for seed in range(300)])
    assert masks.sum(-1).max() <= int(36 * 0.5) and masks.sum(-1).max() >= 14  # reached near the bound
    bound = mask_bound(masks, 1.0, (0.1, 0.5))
    assert bound == 300 * 18 and mask_bound(masks, 0.0, (0.1, 0.5)) == 1
    rows, valid = masked_rows(masks, bound)
    assert rows.shape == valid.shape == (bound,) and int(valid.sum()) == int(masks.sum())
    assert torch.equal(rows[valid], masks.flatten().nonzero().flatten())  # row-major, as patch_tokens[masks]


def entropy(targets: torch.Tensor) -> float:
    """Mean over rows of -sum p log p (0 log 0 = 0), in float64."""
    p = targets.double()
    return float(-(p * torch.where(p > 0, p.log(), 0.0)).sum(-1).mean())


def teacher_outputs(obj: DINOv2, replace: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The teacher's class-token outputs (after its DINO head) of each micro batch, as the loss gets them;
    with `replace`, the loss gets replace(output) instead."""
    seen: list[torch.Tensor] = []
    real = obj.teacher.teacher_forward

    def forward(crops: torch.Tensor, masks: torch.Tensor | None, mask_indices: torch.Tensor | None = None):
        cls, masked = real(crops, masks, mask_indices)
        cls = replace(cls) if replace is not None else cls
        seen.append(cls.detach().float().clone())
        return cls, masked

    obj.teacher.teacher_forward = forward
    return seen


def test_teacher_entropy_is_its_formula_on_known_targets_and_a_collapse_fails_the_runs_check():
    """Teacher outputs chosen so that the targets are known distributions p (output = temperature x log p,
    the centre 0 at the start): the logged entropy is -sum p log p averaged over the rows. Targets that all
    put their mass on one prototype, or uniform ones, fail the check the end-to-end run makes
    (tests/integration/test_dino.py); varied ones pass it."""
    obj = objective("dino.mask_probability=1.0")
    model = obj.build_all(obj.model_kwargs())
    engine = FakeEngine(model, [{"decay": True, "weight_decay": 0.04}])
    view = obj.train_view(obj.model_kwargs()).sample
    batch = tuple(torch.stack(part) for part in zip(*[view(image(i), i) for i in range(4)]))
    rows, k = 8, 64  # 2 global crops x 4 images, dino.head_n_prototypes
    torch.manual_seed(0)
    cases = {"varied": torch.distributions.Dirichlet(torch.full((k,), 0.1)).sample((rows,)).clamp_min(1e-12),
             "one_prototype": torch.full((rows, k), 1e-9).index_fill_(1, torch.tensor([7]), 1.0),
             "uniform": torch.full((rows, k), 1.0 / k)}
    targets: list[torch.Tensor] = []
    teacher_outputs(obj, lambda out: (obj.teacher_temp(obj.step) * targets[-1].log()).to(out.dtype))
    for case, p in cases.items():
        targets.append(p / p.sum(-1, keepdim=True))
        assert torch.equal(obj.dino_loss.center, torch.zeros_like(obj.dino_loss.center))  # no step taken
        obj.before_step(engine, obj.step)  # the trainer's order: before_step, then loss
        obj.loss(engine, batch, torch.zeros(4), None)
        logged = obj.train_metrics()["dino_teacher_entropy"].item()
        assert logged == pytest.approx(entropy(targets[-1]), rel=1e-4, abs=1e-6), case
        if case == "varied":
            assert_teacher_not_collapsed(logged, k)
        else:
            with pytest.raises(AssertionError, match="collapsed"):
                assert_teacher_not_collapsed(logged, k)


def test_train_metrics_are_each_terms_mean_over_the_window_and_the_teachers_entropy():
    obj = objective("dino.mask_probability=1.0", "dino.dino_loss_weight=0.5", "dino.ibot_loss_weight=2.0")
    model = obj.build_all(obj.model_kwargs())
    engine = FakeEngine(model, [{"decay": True, "weight_decay": 0.04}])
    view = obj.train_view(obj.model_kwargs()).sample
    batches = [tuple(torch.stack(part) for part in zip(*[view(image(i), i) for i in range(j, j + 4)]))
               for j in (0, 4)]
    seen = teacher_outputs(obj)
    assert obj.train_metrics() == {}
    totals = [obj.loss(engine, b, torch.zeros(4), None) for b in batches]
    m = obj.train_metrics()
    assert set(m) == {"dino_local_crops_loss", "dino_global_crops_loss", "koleo_loss", "ibot_loss",
                      "dino_teacher_entropy"}
    # The terms, weighted, sum to the window's mean of each micro batch's loss.
    terms = sum(v for k, v in m.items() if k != "dino_teacher_entropy")
    assert torch.allclose(terms, sum(totals) / 2, rtol=1e-5)
    # The entropy is the mean over micro batches and crops of -sum t log t of the teacher's DINO targets
    # t = softmax((teacher output - centre) / teacher temperature), here recomputed from the teacher's
    # outputs the loss used.
    want = np.mean([entropy(torch.softmax((t - obj.dino_loss.center) / obj.teacher_temp(obj.step), -1))
                    for t in seen])
    assert len(seen) == 2 and m["dino_teacher_entropy"].item() == pytest.approx(want, rel=1e-5)
    assert obj.train_metrics() == {}  # forgotten once read
    # A micro batch whose loss is not finite (the trainer skips it) is not counted.
    model.backbone.cls_token.data.fill_(float("nan"))
    assert not torch.isfinite(obj.loss(engine, batches[0], torch.zeros(4), None))
    model.backbone.cls_token.data.zero_()
    total = obj.loss(engine, batches[1], torch.zeros(4), None)
    m = obj.train_metrics()
    assert torch.allclose(sum(v for k, v in m.items() if k != "dino_teacher_entropy"), total, rtol=1e-5)


def test_flops_count_student_crops_and_a_third_of_the_teacher():
    obj = objective()
    kwargs = obj.model_kwargs()
    backbone = 2 * model_flops(kwargs) + 2 * model_flops(kwargs, 8)
    assert backbone < obj.flops_per_image(kwargs) < 2 * backbone
    # iBOT's head on the expected masked patches (2 crops x p 0.5 x 16 patches x mean ratio 0.3), the
    # student's and a third of the teacher's; nothing without iBOT.
    assert expected_masked_patches(obj.d, kwargs) == pytest.approx(4.8)
    no_ibot = objective("dino.ibot_loss_weight=0")
    assert expected_masked_patches(no_ibot.d, kwargs) == 0
    head = _head_flops(kwargs, 32, 64)
    assert obj.flops_per_image(kwargs) - no_ibot.flops_per_image(kwargs) == pytest.approx(4.8 * head * 4 / 3)


def test_pca_rgb_is_three_channels_in_unit_range():
    rgb = pca_rgb(torch.randn(3, 16, 8), (4, 4))
    assert rgb.shape == (3, 3, 4, 4) and rgb.min() >= 0 and rgb.max() <= 1
    assert torch.isclose(rgb.amax(dim=(0, 2, 3)), torch.ones(3)).all()  # each component spans [0, 1]


@pytest.mark.parametrize("override, key", [
    ("dino.local_crops_size=10", "local_crops_size"),
    ("model.img_size=[16, 20]", "square"),
])
def test_crop_sizes_that_do_not_tile_the_patches_are_refused(override, key):
    cfg = load_config(None, [*TINY, override])
    with pytest.raises(ConfigError, match=key):
        dinov2_model_kwargs(cfg)


def test_mixup_with_dinov2_is_refused():
    with pytest.raises(ConfigError, match="data.mixup"):
        load_config(None, [*TINY, "data.mixup=0.8"])


def test_a_checkpointed_model_builds_from_its_recorded_kwargs():
    kwargs = objective().model_kwargs()
    model = DINOv2Model(**kwargs)
    assert model.backbone.mask_token is not None and model.backbone.dynamic_img_size and model.ibot_head is None


def test_photometric_probabilities_reach_the_crops_and_are_checked():
    off = ["dino.color_jitter_p=0", "dino.greyscale_p=0", "dino.blur_p=[0, 0, 0]", "dino.solarize_p=0"]
    obj = objective(*off)
    view = obj.train_view(obj.model_kwargs()).sample
    crops = view.multicrop.cfg
    assert (crops.color_jitter_p, crops.greyscale_p, crops.blur_p, crops.solarize_p) == (0, 0, (0, 0, 0), 0)
    default = objective().train_view(obj.model_kwargs()).sample.multicrop.cfg
    assert (default.color_jitter_p, default.greyscale_p, default.blur_p, default.solarize_p) == (0.8, 0.2, (0.0, 0.9, 0.5), 0.2)
    # A flat grey image: with every photometric step off each crop is that grey, normalised; with colour
    # jitter always on, the brightness and contrast factors change it.
    flat = Image.new("RGB", (20, 24), (100, 100, 100))
    g, local, _ = view(flat, 7)
    mean, std = torch.tensor(obj.cfg.data.mean).view(3, 1, 1), torch.tensor(obj.cfg.data.std).view(3, 1, 1)
    grey = (torch.full((3, 1, 1), 100 / 255) - mean) / std
    assert torch.allclose(g, grey.expand_as(g), atol=1e-6)
    assert torch.allclose(local, grey.expand_as(local), atol=1e-6)
    jittered = objective("dino.color_jitter_p=1").train_view(obj.model_kwargs()).sample(flat, 7)[0]
    assert not torch.allclose(jittered, g, atol=1e-3)
    with pytest.raises(ConfigError, match="dino.blur_p"):
        load_config(None, [*TINY, "dino.blur_p=[0, 1.5, 0]"])
    with pytest.raises(ConfigError, match="dino.color_jitter_p"):
        load_config(None, [*TINY, "dino.color_jitter_p=-0.1"])
