"""`launch/pretrain.py --init SOURCE` (pipeline/run/init_source.py) and the adapt section
(pipeline/objectives/adapt.py): the student and the teacher start as a file's backbone (Meta's DINOv2 layout,
timm's DINOv3), the heads fresh; during adapt.freeze_backbone_steps the backbone does not move, bit for bit,
while the heads do; the source judged at step 0; a resume against another source refused in one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from pipeline.config import ConfigError
from pipeline.objectives.adapt import AdaptConfig, backbone_lr_factor, backbone_lr_schedule
from tests.unit.recipe_runs import ROOT, SHRINK, foreign_file, labelled_set

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
DEMO = str(ROOT / "configs/pretrain/dinov2_adapt_demo.yaml")
# The tiny Meta DINOv2 file of recipe_runs.py: 28 px, patch 14 (a 2x2 grid; local crops of 14 px: one patch).
DINOV2_TINY = [*SHRINK, "model.img_size=28", "dino.local_crops_size=14", "dino.local_crops_number=1",
               "dino.head_n_prototypes=64", "dino.head_hidden_dim=32", "dino.head_bottleneck_dim=16",
               "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_batch_size=8",
               "dino.knn_train_samples=16", "dino.pca_images=0", "dino.freeze_last_layer_steps=0",
               "train.warmup_steps=0", "train.lr=1e-2", "train.log_every=1"]


def test_the_anchor_is_the_gram_loss_against_the_source_taken_once_at_step_0():
    from pipeline.objectives import load_config
    from pipeline.objectives.adapt import anchored
    from pipeline.objectives.dinov3.gram_teacher import takes_copy

    cfg = anchored(load_config(str(ROOT / "configs/pretrain/dinov3_demo.yaml"), ["adapt.anchor=0.5"]))
    g = cfg.gram
    assert g.loss_weight == 0.5 and [takes_copy(s, g.start_step, g.update_every, g.max_updates)
                                     for s in range(0, 3 * max(g.update_every, 1) + 1)] == [True] + [False] * (
        3 * max(g.update_every, 1))
    dinov2 = load_config(DEMO, ["adapt.anchor=0.5"])  # DINOv2's anchor reads adapt.anchor (dino/anchor.py)
    assert anchored(dinov2).gram == dinov2.gram
    with pytest.raises(ConfigError, match="adapt.anchor.* must be 0 with model.objective=mae"):
        load_config(str(ROOT / "configs/pretrain/mae_demo.yaml"), ["adapt.anchor=0.5"])  # no patch features' Gram


def test_dinov2s_anchor_is_the_gram_loss_against_the_source_taken_at_step_0_only():
    """pipeline/objectives/dino/anchor.py: the source taken before step 0, never again; its term equals
    adapt.anchor x the mean squared difference of the L2-normalised patch features' Gram matrices, per image."""
    from pipeline.model.vit import VisionTransformer
    from pipeline.objectives import load_config
    from pipeline.objectives.dino.anchor import SourceAnchor

    def vit(seed: int) -> VisionTransformer:
        torch.manual_seed(seed)
        return VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=0,
                                 mask_token=True, drop_path_rate=0.0).eval()

    source, later = vit(0), vit(1)
    anchor = SourceAnchor(vit(2), 0.5, load_config(DEMO, ["adapt.anchor=0.5"]))
    anchor.before_step(0, source, torch.device("cpu"))
    anchor.before_step(1, later, torch.device("cpu"))  # the teacher moved on: not taken again
    assert all(torch.equal(a, b) for a, b in zip(anchor.source.backbone.parameters(), source.parameters()))
    crops = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    student = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(4))

    def gram(x: torch.Tensor) -> torch.Tensor:
        x = x / x.norm(dim=-1, keepdim=True)
        return x @ x.transpose(1, 2)

    with torch.no_grad():
        want = 0.5 * ((gram(student) - gram(source.forward_tokens(crops).patch_tokens)) ** 2).mean()
    torch.testing.assert_close(anchor.term(crops, student), want, rtol=1e-6, atol=1e-7)


