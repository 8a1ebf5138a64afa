"""The collapse warning (pipeline/objectives/dino/collapse.py) on the DINOv2 objective: the effective rank
against its formula, and the warning from the figures the objective itself computes. The demo's case: the
teacher's targets uniform (docs/dino.md: the digits demo's target entropy is 6.91 of log 1024 = 6.93 nats at
step 200 and 6.925 at step 600); a run that learns: targets of entropy well below log K (test_dino.py's
2-rank run logs 2.94 of log 64 = 4.16 at step 12)."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.objectives.dino.collapse import ClassTokenGram, effective_rank
from tests.unit.test_dino_objective import FakeEngine, image, objective, teacher_outputs


def svd_rank(x: torch.Tensor) -> float:
    s = torch.linalg.svdvals(x.double())
    p = s / s.sum()
    return math.exp(float(-(p * p.log()).sum()))


def test_effective_rank_of_a_pass_is_the_singular_values_formula_without_the_padding():
    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(10, 6, generator=g) * torch.tensor([4, 2, 1, .5, .2, .1]), dim=1)
    gram = ClassTokenGram()
    for rows in (x[:4], x[4:7], x[7:]):  # three batches, each padded with a row of garbage
        gram.add(torch.cat([rows, torch.randn(1, 6, generator=g)]), torch.tensor([True] * len(rows) + [False]))
    assert gram.effective_rank() == pytest.approx(svd_rank(x), rel=1e-9)
    assert effective_rank(torch.eye(6)) == pytest.approx(6.0)  # orthonormal tokens: full rank
    same = x[:1].double().expand(10, 6)
    assert effective_rank(same.T @ same) == pytest.approx(1.0, abs=1e-6)  # one token for every image


def run_evals(obj, engine, batch, targets: torch.Tensor | None, evals: int, run_dir) -> list:
    """`evals` rounds of a training micro batch (its teacher targets `targets`, or the real ones) and an
    evaluation: the EvalResults."""
    k = obj.cfg.dino.head_n_prototypes
    if targets is not None:
        teacher_outputs(obj, lambda out: (obj.teacher_temp(obj.step) * targets.log()).expand(len(out), k)
                        .to(out.dtype))
    results = []
    for _ in range(evals):
        obj.before_step(engine, obj.step)
        obj.loss(engine, batch, torch.zeros(4), None)
        obj.after_step(engine, obj.step)
        results.append(obj.evaluate(engine, torch.float32, run_dir, obj.step))
    return results


class Batches(list):
    """A validation loader's batches (images, targets, valid), with its `failure` (none)."""

    failure = None


def make():
    obj = objective("dino.mask_probability=1.0", "dino.collapse_evals=2")
    model = obj.build_all(obj.model_kwargs())
    obj.val_loader = Batches([(torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(i)), torch.zeros(8),
                       torch.ones(8, dtype=torch.bool)) for i in range(2)])
    engine = FakeEngine(model, [{"decay": True, "weight_decay": 0.04}])
    view = obj.train_view(obj.model_kwargs()).sample
    batch = tuple(torch.stack(part) for part in zip(*[view(image(i), i) for i in range(4)]))
    return obj, engine, batch


@pytest.fixture
def setup():
    return make()


def test_uniform_targets_warn_after_two_evaluations_in_the_log_a_metric_and_a_file(setup, tmp_path):
    obj, engine, batch = setup
    uniform = torch.full((obj.cfg.dino.head_n_prototypes,), 1 / obj.cfg.dino.head_n_prototypes)
    results = run_evals(obj, engine, batch, uniform, 3, tmp_path)
    assert [r.metrics["eval/collapse_warning"] for r in results] == [0.0, 1.0, 1.0]
    assert results[0].metrics["eval/teacher_entropy"] == pytest.approx(math.log(64), rel=1e-4)
    assert "warning" not in results[0].line
    assert "warning: collapse: the teacher's target entropy has been 4.159 nats, at the uniform log 64" in \
        results[1].line
    assert (tmp_path / "warnings" / f"collapse_step{obj.step:08d}.txt").is_file()
    assert any(folder == "warnings" for _, folder in results[2].artifacts)


def test_varied_targets_and_real_class_tokens_never_warn(setup, tmp_path):
    obj, engine, batch = setup
    k = obj.cfg.dino.head_n_prototypes
    # Entropy about 2.9 of log 64 = 4.16 nats, as test_dino.py's 2-rank run at step 12.
    varied = torch.distributions.Dirichlet(torch.full((k,), 0.1)).sample(torch.Size([])).clamp_min(1e-12)
    results = run_evals(obj, engine, batch, varied / varied.sum(), 4, tmp_path)
    assert [r.metrics["eval/collapse_warning"] for r in results] == [0.0] * 4
    assert all(1.5 < r.metrics["eval/effective_rank"] <= 16 for r in results), [r.line for r in results]
    assert not (tmp_path / "warnings").exists()


def test_class_tokens_at_one_point_warn_and_the_count_survives_a_resume(setup, tmp_path):
    obj, engine, batch = setup
    backbone = obj.teacher.backbone
    real = backbone.forward_tokens

    def one_token(images, *args):  # every image's class token the same: complete collapse
        out = real(images, *args)
        return out._replace(cls_token=torch.ones_like(out.cls_token))

    backbone.forward_tokens = one_token
    first = run_evals(obj, engine, batch, None, 1, tmp_path)[0]
    assert first.metrics["eval/effective_rank"] == pytest.approx(1.0, abs=1e-6)
    assert first.metrics["eval/collapse_warning"] == 0.0
    state = obj.state_dict()
    resumed = make()[0]
    resumed.load_state_dict(state)
    resumed.teacher.backbone.forward_tokens = one_token
    again = run_evals(resumed, engine, batch, None, 1, tmp_path)[0]
    assert again.metrics["eval/collapse_warning"] == 1.0
    assert "effective rank of the teacher's class tokens has been 1.00 (collapse: 1) for 2 evaluations" in again.line
