"""Feature distillation (pipeline/objectives/distill/), in process: the loss equals its formula; the teacher read
from Meta's DINOv2 layout, timm's DINOv3 file and a DINOv2 run of ours gives, in the loss, the file's own
features; a few optimizer steps move the student toward the teacher and leave the teacher bit for bit as read;
the export is the student's backbone; a resume against another teacher is refused in one line. The run under
DeepSpeed (preempted, resumed on another layout): tests/integration/test_distill.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.config import ConfigError
from pipeline.data import dataset_info_of
from pipeline.model.vit import VisionTransformer
from pipeline.model.weights import WeightsError
from pipeline.objectives import build_objective, load_config
from pipeline.objectives.distill.loss import FeatureLoss, token_loss
from tests.unit.recipe_runs import SHRINK, _Engine, foreign_file, labelled_set, tiny_run

DEMO = "configs/pretrain/distill_demo.yaml"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return labelled_set(tmp_path_factory.mktemp("set") / "labelled")


@pytest.fixture(scope="module")
def teachers(tmp_path_factory, data):
    """kind -> (the source, its reference features: embedding rows of the model that wrote it, the student's side)."""
    root = tmp_path_factory.mktemp("teachers")
    meta = foreign_file("meta_dinov2", root / "meta")  # patch 14, 2x2 grid at 28 px
    timm_v3 = foreign_file("timm_dinov3", root / "timm")  # patch 16, RoPE
    ours = tiny_run("dinov2", root / "dino-run", data)  # the teacher backbone of a DINOv2 run of ours
    return {"meta_dinov2": (meta.path, meta.reference, 28), "timm_dinov3": (timm_v3.path, timm_v3.reference, 32),
            "dino_run": (ours.path, ours.reference, 32)}


def objective(data: Path, teacher: Path, side: int, *extra: str):
    cfg = load_config(DEMO, [*SHRINK, f"data.path={data}", f"distill.teacher={teacher}", f"model.img_size={side}",
                             "model.embed_dim=32", "model.num_heads=2", *extra])
    obj = build_objective(cfg, dataset_info_of(cfg.data))
    kwargs = obj.model_kwargs()
    torch.manual_seed(0)
    return obj, obj.build_all(kwargs), kwargs


def distil_steps(obj, model, batches: list[torch.Tensor], opt=None, **adamw) -> tuple[list[float], _Engine]:
    """One AdamW step per batch (the objective's before_step, its loss, backward), as the trainer steps it;
    the losses and the engine stand-in (what extra_exports and exported_weights take). `opt`: by default
    AdamW(**adamw) over every parameter."""
    engine = _Engine(model)
    engine.device = torch.device("cpu")
    opt = opt or torch.optim.AdamW(model.parameters(), **adamw)
    losses = []
    for step, images in enumerate(batches):
        obj.before_step(engine, step)
        loss = obj.loss(engine, images, torch.zeros(len(images)), None)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, engine


def test_the_loss_is_its_formula_term_by_term():
    torch.manual_seed(0)
    s_cls, t_cls, s_p, t_p = torch.randn(3, 5), torch.randn(3, 5), torch.randn(3, 4, 5), torch.randn(3, 4, 5)
    cos = lambda a, b: (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))  # noqa: E731
    terms = FeatureLoss("cosine", 0.5, 2.0)(s_cls, s_p, t_cls, t_p)
    assert torch.allclose(terms["cls_loss"], 0.5 * (1 - cos(s_cls, t_cls)).mean())
    assert torch.allclose(terms["patch_loss"], 2.0 * (1 - cos(s_p, t_p)).mean())
    d = (s_p - t_p).abs()
    huber = torch.where(d < 1, 0.5 * d ** 2, d - 0.5).sum(-1).mean()
    assert torch.allclose(token_loss(s_p, t_p, "smooth_l1"), huber)
    assert set(FeatureLoss("cosine", 0.0, 1.0)(s_cls, s_p, t_cls, t_p)) == {"patch_loss"}
    assert token_loss(t_p, t_p * 3, "cosine").abs() < 1e-6  # scale-free


