"""The model EMA (pipeline/train/ema.py) against timm's ModelEmaV3, step by step and bit for bit: the decay
of every step (first step, warm-up, minimum, update_after_step), the weights and buffers after each update
(fp32 model; bf16 model with a float32 EMA), the saved state, the evaluation through the objective's own
hook, the config checks. The DINOv2 teacher's use of the same machinery: tests/unit/test_dino_objective.py."""

import copy
import itertools

import pytest
import torch
from timm.utils.model_ema import ModelEmaV3
from torch import nn

from pipeline.config import ConfigError, TrainConfig
from pipeline.objectives import load_config
from pipeline.objectives.base import EvalResult
from pipeline.train.ema import Ema, ModelEma, timm_decay


def small_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    """Parameters, floating buffers (BatchNorm's running statistics) and an integer one (its counter)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.GELU(), nn.Linear(8, 3)).to(dtype)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 6, generator=g).to(next(model.parameters()).dtype)
    loss = model(x).float().square().mean()  # train mode: BatchNorm's statistics move too
    opt.zero_grad()
    loss.backward()
    opt.step()


def assert_equal_states(ours: nn.Module, theirs: nn.Module, step: int) -> None:
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), f"step {step}, {k}: max |diff| {(a[k].double() - b[k].double()).abs().max()}"


SETTINGS = [
    dict(ema_decay=0.9),
    dict(ema_decay=0.999, ema_warmup=True),
    dict(ema_decay=0.99, ema_warmup=True, ema_warmup_gamma=3.0, ema_warmup_power=0.75, ema_min_decay=0.3),
    dict(ema_decay=0.95, ema_update_after_step=3),
    dict(ema_decay=0.98, ema_warmup=True, ema_update_after_step=2, ema_min_decay=0.5),
]


def timm_ema(model: nn.Module, tc: TrainConfig, **kwargs) -> ModelEmaV3:
    return ModelEmaV3(model, decay=tc.ema_decay, min_decay=tc.ema_min_decay,
                      update_after_step=tc.ema_update_after_step, use_warmup=tc.ema_warmup,
                      warmup_gamma=tc.ema_warmup_gamma, warmup_power=tc.ema_warmup_power, **kwargs)


@pytest.mark.parametrize("settings", SETTINGS)
def test_decay_of_every_step_is_timms(settings):
    tc = TrainConfig(**settings)
    theirs = timm_ema(nn.Linear(1, 1), tc)
    decays = [timm_decay(step, tc) for step in range(0, 200)]
    assert decays == [theirs.get_decay(step) for step in range(0, 200)]
    first_average = tc.ema_update_after_step + 2
    assert decays[:first_average] == [0.0] * first_average and 0 < decays[first_average] <= tc.ema_decay


@pytest.mark.parametrize("settings,foreach", list(itertools.product(SETTINGS[1:4], [True, False])))
def test_update_equals_timms_step_by_step(settings, foreach):
    tc = TrainConfig(**settings)
    model = small_model()
    theirs = timm_ema(model, tc, foreach=foreach)
    ours = ModelEma(model, copy.deepcopy(model), tc)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(1, 13):  # timm's train.py: model_ema.update(model, step=num_updates), 1 for the first
        train_step(model, opt, step)
        theirs.update(model, step=step)
        ours.update(step)
        assert_equal_states(ours.shadow, theirs.module, step)
    # An average, not a copy, and the counter copied.
    assert not torch.equal(ours.shadow[0].weight, model[0].weight)
    assert ours.shadow[1].num_batches_tracked.item() == 12


def test_bf16_model_with_float32_ema_equals_timms_float32_ema():
    tc = TrainConfig(ema_decay=0.99, ema_warmup=True)
    model = small_model(torch.bfloat16)
    # timm's low-precision option: the EMA kept in float32 (its per-tensor path casts the model's values).
    theirs = timm_ema(model, tc, dtype=torch.float32, foreach=False)
    ours = ModelEma(model, copy.deepcopy(model).float(), tc)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(1, 9):
        train_step(model, opt, step)
        theirs.update(model, step=step)
        ours.update(step)
        assert_equal_states(ours.shadow, theirs.module, step)
    assert ours.shadow[0].weight.dtype == torch.float32


def test_meta_arithmetic_is_the_teachers_formula_and_leaves_buffers():
    """The teacher's arithmetic (Meta's): t x m + s x (1 - m), tensor by tensor; buffers not averaged."""
    student, teacher = small_model(), small_model()
    with torch.no_grad():
        for p in teacher.parameters():
            p.mul_(-1.5)
        teacher[1].running_mean.fill_(7.0)
    expected = [t.detach().clone().mul_(0.97).add_(s.detach(), alpha=1.0 - 0.97)
                for s, t in zip(student.parameters(), teacher.parameters())]
    Ema(teacher, "scale_add", buffers=False).update(student, 0.97)
    assert all(torch.equal(p, e) for p, e in zip(teacher.parameters(), expected))
    assert torch.equal(teacher[1].running_mean, torch.full((8,), 7.0))
    # lerp differs from it in the last bits: two arithmetics, not one renamed.
    lerped = small_model()
    with torch.no_grad():
        for p in lerped.parameters():
            p.mul_(-1.5)
    Ema(lerped, "lerp", buffers=False).update(student, 0.97)
    assert any(not torch.equal(a, b) for a, b in zip(lerped.parameters(), teacher.parameters()))


def test_state_round_trips_and_a_checkpoint_without_ema_starts_from_the_model():
    tc = TrainConfig(ema_decay=0.9)
    model = small_model()
    ema = ModelEma(model, copy.deepcopy(model), tc)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(1, 5):
        train_step(model, opt, step)
        ema.update(step)
    state = ema.state_dict()
    assert all(v.device.type == "cpu" for v in state["weights"].values())
    assert state["weights"]["1.num_batches_tracked"].dtype == torch.int64
    other = ModelEma(model, small_model(), tc)  # starts as the model
    assert not torch.equal(other.shadow[0].weight, ema.shadow[0].weight)
    other.load_state_dict(state)
    assert_equal_states(other.shadow, ema.shadow, 4)
    other.load_state_dict({})  # a tag written without train.ema_decay
    assert_equal_states(other.shadow, model, 4)
    with pytest.raises(ValueError, match="another model"):
        other.load_state_dict({"weights": {k: v for k, v in state["weights"].items() if k != "3.bias"}})


def test_a_resume_without_train_ema_decay_says_it_drops_the_checkpoints_ema(capsys):
    from pipeline.train.state import ClientState

    class Part:
        def __init__(self):
            self.loaded = None

        def state_dict(self):
            return {"x": 1}

        def load_state_dict(self, state):
            self.loaded = state

    data = Part()
    # DeepSpeed returns its own keys beside the parts (engine._common_checkpoint_state): not parts, no notes
    deepspeed_keys = dict.fromkeys(["buffer_names", "param_shapes", "frozen_param_shapes", "shared_params",
                                    "frozen_param_fragments", "global_samples", "ds_config", "ds_version",
                                    "parallel_dims", "optimizer"])
    ClientState({"data": data}).load_state_dict({"data": {"x": 2}, "ema": {"weights": {}}, **deepspeed_keys},
                                                "checkpoints/step_4")
    assert data.loaded == {"x": 2}
    note = capsys.readouterr().out
    assert note.count("note:") == 1 and "note: checkpoints/step_4 holds the part 'ema', which this run does not keep " \
           "(the model EMA: train.ema_decay is not set" in note, note
    ClientState({"data": data}).load_state_dict({"data": {"x": 3}}, "checkpoints/step_8")  # nothing dropped
    assert capsys.readouterr().out == ""


class ForwardSum:
    """A stand-in objective: its evaluation reads the `engine` it is given, as every objective's does."""

    def __init__(self):
        self.calls = []

    def evaluate(self, engine, dtype, run_dir, step):
        engine.eval()
        x = torch.ones(4, 6, dtype=dtype, device=engine.device)
        value = engine(x).sum().item()
        engine.train()
        self.calls.append((dtype, run_dir))
        return EvalResult({"eval/out": value}, f"eval step {step} | out {value:.4f}", [("fig.png", "figs")])


