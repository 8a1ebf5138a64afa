"""The DINOv2 objective's parts on one process: the multi-crop view is a function of the seed, the model
says its decay groups and layers, the frozen prototypes get zero gradients, the schedules have DINOv2's
end points, the centres move once per step from the teacher outputs, the PCA image, the config checks."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.config import ConfigError, load_config
from pipeline.data.multicrop import MultiCropConfig
from pipeline.model.vit import model_flops
from pipeline.objectives import OBJECTIVES
from pipeline.objectives.dino import DINOv2, DINOv2Model, MultiCropView, dinov2_model_kwargs, pca_rgb
from pipeline.train.optim import param_groups

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


def test_model_decay_groups_layers_and_frozen_prototypes():
    obj = objective("train.layer_decay=0.9")
    model = obj.build_model(obj.model_kwargs())
    groups = param_groups(model, obj.cfg.train, depth=2)
    names = {id(p): n for n, p in model.named_parameters()}
    by_name = {names[id(p)]: g for g in groups for p in g["params"]}
    assert by_name["backbone.pos_embed"]["weight_decay"] == 0 and by_name["backbone.pos_embed"]["layer"] == 0
    assert by_name["backbone.blocks.1.attn.qkv.weight"]["layer"] == 2
    assert by_name["dino_head.last_layer.weight_v"]["layer"] == 3 and by_name["dino_head.last_layer.weight_v"]["decay"]
    assert by_name["backbone.mask_token"]["layer"] == 0
    # The teacher starts as the student and is not trained.
    assert all(torch.equal(s, t) for s, t in zip(model.state_dict().values(), obj.teacher.state_dict().values()))
    assert not any(p.requires_grad for p in obj.teacher.parameters())

    crops = torch.randn(4, 3, 16, 16)
    masks = torch.zeros(4, 16, dtype=torch.bool)
    masks[:, :3] = True
    for frozen in (True, False):
        model.zero_grad()
        model.freeze_last_layer(frozen)
        out = model(crops, torch.randn(4, 3, 8, 8), masks)
        (out["global"].sum() + out["local"].sum() + out["masked"].sum()).backward()
        grad = model.dino_head.last_layer.weight_v.grad
        assert grad is not None and (grad.abs().sum() == 0) == frozen  # zero, but present
        assert model.dino_head.mlp[0].weight.grad.abs().sum() > 0


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

    def forward(self, *args):
        return self.module(*args)


def test_a_step_applies_the_schedules_and_moves_centres_and_teacher_once():
    obj = objective("dino.mask_probability=1.0")
    model = obj.build_model(obj.model_kwargs())
    groups = [{"decay": True, "weight_decay": 0.04}, {"decay": False, "weight_decay": 0.0}]
    engine = FakeEngine(model, groups)
    view = obj.sample_view(obj.model_kwargs())
    samples = [view(image(i), i) for i in range(4)]
    batch = tuple(torch.stack(part) for part in zip(*samples))
    obj.step = 60
    loss = obj.loss(engine, batch, torch.zeros(4), None)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert groups[0]["weight_decay"] == pytest.approx(obj.weight_decay(60)) and groups[1]["weight_decay"] == 0.0
    assert not model.dino_head.last_layer.frozen  # past dino.freeze_last_layer_steps
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
    fresh.build_model(fresh.model_kwargs())
    fresh.load_state_dict(state)
    assert fresh.step == 61 and torch.equal(fresh.dino_loss.center, obj.dino_loss.center)
    assert torch.equal(fresh.teacher.backbone.cls_token, obj.teacher.backbone.cls_token)
    with pytest.raises(ValueError, match="not written by a model.objective=dinov2 run"):
        fresh.load_state_dict({})


def test_flops_count_student_crops_and_a_third_of_the_teacher():
    obj = objective()
    kwargs = obj.model_kwargs()
    backbone = 2 * model_flops(kwargs) + 2 * model_flops(kwargs, 8)
    assert backbone < obj.flops_per_image(kwargs) < 2 * backbone


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