def test_a_set_more_than_warn_drop_points_below_the_source_is_warned(tmp_path, capsys):
    from pipeline.run.init_source import versus_init

    source = {"eval/a/knn_top1": 0.80, "eval/b/knn_top1": 0.50}
    assert versus_init(source, tmp_path, 0, 5.0) == source
    got = versus_init({"eval/a/knn_top1": 0.74, "eval/b/knn_top1": 0.46}, tmp_path, 4, 5.0)
    assert got["eval/a/knn_top1_vs_init"] == pytest.approx(-0.06) and got["eval/b/knn_top1_vs_init"] == pytest.approx(-0.04)
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["warning: step 4: eval/a/knn_top1 is 74.00%, 6.00 points below the source's 80.00% "
                   "(adapt.warn_drop=5)"]
    versus_init({"eval/a/knn_top1": 0.10}, tmp_path, 8, None)  # null: never
    assert capsys.readouterr().out == ""


def test_the_backbone_lr_is_0_through_the_freeze_then_ramps_to_the_schedule():
    a = AdaptConfig(freeze_backbone_steps=2, backbone_warmup_steps=4)
    assert [backbone_lr_factor(a, s) for s in range(7)] == [0, 0, 0.25, 0.5, 0.75, 1, 1]
    groups = [{"lr": 1.0}, {"lr": 1.0, "role": "patch_embed"}, {"lr": 1.0, "role": "head"},
              {"lr": 1.0, "role": "decoder"}]
    backbone_lr_schedule(groups, a, 3)
    assert [g["lr"] for g in groups] == [0.5, 0.5, 1.0, 1.0]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return labelled_set(tmp_path_factory.mktemp("set") / "labelled")


def _student_and_teacher(overrides: list[str], source: Path, data: Path, run_dir: Path, explicit: frozenset = frozenset()):
    """The objective's student with --init's hook applied, and its teacher, as the trainer builds them."""
    from contextlib import nullcontext

    from pipeline.data import dataset_info_of
    from pipeline.objectives import build_objective, load_config
    from pipeline.run.init_source import prepare_init

    cfg = load_config(DEMO, [*overrides, f"data.path={data}", f"run.dir={run_dir}", f"adapt.init={source}"])
    cfg, hook = prepare_init(cfg, None, set(explicit))
    objective = build_objective(cfg, dataset_info_of(cfg.data))
    kwargs = objective.model_kwargs()
    model = objective.build_model(kwargs)
    hook(model)
    objective.build_companions(model, kwargs, nullcontext)
    return cfg, model.eval(), objective.teacher


@pytest.mark.parametrize("layout", ["meta_dinov2", "timm_dinov3"])
def test_student_and_teacher_start_as_the_file_and_the_heads_are_fresh(layout, data, tmp_path, capsys):
    src = foreign_file(layout, tmp_path / "src")
    overrides = DINOV2_TINY if layout == "meta_dinov2" else [
        *SHRINK, "model.objective=dinov3", "model.variant=dinov3_vits16", "model.img_size=32", "dinov3.local_crops_size=16",
        "dinov3.head_n_prototypes=64", "dinov3.head_hidden_dim=32", "dinov3.head_bottleneck_dim=16"]
    if layout == "timm_dinov3":  # the dinov2 demo's dino section is not dinov3's: the demo's own keys off
        overrides = [o for o in overrides if not o.startswith("dino.")]
    cfg, student, teacher = _student_and_teacher(overrides, src.path, data, tmp_path / "run")
    assert "fresh: backbone.mask_token, dino_head" in capsys.readouterr().out
    x = torch.randn(2, 3, src.img_size if layout == "meta_dinov2" else 32, src.img_size if layout == "meta_dinov2" else 32,
                    generator=torch.Generator().manual_seed(0))
    from pipeline.eval.features import embedding

    want = src.reference(x)
    for model in (student, teacher):
        got = embedding(model.backbone.forward_features(x), model.backbone)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert cfg.adapt.init_digest and len(cfg.adapt.init_digest) == 64
    # adapt.anchor at a resume (not stored in checkpoints): read again from the file into a module of the
    # teacher's backbone's structure, it is the step-0 teacher the anchor took, bit for bit (its mask token,
    # unused by the anchor's forward, aside).
    from pipeline.run.init_source import reload_source

    anchor = copy.deepcopy(teacher.backbone)
    for p in anchor.parameters():
        p.data.zero_()
    reload_source(anchor, cfg, "adapt.anchor")
    assert "adapt.anchor: the frozen source read again from adapt.init" in capsys.readouterr().out
    want = dict(teacher.backbone.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in anchor.named_parameters() if n != "mask_token")


