"""The DINOv3 objective's parts on one process (the Gram loss itself: test_dinov3_gram.py): when the Gram teacher is taken
and how its features are resized, the view (a function of the seed and the step, one crop size per step, the
Gram crops the global crops' boxes, each crop's RoPE boxes), DINOv3's constant schedules, a step that copies
the Gram teacher and adds its loss from gram.start_step, the state round trip, the config checks and
`launch/pretrain.py --from`."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from pipeline.config import ConfigError
from pipeline.objectives import OBJECTIVES, load_config
from pipeline.objectives.dinov3.gram_teacher import resize_patches, takes_copy
from pipeline.objectives.dinov3.view import pick

TINY = ["model.objective=dinov3", "model.variant=dinov3_vits16", "model.img_size=16", "model.patch_size=4",
        "model.embed_dim=32", "model.depth=2", "model.num_heads=2", "dinov3.local_crops_number=2",
        "dinov3.local_crops_size=8", "dinov3.head_n_prototypes=64", "dinov3.head_hidden_dim=32",
        "dinov3.head_bottleneck_dim=16", "dinov3.ibot_head_n_prototypes=48", "dinov3.ibot_head_bottleneck_dim=16",
        "train.steps=100", "train.weight_decay=0.04", "dinov3.teacher_temp_warmup_steps=30",
        "dinov3.freeze_last_layer_steps=2", "dinov3.mask_probability=1.0"]
GRAM = ["gram.loss_weight=2.0", "gram.start_step=1", "gram.update_every=2", "gram.max_updates=1"]


def objective(*extra: str):
    return OBJECTIVES["dinov3"](load_config(None, [*TINY, *extra]), SimpleNamespace(num_classes=0))


def image(seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (20, 24, 3), dtype=np.uint8))


class FakeEngine(torch.nn.Module):
    """What `loss`/`after_step` use of a DeepSpeed engine: module, device, optimizer groups, forward."""

    def __init__(self, module, groups):
        super().__init__()
        self.module, self.device = module, torch.device("cpu")
        self.optimizer = SimpleNamespace(param_groups=groups)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_gram_copies_at_start_then_every_n_steps_up_to_max_updates():
    steps = range(0, 30)
    assert [s for s in steps if takes_copy(s, start=4, every=5, max_updates=2)] == [4, 9, 14]
    assert [s for s in steps if takes_copy(s, start=0, every=0, max_updates=3)] == [0]
    assert [s for s in steps if takes_copy(s, start=3, every=10, max_updates=None)] == [3, 13, 23]


def test_resize_patches_is_the_identity_on_the_same_grid_and_metas_interpolation_otherwise():
    x = torch.randn(2, 4 * 6, 5)
    assert resize_patches(x, (4, 6), (4, 6)) is x
    out = resize_patches(x, (4, 6), (2, 3))
    maps = x.transpose(1, 2).reshape(2, 5, 4, 6)
    expected = F.interpolate(maps, size=(2, 3), mode="bicubic", align_corners=False).flatten(2).transpose(1, 2)
    torch.testing.assert_close(out, expected)
    assert out.shape == (2, 6, 5)
    # A constant map stays constant: the rows really are the grid's (height-major) cells.
    flat = torch.ones(1, 16, 3) * torch.arange(3.0)
    torch.testing.assert_close(resize_patches(flat, (4, 4), (2, 2)), torch.ones(1, 4, 3) * torch.arange(3.0))


def test_pick_follows_the_weights_and_the_seed():
    draws = [pick([0.2, 0.8], s) for s in range(2000)]
    assert 0.75 < np.mean(draws) < 0.85 and pick([1, 1, 1], 7) == pick([1, 1, 1], 7)


def test_view_is_a_function_of_seed_and_step_with_one_crop_size_per_step():
    res = ["dinov3.resolutions=[{global_crops_size: 16, local_crops_size: 8, weight: 1}, "
           "{global_crops_size: 24, local_crops_size: 12, gram_crops_size: 40, weight: 1}]"]
    obj = objective(*GRAM, *res, "dinov3.rope_jitter_coords=1.5", "dinov3.rope_rescale_coords=null")
    view = obj.train_view(obj.model_kwargs()).sample
    shapes = {}
    for step in range(12):
        parts = [view(image(i), 100 * step + i, step) for i in range(3)]
        sizes = {p[0].shape[-1] for p in parts}
        assert len(sizes) == 1  # every sample of a step at the step's size
        shapes[step] = (parts[0][0].shape[-1], parts[0][1].shape[-1], parts[0][5].shape[-1], parts[0][2].shape[-1])
    assert set(shapes.values()) == {(16, 8, 32, 16), (24, 12, 40, 36)}  # Gram: 2x, or as given; iBOT's grid
    again = view(image(1), 101, 1)
    assert all(torch.equal(a, b) for a, b in zip(view(image(1), 101, 1), again))
    g, local, masks, rope_g, rope_l, gram = again
    boxes = torch.cat([rope_g, rope_l]).view(torch.float32)
    assert boxes.shape == (4, 2, 5) and rope_g.dtype == torch.int32  # a box per crop and block, carried as bits
    assert len({tuple(b.flatten().tolist()) for b in boxes}) == 4  # every crop its own
    assert torch.all(boxes[..., 4] == 1) and torch.all(boxes[..., :2] == 0)  # jitter only, as configured
    assert boxes[..., 2:4].min() >= 1 / 1.5 and boxes[..., 2:4].max() <= 1.5


def test_gram_crops_are_the_global_crops_boxes_at_the_gram_side_without_distortions():
    obj = objective(*GRAM, "dinov3.color_jitter_p=0", "dinov3.greyscale_p=0", "dinov3.blur_p=[0, 0, 0]",
                    "dinov3.solarize_p=0", "gram.crops_size=32")
    parts = obj.train_view(obj.model_kwargs()).sample(image(3), 5, 0)
    g, gram = parts[0], parts[-1]
    assert g.shape == (2, 3, 16, 16) and gram.shape == (2, 3, 32, 32)
    down = F.interpolate(gram, size=(16, 16), mode="bicubic", antialias=True, align_corners=False)
    assert (down - g).abs().mean() < 0.1  # the same content: the same boxes, resampled
    other = F.interpolate(gram.flip(0), size=(16, 16), mode="bicubic", antialias=True, align_corners=False)
    assert (other - g).abs().mean() > 3 * (down - g).abs().mean()


def test_schedules_are_dinov3s_constant_ones_unless_ends_are_given():
    obj = objective()
    assert obj.momentum(0) == obj.momentum(99) == pytest.approx(0.994)
    assert obj.weight_decay(0) == obj.weight_decay(99) == pytest.approx(0.04)
    assert obj.teacher_temp(0) == pytest.approx(0.04) and obj.teacher_temp(30) == pytest.approx(0.07)
    cosine = objective("dinov3.final_momentum_teacher=1.0", "dinov3.weight_decay_end=0.4")
    assert cosine.momentum(100) == pytest.approx(1.0) and cosine.weight_decay(100) == pytest.approx(0.4)


def test_a_step_copies_the_gram_teacher_adds_its_loss_from_start_and_the_state_round_trips():
    obj = objective(*GRAM)
    kwargs = obj.model_kwargs()
    assert kwargs["rope_rescale_coords"] == 2.0  # DINOv3's default RoPE augmentation reaches the student
    model = obj.build_all(kwargs)
    engine = FakeEngine(model, [{"decay": True, "weight_decay": 0.04}])
    view = obj.train_view(kwargs).sample
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    teacher, gram = obj.teacher.backbone, obj.gram.backbone
    names = [n for n, _ in teacher.named_parameters()]
    copies = []
    for step in range(5):
        batch = tuple(torch.stack(p) for p in zip(*[view(image(i), 10 * step + i, step) for i in range(4)]))
        before = {n: p.clone() for n, p in gram.named_parameters()}
        obj.before_step(engine, step)
        took = not all(torch.equal(before[n], p) for n, p in gram.named_parameters())
        if took:
            copies.append(step)
            assert all(torch.equal(a, b) for a, b in zip(gram.parameters(), teacher.parameters()))
        loss = obj.loss(engine, batch, torch.zeros(4), None)
        terms = obj.train_metrics()
        assert (terms["gram_loss"] > 0) == (step >= 1)  # gram.start_step=1
        assert float(sum(v for k, v in terms.items() if k != "dino_teacher_entropy")) == pytest.approx(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
        obj.after_step(engine, step + 1)
    assert copies == [1, 3] and names
    # The Gram teacher is state: into a fresh objective, and the loss it gives is the same.
    state = obj.state_dict()
    assert {"gram_teacher", "teacher", "dino_center"} <= state.keys()
    fresh = objective(*GRAM)
    fresh.build_all(kwargs)
    fresh.load_state_dict(state)
    for a, b in zip(fresh.gram.backbone.parameters(), gram.parameters()):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(gram.parameters(), teacher.parameters()))  # a frozen copy
    # A checkpoint written without Gram anchoring: the Gram teacher starts from the resumed teacher.
    plain = objective()
    plain.build_all(kwargs)
    late = objective(*GRAM)
    late.build_all(kwargs)
    late.load_state_dict(plain.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(late.gram.backbone.parameters(), late.teacher.backbone.parameters()))


def test_flops_count_the_gram_teacher_and_the_mix_of_sizes():
    plain = objective()
    kwargs = plain.model_kwargs()
    base = plain.flops_per_image(kwargs)
    from pipeline.model.variants import dinov3_flops

    gram = objective(*GRAM).flops_per_image(kwargs)
    assert gram == pytest.approx(base + 2 * dinov3_flops(kwargs, 32) / 3)
    mixed = objective("dinov3.resolutions=[{global_crops_size: 16, local_crops_size: 8, weight: 1}, "
                      "{global_crops_size: 32, local_crops_size: 8, weight: 3}]")
    big = objective("model.img_size=32").flops_per_image({**kwargs, "img_size": (32, 32)})
    assert mixed.flops_per_image(kwargs) == pytest.approx((base + 3 * big) / 4)


def test_config_checks_name_the_key():
    for extra, key in ((["model.variant=vit_s16"], "model.variant"),
                       (["gram.remove_neg=true", "gram.remove_only_teacher_neg=true"], "gram.remove_only_teacher_neg"),
                       (["gram.tokens_used=masked"], "gram.tokens_used"),
                       (["gram.crops_size=30"], "gram.crops_size"),
                       (["dinov3.resolutions=[{global_crops_size: 18, local_crops_size: 8}]"], "dinov3.resolutions"),
                       (["dinov3.momentum_teacher=1.5"], "dinov3.momentum_teacher")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [*TINY, *extra])
    load_config(None, [*TINY, "gram.tokens_used=masked", "gram.img_level=false"])


def test_pretrain_from_continues_a_run_for_dinov3_only(capsys):
    from pipeline.commands import parse_pretrain_args, pretrain_config

    cfg, _ = pretrain_config(parse_pretrain_args(["--config", "configs/pretrain/dinov3_demo.yaml", "--from",
                                                  "runs/x y"]))
    assert cfg.dinov3.continue_from == "runs/x y" and cfg.run.kind == "pretrain"
    with pytest.raises(SystemExit):
        pretrain_config(parse_pretrain_args(["--config", "configs/pretrain/demo.yaml", "--from", "runs/x"]))
    assert "model.objective=supervised does not continue a run" in capsys.readouterr().err


def test_steps_on_a_one_channel_16_bit_image_with_gram_crops():
    """Issue 62: DINOv3 with Gram anchoring on 1-channel uint16 arrays (model.in_chans 1, the set's statistics):
    every crop of one channel (Gram's too), a few steps of finite losses, the Gram loss from its start step."""
    obj = objective(*GRAM, "model.in_chans=1", "data.mean=[30000.0]", "data.std=[9000.0]",
                    "dinov3.color_jitter_p=0", "dinov3.greyscale_p=0", "dinov3.solarize_p=0")
    kwargs = obj.model_kwargs()
    model = obj.build_all(kwargs)
    engine = FakeEngine(model, [{"decay": True, "weight_decay": 0.04}])
    view = obj.train_view(kwargs).sample
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    arrays = [np.random.default_rng(i).integers(0, 65536, (20, 24, 1), dtype=np.uint16) for i in range(4)]
    for step in range(3):
        parts = [view(a, 10 * step + i, step) for i, a in enumerate(arrays)]
        global_crops, local_crops, gram_crops = parts[0][0], parts[0][1], parts[0][-1]
        assert global_crops.shape[1] == local_crops.shape[1] == gram_crops.shape[1] == 1
        batch = tuple(torch.stack(p) for p in zip(*parts))
        obj.before_step(engine, step)
        loss = obj.loss(engine, batch, torch.zeros(4), None)
        assert torch.isfinite(loss)
        assert (obj.train_metrics()["gram_loss"] > 0) == (step >= 1)
        loss.backward()
        opt.step()
        opt.zero_grad()
        obj.after_step(engine, step + 1)
    assert model.backbone.patch_embed.proj.weight.shape[1] == 1