def test_evaluation_is_the_objectives_own_on_the_ema_with_suffixed_names():
    model = small_model()
    ema = ModelEma(model, copy.deepcopy(model), TrainConfig(ema_decay=0.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(1, 4):
        train_step(model, opt, step)
        ema.update(step)
    objective = ForwardSum()
    result = ema.evaluate(objective, 3)
    with torch.no_grad():
        expected = ema.shadow(torch.ones(4, 6)).sum().item()
    assert result.metrics == {"eval/out_ema": expected}
    assert result.line.startswith("eval step 3 | EMA | out ") and result.artifacts == []
    assert objective.calls == [(torch.float32, None)]  # in the EMA's float32, no figures
    assert not ema.shadow.training  # train() on the stand-in engine left the EMA in eval mode
    exported = ema.exported_weights()
    assert exported.keys() == ema.shadow.state_dict().keys()
    assert torch.equal(exported["0.weight"], ema.shadow[0].weight)


def test_config_checks():
    with pytest.raises(ConfigError, match="train.ema_decay.*dino.momentum_teacher"):
        load_config(None, ["model.objective=dinov2", "train.ema_decay=0.999"])
    with pytest.raises(ConfigError, match=r"train.ema_decay' must be in \[0, 1\]"):
        load_config(None, ["train.ema_decay=1.5"])
    with pytest.raises(ConfigError, match="train.ema_warmup_gamma"):
        load_config(None, ["train.ema_decay=0.9", "train.ema_warmup_gamma=0"])
    assert load_config(None, ["train.ema_decay=0.9998", "train.ema_warmup=true"]).train.ema_warmup