def test_registers_beyond_the_sources_start_fresh_after_its_own_and_fewer_is_one_line(data, tmp_path, capsys):
    """model.reg_tokens=4 from a Meta DINOv2 file without registers: the model has 4, fresh (said in the line),
    every other tensor the file's, the features run; from one with 4, model.reg_tokens=6 keeps them in slots 0-3;
    2 is one line."""
    reg4 = foreign_file("meta_dinov2", tmp_path / "src").path
    state = torch.load(reg4)
    del state["register_tokens"]  # Meta's layout without registers (its pos_embed has the class row either way)
    torch.save(state, none := tmp_path / "dinov2_noreg.pth")
    regs = frozenset({"reg_tokens"})
    cfg, student, teacher = _student_and_teacher([*DINOV2_TINY, "model.reg_tokens=4"], none, data, tmp_path / "a", regs)
    line = capsys.readouterr().out
    assert cfg.model.reg_tokens == 4 and "fresh: backbone.mask_token, backbone.reg_token 0-3 (registers past the " \
        "source's 0), dino_head" in line, line
    from pipeline.model.layouts import recognise

    want = recognise(state).state  # the file's tensors under the model's names
    x = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(0))
    for model in (student, teacher):
        got = dict(model.backbone.named_parameters())
        assert got.keys() - want.keys() == {"reg_token", "mask_token"} and got["reg_token"].shape == (1, 4, 128)
        assert all(torch.equal(got[k], v) for k, v in want.items())
        assert model.backbone.forward_features(x).shape == (2, 1 + 4 + 4, 128)  # class, registers, 2x2 patches
    _, six, _ = _student_and_teacher([*DINOV2_TINY, "model.reg_tokens=6"], reg4, data, tmp_path / "c", regs)
    assert "backbone.reg_token 4-5 (registers past the source's 4)" in capsys.readouterr().out
    source_regs = torch.load(reg4)["register_tokens"]
    assert torch.equal(six.backbone.reg_token[:, :4], source_regs) and six.backbone.reg_token.shape[1] == 6
    with pytest.raises(ConfigError, match=r"^model.reg_tokens=2: --init .* has 4 registers.*\(>= 4\)$"):
        _student_and_teacher([*DINOV2_TINY, "model.reg_tokens=2"], reg4, data, tmp_path / "e", regs)


def test_a_config_key_that_contradicts_the_source_is_one_line(data, tmp_path):
    from pipeline.objectives import load_config
    from pipeline.run.init_source import prepare_init

    src = foreign_file("meta_dinov2", tmp_path / "src")
    cfg = load_config(DEMO, [*DINOV2_TINY, "model.embed_dim=96", f"data.path={data}", f"adapt.init={src.path}"])
    with pytest.raises(ConfigError, match=r"^model.embed_dim=96: --init .* has model.embed_dim=128"):
        prepare_init(cfg, None, {"embed_dim"})


def test_a_source_normalised_otherwise_is_said_and_adapt_normalise_source_takes_its(data, tmp_path, capsys):
    """Issue 72: Meta's DINOv2 file (trained on ImageNet's mean and std) under a config of 0.5: one warning line
    naming both at the first start, the run's own kept; adapt.normalise=source takes the file's, said, and a resume
    keeps what the first start recorded whatever the config says; a config of the source's own says nothing."""
    from types import SimpleNamespace

    from pipeline.data.multicrop import IMAGENET_MEAN, IMAGENET_STD
    from pipeline.objectives import load_config
    from pipeline.run.init_source import prepare_init

    src = foreign_file("meta_dinov2", tmp_path / "src")
    base = [*DINOV2_TINY, f"data.path={data}", f"adapt.init={src.path}"]
    cfg, _ = prepare_init(load_config(DEMO, base), None, set())
    out = capsys.readouterr().out
    assert cfg.data.mean == (0.5, 0.5, 0.5), cfg.data.mean
    assert (f"warning: --init {src.path} was trained on inputs normalised with mean [0.485, 0.456, 0.406], std "
            "[0.229, 0.224, 0.225] (what its authors trained it with), and this run normalises with data.mean "
            "[0.5, 0.5, 0.5], data.std [0.5, 0.5, 0.5]: set adapt.normalise=source to take the source's") in out, out
    cfg, _ = prepare_init(load_config(DEMO, [*base, "adapt.normalise=source"]), None, set())
    assert tuple(cfg.data.mean) == IMAGENET_MEAN and tuple(cfg.data.std) == IMAGENET_STD
    out = capsys.readouterr().out
    assert "data.mean [0.485, 0.456, 0.406], data.std [0.229, 0.224, 0.225] (what its authors" in out and \
        "warning" not in out, out
    recorded = {"adapt": {"init": str(src.path), "init_digest": cfg.adapt.init_digest, "normalise": "source"},
                "data": {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)}, "model": {}}
    plan = SimpleNamespace(state=SimpleNamespace(config=recorded), tag="step_0000010")
    resumed, hook = prepare_init(load_config(DEMO, base), plan, set())
    assert hook is None and tuple(resumed.data.mean) == IMAGENET_MEAN and tuple(resumed.data.std) == IMAGENET_STD
    own = [f"data.mean={list(IMAGENET_MEAN)}", f"data.std={list(IMAGENET_STD)}"]
    capsys.readouterr()
    prepare_init(load_config(DEMO, [*base, *own]), None, set())
    assert "warning" not in capsys.readouterr().out
    with pytest.raises(ConfigError, match="adapt.normalise"):
        load_config(DEMO, [*base, "adapt.normalise=imagenet"])