@pytest.mark.parametrize("kind", ["meta_dinov2", "timm_dinov3", "dino_run"])
def test_the_teachers_outputs_in_the_loss_are_its_files_own_features(data, teachers, kind):
    path, reference, side = teachers[kind]
    obj, _, _ = objective(data, path, side)
    images = torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(1))
    t = obj.teacher
    grid = (side // t.patch, side // t.patch)
    cls, patches = t.tokens(images, grid, "bicubic", None)  # on its own grid: nothing resized
    want = reference(images)
    torch.testing.assert_close(cls, want[:, :t.dim], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(patches.mean(1), want[:, t.dim:], atol=1e-5, rtol=1e-5)
    # On the student's grid (patch 4): the teacher's map resized, its mean kept near the map's (bicubic).
    _, resized = t.tokens(images, (side // 4, side // 4), "bilinear", None)
    assert resized.shape == (2, (side // 4) ** 2, t.dim)


def test_a_few_steps_teach_the_student_and_leave_the_teacher_as_read(data, teachers):
    path, _, side = teachers["meta_dinov2"]
    obj, model, kwargs = objective(data, path, side, "distill.loss=smooth_l1")
    before = {k: v.clone() for k, v in obj.teacher.module.state_dict().items()}
    images = torch.randn(4, 3, side, side, generator=torch.Generator().manual_seed(2))
    losses, engine = distil_steps(obj, model, [images] * 12, lr=1e-2)
    assert losses[-1] < 0.7 * losses[0], losses
    assert obj.teacher_forwards == 12  # one teacher forward per micro batch
    assert set(obj.train_metrics()) == {"cls_loss", "patch_loss"}
    after = obj.teacher.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # frozen: bit for bit
    assert not any(p.requires_grad for p in obj.teacher.module.parameters())
    # The export is the student's backbone, in the ViT's names, no projection.
    state = obj.exported_weights(engine)
    vit = VisionTransformer(**{k: v for k, v in kwargs.items() if k != "teacher_dim"})
    assert set(state) == set(vit.state_dict())
    vit.load_state_dict(state)
    with obj.features(engine) as features:
        torch.testing.assert_close(features(images), torch.cat(
            [vit.eval().forward_features(images)[:, 0], vit.forward_features(images)[:, 1:].mean(1)], 1))


def test_a_resume_against_another_teacher_is_refused_in_one_line(data, teachers):
    obj, _, _ = objective(data, *teachers["meta_dinov2"][::2])
    state = obj.state_dict()
    obj.load_state_dict(state)  # the same teacher
    obj.load_state_dict({})  # a checkpoint with no state of its own
    other, _, _ = objective(data, teachers["timm_dinov3"][0], 32)
    with pytest.raises(WeightsError, match="another teacher") as e:
        other.load_state_dict(state)
    assert "\n" not in str(e.value) and "distill.teacher=" in str(e.value)


def test_bad_teachers_and_configs_are_one_line_naming_the_key(data, teachers, tmp_path):
    with pytest.raises(ConfigError, match="distill.teacher"):
        load_config(DEMO, [*SHRINK, f"data.path={data}", "distill.teacher=null"])
    with pytest.raises(ConfigError, match="distill.patch_weight"):
        load_config(DEMO, [*SHRINK, "distill.cls_weight=0", "distill.patch_weight=0"])
    with pytest.raises(ValueError, match=r"distill.teacher.*no such run directory"):
        objective(data, tmp_path / "missing.pth", 28)
    with pytest.raises(WeightsError, match=r"patch 14 does not divide model.img_size=\[32, 32\]"):
        objective(data, teachers["meta_dinov2"][0], 32)


def test_the_flops_count_the_teachers_forward_as_a_third(data, teachers):
    obj, _, kwargs = objective(data, *teachers["meta_dinov2"][::2])
    from pipeline.model.variants import model_flops

    student = {k: v for k, v in kwargs.items() if k != "teacher_dim"}
    teacher = model_flops(obj.teacher.flops_kwargs)
    projections = 2 * 2 * (1 + 7 * 7) * 32 * 128  # two Linear(32, 128) on the 1 + 7x7 tokens at 28 px
    assert obj.flops_per_image(kwargs) == pytest.approx(model_flops(student) + projections + teacher / 3)
    assert teacher > 0


CNN = 'distill.students=[{name: cnn, timm: test_resnet, kwargs: {output_stride: 8}}]'  # timm's tiny ResNet


@pytest.mark.parametrize("kind", ["meta_dinov2", "timm_dinov3", "dino_run"])
def test_a_timm_cnn_student_learns_the_teachers_features_and_exports_in_timms_names(data, teachers, kind, tmp_path,
                                                                                   capsys, monkeypatch):
    import timm

    from pipeline.model.timm_backbone import TimmBackbone
    from pipeline.model.weights import load_weights, save_weights
    from pipeline.run.backbone import load_backbone
    from tests.unit.recipe_runs import Source
    from tests.unit.test_recipe_matrix import embed, evaluate

    path, reference, side = teachers[kind]
    obj, model, kwargs = objective(data, path, side, CNN)
    assert isinstance(model.backbone, TimmBackbone) and obj.grids == {"cnn": (4, 4)}  # stride 8 at 28 and 32 px
    before = {k: v.clone() for k, v in obj.teacher.module.state_dict().items()}
    seen = []  # the teacher's outputs as the loss gets them
    native = obj.teacher.native
    monkeypatch.setattr(obj.teacher, "native", lambda *a: seen.append(native(*a)) or seen[-1])
    images = torch.randn(4, 3, side, side, generator=torch.Generator().manual_seed(2))
    losses, engine = distil_steps(obj, model, [images] * 6, lr=1e-3)
    assert losses[-1] < 0.7 * losses[0], losses
    assert obj.teacher_forwards == 6 and len(seen) == 6
    t = obj.teacher
    torch.testing.assert_close(seen[0][0], reference(images)[:, :t.dim], atol=1e-5, rtol=1e-5)  # the file's own
    torch.testing.assert_close(seen[0][1].mean(1), reference(images)[:, t.dim:], atol=1e-5, rtol=1e-5)
    assert seen[0][2] == (side // t.patch,) * 2  # its own grid, resized in the loss to the student's 4x4 map
    after = obj.teacher.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # frozen: bit for bit
    # The export: timm's names, loadable by timm.create_model; read back as a backbone by the commands.
    [(rel, (state, metadata))] = obj.extra_exports(engine).items()
    assert rel == "students/cnn/model.safetensors" and metadata["variant"] == "test_resnet"  # timm's name
    assert obj.model_names() == {"cnn": "test_resnet"}  # the start line's and model.safetensors' variant
    out = tmp_path / "run" / rel
    out.parent.mkdir(parents=True)
    save_weights(state, out, metadata=metadata)
    theirs = timm.create_model("test_resnet", pretrained=False, num_classes=0, output_stride=8)
    theirs.load_state_dict(load_weights(out))  # strict: every name timm's
    model.eval()
    with obj.features(engine) as features:
        want = features(images)
    torch.testing.assert_close(theirs.eval().forward_head(theirs.forward_features(images), pre_logits=True),
                               want[:, :theirs.num_features])
    found = load_backbone(out)
    with torch.no_grad():
        torch.testing.assert_close(found.model.forward_features(images)[:, 0], want[:, :theirs.num_features])
    if kind == "meta_dinov2":  # the commands, once: evaluate, embed, export_weights (file, timm folder)
        src = Source(out, lambda x: want, side, "ResNet", [])
        evaluate(src, data, tmp_path, capsys, monkeypatch)
        embed(src, data, tmp_path, capsys, monkeypatch)
        from tests.unit.test_recipe_matrix import launcher

        assert launcher("export_weights").main([str(out), "--out", str(tmp_path / "again.safetensors")]) == 0
        assert load_weights(tmp_path / "again.safetensors").keys() == state.keys()
        assert launcher("export_weights").main([str(out), "--format", "timm", "--out", str(tmp_path / "t")]) == 0
        folder = timm.create_model(f"local-dir:{tmp_path / 't'}", pretrained=True).eval()
        torch.testing.assert_close(folder.forward_features(images), theirs.forward_features(images))


def test_a_student_timm_cannot_build_or_align_is_one_line(data, teachers):
    path = teachers["timm_dinov3"][0]
    for student, match in [("{name: cnn, timm: no_such_net}", r"distill.students\[0\].timm: timm cannot build "
                                                                r"'no_such_net'"),
                           ("{name: cnn, timm: test_vit}", r"gives features of shape \(1, \d+, \d+\), not a \(B, C, h, w\) feature map"),
                           ("{name: cnn, timm: resnet10t}", r"1x2 feature map at model.img_size=\[32, 48\], the "
                                                            r"teacher a 2x3 patch grid: they cannot be aligned")]:
        with pytest.raises(ConfigError, match=match) as e:
            objective(data, path, 32, f"distill.students=[{student}]", "model.img_size=[32,48]")
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="distill.students"):
        load_config(DEMO, [*SHRINK, f"data.path={data}", "distill.students=[{name: a/b, timm: resnet10t}]"])


def test_two_students_on_one_teacher_forward_end_where_each_alone_ends(data, teachers, monkeypatch):
    """A ViT and a timm CNN distilled together: one teacher forward per micro batch, each student's weights after
    5 AdamW steps (the trainer's parameter groups) those of the same student distilled alone from the same seed
    (1e-6, fp32); the ViT's lr_scale 0.5 is the lr of its run alone at half train.lr."""
    from pipeline.train.optim import build_optimizer, param_groups

    path, _, side = teachers["meta_dinov2"]
    vit, cnn = "{name: vit, model: {embed_dim: 16, num_heads: 1}}", CNN.removeprefix("distill.students=[")[:-1]
    images = [torch.randn(4, 3, side, side, generator=torch.Generator().manual_seed(s)) for s in range(4)]

    def distil(students: str, lr: float = 1e-3):
        obj, model, _ = objective(data, path, side, f"distill.students=[{students}]", f"train.lr={lr}",
                                  "train.weight_decay=0.05")
        opt = build_optimizer(param_groups(model, obj.cfg.train, 0), obj.cfg.train)
        _, engine = distil_steps(obj, model, images + images[:1], opt)  # 5 steps
        return obj, model, engine

    both, model, engine = distil(f"{vit[:-1]}, lr_scale: 0.5}}, {cnn}")
    vit_lrs = {g["lr"] for g in param_groups(model, both.cfg.train, 0) if g.get("role") == "student_vit"}
    assert vit_lrs == {5e-4}  # the role's groups at half train.lr
    # each student's lr logged (train/<name>/lr), not only the largest as train/lr
    assert both.lr_metrics(param_groups(model, both.cfg.train, 0)) == {"vit/lr": 5e-4, "cnn/lr": 1e-3}
    assert both.teacher_forwards == 5  # once per micro batch, for both students
    assert set(both.train_metrics()) == {"vit/cls_loss", "vit/patch_loss", "cnn/cls_loss", "cnn/patch_loss"}
    exports = both.extra_exports(engine)
    assert set(exports) == {"students/vit/model.safetensors", "students/cnn/model.safetensors"}
    for name, students, lr in (("vit", vit, 5e-4), ("cnn", cnn, 1e-3)):
        alone, alone_model, alone_engine = distil(students, lr)
        mine = model.students[name].state_dict()
        theirs = alone_model.state_dict()
        assert mine.keys() == theirs.keys()
        for k in mine:
            torch.testing.assert_close(mine[k], theirs[k], atol=1e-6, rtol=0, msg=f"{name}: {k}")
        state, _ = exports[f"students/{name}/model.safetensors"]
        assert state.keys() == alone.exported_weights(alone_engine).keys()
    torch.testing.assert_close(both.exported_weights(engine)["cls_token"], model.students["vit"].backbone.cls_token)
    # Clipping two or more: each by its own norm (tests/integration/test_distill_clip.py), not refused.
    assert load_config(DEMO, [*SHRINK, f"data.path={data}", f"distill.students=[{vit}, {cnn}]",
                              "train.grad_clip=1"]).train.grad_clip == 1
    for students, end in ((f"{vit[:-1]}, lr_scale: 0}}, {cnn}", ", got"),  # <= 0; a single student's not 1
                          (f"{vit[:-1]}, lr_scale: 2}}", ", and 1 for a single student")):
        with pytest.raises(ConfigError, match=r"'distill.students' must be a list whose entry 0 \('vit'\) has an "
                                              rf"lr_scale > 0{end}"):
            load_config(DEMO, [*SHRINK, f"data.path={data}", f"distill.students=[{students}]"])


def test_eval_sets_judge_every_student_and_the_teacher_and_each_ones_flops_are_said(data, teachers):
    """eval.sets on two students (eval/<student>/<set>/...) and, at step 0, on the teacher (eval/teacher/<set>/...):
    each name judges its own model's features, the teacher's the file's own; the FLOPs per image of each."""
    from pipeline.dist import DistEnv
    from pipeline.eval.features import embedding
    from pipeline.eval.sets import EvalSets
    from pipeline.model.timm_backbone import timm_flops
    from pipeline.model.variants import model_flops

    path, reference, side = teachers["meta_dinov2"]
    vit, cnn = "{name: vit, model: {embed_dim: 16, num_heads: 1}}", CNN.removeprefix("distill.students=[")[:-1]
    obj, model, kwargs = objective(data, path, side, f"distill.students=[{vit}, {cnn}]", "train.grad_clip=0",
                                   f"eval.sets.lab={data}")
    engine, cpu = _Engine(model), torch.device("cpu")
    engine.device = cpu
    sets = EvalSets.build(obj.cfg.eval, obj.cfg.data, DistEnv(0, 0, 1, "127.0.0.1", 0, "test"), (side, side), 8)
    judged, line = sets.judge(obj.judged_features(engine), cpu)
    assert {k for k in judged if k.endswith("knn_top1")} == {"eval/vit/lab/knn_top1", "eval/cnn/lab/knn_top1"}
    assert "vit/lab k-NN top-1" in line and "cnn/lab k-NN top-1" in line
    assert obj.model_names() == {"vit": obj.cfg.model.variant, "cnn": "test_resnet"}  # what the start line says
    first, _ = sets.judge(obj.reference_features(engine), cpu)
    assert first == sets.evaluate(reference, cpu, "teacher")  # the teacher file's own model, judged alike
    assert "eval/teacher/lab/knn_top1" in first
    images = torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(3))
    model.eval()
    for name, features in obj.judged_features(engine).items():  # each student's own backbone
        with features as embed, torch.no_grad():
            backbone = model.students[name].backbone
            torch.testing.assert_close(embed(images), embedding(backbone.forward_features(images), backbone))
    with obj.reference_features(engine)["teacher"] as embed, torch.no_grad():
        torch.testing.assert_close(embed(images), reference(images), atol=1e-5, rtol=1e-5)
    flops = obj.model_flops(kwargs)
    students = kwargs["students"]
    assert flops == {"vit": model_flops({k: v for k, v in students["vit"].items() if k != "teacher_dim"}),
                     "cnn": timm_flops("test_resnet", {"output_stride": 8}, (side, side)),
                     "teacher": model_flops(obj.teacher.flops_kwargs)}
    assert 0 < flops["vit"] < flops["teacher"]