@pytest.mark.slow  # a DeepSpeed run in this process: about 25 s
def test_the_backbone_is_frozen_bit_for_bit_while_the_heads_train_judged_from_step_0(data, tmp_path, capsys,
                                                                                     monkeypatch):
    """A 2-step run (DeepSpeed, one process): through adapt.freeze_backbone_steps the student's backbone in the
    checkpoint is the file's, bit for bit, its heads moved; eval.sets judged at step 0 and against it after;
    a resume naming another source is refused in one line."""
    from pipeline import commands

    # The run exports RANK, WORLD_SIZE, MASTER_PORT... into this process's environment for DeepSpeed: restore them
    # after the test, or a later test's subprocess would take itself for a rank of this run (its port taken).
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    from pipeline.model.layouts import recognise
    from pipeline.train import checkpoint as ckpt

    src = foreign_file("meta_dinov2", tmp_path / "src")
    run_dir = tmp_path / "run"
    args = ["--config", DEMO, "--init", str(src.path), *DINOV2_TINY, f"data.path={data}", f"run.dir={run_dir}",
            "eval.sets={}", f"eval.sets.lab={data}", "train.steps=2", "adapt.freeze_backbone_steps=2", "train.eval_every=2",
            "train.ckpt_every=1", "train.keep_last=3", "deepspeed.zero_stage=1"]
    assert commands.pretrain(args) == 0
    out = capsys.readouterr().out
    assert "eval step 0" in out
    source = recognise(torch.load(src.path, weights_only=True)).state
    first, last = (ckpt.consolidate(run_dir, ckpt.tag_for(s)) for s in (1, 2))
    for name, value in source.items():
        if f"backbone.{name}" in last and name != "pos_embed":  # (the table: resized to the run's own grid, 2x2 both)
            assert torch.equal(last[f"backbone.{name}"], value.float()), name
    assert torch.equal(last["backbone.pos_embed"], source["pos_embed"].float())
    heads = [k for k in last if k.startswith("dino_head.mlp")]
    assert heads and any(not torch.equal(first[k], last[k]) for k in heads)  # the heads trained
    init = json.loads((run_dir / "eval_init.json").read_text())
    # The step-0 figure is the source's own: what `launch/evaluate.py --from SOURCE --data SET` gives.
    import importlib.util

    spec = importlib.util.spec_from_file_location("launch_evaluate", ROOT / "launch" / "evaluate.py")
    evaluate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(evaluate)
    capsys.readouterr()
    # (A Meta file is read with ImageNet's normalisation unless told: the demo's run normalises with 0.5.)
    norm = ["--mean", *["0.5"] * 3, "--std", *["0.5"] * 3]
    assert evaluate.main(["--from", str(src.path), "--data", str(data), "--protocol", "knn", "--no-mlflow", *norm]) == 0
    table = capsys.readouterr().out
    for k in (10, 20, 100):  # (a coarse figure on this tiny set; the same normalisation and size on both sides)
        assert f"k-NN k={k} {100 * init[f'eval/lab/knn_top1_k{k}']:.2f}% {100 * init[f'eval/lab/knn_top5_k{k}']:.2f}%" \
            in " ".join(table.split()), (table, init)
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    vs = [m for m in logged if "eval/lab/knn_top1_vs_init" in json.dumps(m)]
    assert vs, "eval/lab/knn_top1_vs_init is logged at the evaluation after step 0"
    # Another source at a resume: one line, exit 1, before anything is loaded.
    other = foreign_file("meta_dinov2", tmp_path / "other")
    torch.save({k: v + 1 for k, v in torch.load(other.path, weights_only=True).items()}, other.path)
    capsys.readouterr()  # (consolidate's progress bars above)
    assert commands.pretrain([*args[:3], str(other.path), *args[4:], "train.steps=3"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "started from" in err and "another file" in err
    # The source gone at a resume of this anchored run (the demo's adapt.anchor=2): its anchor cannot be read
    # again (the checkpoints do not store it): one line naming adapt.init, exit 1.
    src.path.rename(src.path.with_suffix(".gone"))
    assert commands.pretrain([*args[:2], *args[4:], "train.steps=3"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"adapt.init={src.path}: not found" in err, err


def test_an_rgb_source_starts_a_c_channel_student_as_timms_adapt_input_conv(data, tmp_path, capsys):
    """Issue 62: the source's RGB patch embedding into a student of 4 channels (an array set's model.in_chans) is
    timm's adapt_input_conv of it, in the student and so the teacher (pipeline/model/channels.py)."""
    import timm

    src = foreign_file("meta_dinov2", tmp_path / "src")
    _, student, teacher = _student_and_teacher([*DINOV2_TINY, "model.in_chans=4"], src.path, data, tmp_path / "run")
    want = timm.models.adapt_input_conv(4, torch.load(src.path)["patch_embed.proj.weight"].clone())
    for model in (student, teacher):
        assert torch.equal(model.backbone.patch_embed.proj.weight, want)
    assert "patch projection RGB -> 4 channels (timm's adapt_input_conv)" in capsys.readouterr().out


@pytest.mark.parametrize(("config", "layout"), [("dinov2_adapt_vitb14.yaml", "meta_dinov2"),
                                                ("dinov3_adapt_vitl16.yaml", "timm_dinov3")])
def test_the_adapt_configs_take_their_sources_architecture(config, layout, tmp_path):
    """The configs/pretrain/*_adapt_* recipes write no architecture key a source would contradict: --init of a
    file of their layout (tiny widths) gives the run the file's architecture; the anchor as each recipe has it."""
    from pipeline.objectives import load_config
    from pipeline.run.init_source import prepare_init

    src = foreign_file(layout, tmp_path / "src")
    cfg = load_config(ROOT / "configs/pretrain" / config, [f"adapt.init={src.path}", f"run.dir={tmp_path / 'run'}"])
    explicit = {"variant", "drop_path_rate", "img_size", "grad_checkpointing"}  # the model keys the files write
    cfg, hook = prepare_init(cfg, None, explicit)
    assert hook is not None and cfg.model.embed_dim != 768 and cfg.adapt.init_digest
    assert cfg.adapt.anchor == 2.0 and (cfg.gram.loss_weight == 2.0) == (cfg.model.objective == "dinov3")


def test_the_demos_second_domain_is_the_same_digits_inverted_and_turned(capsys):
    """make_shards --source digits:shifted (make demo-adapt's second domain): the same images, labels and split
    as --source digits, each drawn dark on light and rotated 90 degrees (at 8 px, no resize)."""
    import importlib.util
    import io

    import numpy as np
    from PIL import Image

    from pipeline.data.sources import digits_source

    spec = importlib.util.spec_from_file_location("make_shards", ROOT / "launch/make_shards.py")
    make_shards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_shards)

    plain, shifted = digits_source(size=8), digits_source(size=8, style="shifted")
    assert shifted.name == "digits-shifted" and shifted.splits == plain.splits
    for item in plain.splits["val"][:5]:
        a, b = (np.asarray(Image.open(io.BytesIO(s.encode(item)[1]))) for s in (plain, shifted))
        # (within 1: 8/16 of the ink is 127.5 of 255, rounded to 128 either way)
        assert np.abs(b.astype(int) - np.rot90(255 - a.astype(int))).max() <= 1 and not np.array_equal(a, b)
    assert make_shards.main(["--source", "digits:upside", "--out", "unused"]) == 2
    assert "--source digits:upside: the style is one of shifted" in capsys.readouterr().err
