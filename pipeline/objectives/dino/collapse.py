"""Collapse monitoring for self-distillation (DINOv2, DINOv3): figures of the teacher at every evaluation,
each with the value it takes when the teacher has collapsed, and a warning when one has sat there for
`collapse_evals` evaluations in a row. The rule is stated here, once (docs/dino.md, Collapse, says it in
words); K prototypes, tol = `collapse_tolerance` (0.01), f = `collapse_stall_fraction` (0.95), D the width:

    uniform        H >= (1 - tol) log K        every image gets the same flat target: the DINO term
                                               teaches nothing
    one prototype  H_B <= tol log K            every image's target sits on one prototype
    stall          H >= f log K, and neither H nor L fell by more than tol (relatively) since the previous
                   evaluation                  targets that barely tell images apart, and nothing sharpens
                                               them
    rank           effective rank <= 1 + tol (D - 1)   every image gets the same class token

    H     the mean entropy of the teacher's DINO target per sample, over the training micro batches since
          the last evaluation (`train/dino_teacher_entropy` is the same per log window; eval/teacher_entropy)
    H_B   the entropy of the teacher's DINO targets averaged over each step's global batch (how the batch's
          mass spreads over the prototypes), averaged over the steps since the last evaluation
          (eval/teacher_batch_entropy); with centring only: Sinkhorn-Knopp spreads it over every prototype by
          construction
    L     the training loss (every term), its mean over the micro batches since the last evaluation
    rank  exp of the entropy of the normalised singular values of the teacher's L2-normalised class tokens
          over the validation pass (Roy & Vetterli 2007; RankMe, Garrido et al. 2023, judges SSL features
          without labels by it)

Why the stall: a run that learns sharpens its targets (H falls well below log K: tests/integration/
test_dino.py's 2-rank run is at 2.94 of log 64 = 4.16 nats, 71%, at step 12); a run that has stalled keeps
them near uniform and stops moving. Issue 69's DINOv2 run on Fashion-MNIST sat at 6.77 of log 1024 = 6.93
nats (98%) with its loss flat at 10.2 and its k-NN unmoved for 900 steps, below the uniform line of 99% and
so silent under that rule alone. Near uniform alone is not enough: a run may start near uniform and sharpen
from there (at initialisation the head's outputs differ little between images, docs/dino.md), so the stall
asks for both figures to stand still too; a falling loss under flat DINO targets is the other terms (iBOT,
KoLeo, Gram) still teaching, which the k-NN judges. At 95% the targets are within 0.05 log K nats (their KL
divergence to uniform) of carrying nothing; the no-local-crop ablation of issue 69 (6.23 of 6.93 nats, 90%,
its k-NN still climbing) stays below it. The first evaluation of a run has nothing to compare with, so a
stall warns at the (collapse_evals + 1)-th evaluation at the earliest.

The warning is said once per episode: at the evaluation where a figure's count reaches `collapse_evals`
(the log line, and a file under the run's warnings/), while eval/collapse_warning stays 1 for as long as
any count is at or above it. A stall is not said while a uniform episode is on (that warning says more).
Every figure is summed on the device during the steps and read with the evaluation's own read: a training
step reads nothing more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

FIGURES = ("entropy", "prototype", "stall", "rank")  # the counts' names ("entropy": the uniform rule)


def effective_rank(gram: torch.Tensor) -> float:
    """The effective rank of a feature matrix X (M, D) from its D x D Gram matrix X^T X (summable over batches
    and ranks: the singular values of X are the square roots of its eigenvalues); 0 for X = 0."""
    sigma = torch.linalg.eigvalsh(gram.double()).clamp_min(0).sqrt()
    if sigma.sum() <= 0:
        return 0.0
    return math.exp(float(torch.special.entr(sigma / sigma.sum()).sum()))


class ClassTokenGram:
    """X^T X of the L2-normalised class tokens of an evaluation pass, summed on the device batch by batch
    (padding rows left out) and over the ranks at the end: the effective rank of the whole pass, on any layout."""

    def __init__(self) -> None:
        self.gram: torch.Tensor | None = None

    def add(self, tokens: torch.Tensor, valid: torch.Tensor) -> None:
        x = tokens.double() * valid.to(tokens.device, torch.float64).unsqueeze(1)
        self.gram = x.T @ x if self.gram is None else self.gram + x.T @ x

    def effective_rank(self) -> float:
        """Collective: every rank calls it (every rank ran the same number of batches: nan after none)."""
        if self.gram is None:
            return math.nan
        if dist.is_initialized():
            dist.all_reduce(self.gram)
        return effective_rank(self.gram)


@dataclass
class Figures:
    """What an evaluation measured (module docstring): None where nothing was (no training step since the
    last evaluation; H_B under Sinkhorn-Knopp)."""

    entropy: float | None  # H
    rank: float
    width: int  # D
    batch_entropy: float | None = None  # H_B
    loss: float | None = None  # L

    @classmethod
    def of_sums(cls, sums: dict[str, float], rank: float, width: int) -> Figures:
        """The figures from the objective's sums since the last evaluation (DINOv2.SINCE: entropy, micro_batches,
        loss, batch_entropy, steps); a mean over nothing, or not finite, is None."""
        def mean(name: str, count: str) -> float | None:
            value = sums[name] / sums[count] if sums[count] > 0 else math.nan
            return value if math.isfinite(value) else None

        return cls(mean("entropy", "micro_batches"), rank, width, mean("batch_entropy", "steps"),
                   mean("loss", "micro_batches"))


def write_warning(run_dir: Path, step: int, warning: str) -> Path:
    """run_dir/warnings/collapse_stepNNNNNNNN.txt: what MLflow shows under Artifacts, warnings/, beside
    eval/collapse_warning = 1."""
    path = run_dir / "warnings" / f"collapse_step{step:08d}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"step {step}: {warning}\n")
    return path


@dataclass
class CollapseMonitor:
    """How many evaluations in a row each figure has been at its collapse value, and the figures of the last
    evaluation (state: saved and resumed with the objective); the warning when a count reaches `evals` (0:
    never). `section`: the config section the advice names (dino, dinov3)."""

    prototypes: int
    evals: int = 2
    tolerance: float = 0.01
    stall_fraction: float = 0.95
    section: str = "dino"
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FIGURES, 0))
    last: dict[str, float | None] = field(default_factory=lambda: {"entropy": None, "loss": None})

    def collapsed(self, f: Figures) -> dict[str, bool]:
        """Whether each figure is at its collapse value now (the module docstring's rule)."""
        log_k, tol = math.log(self.prototypes), self.tolerance
        before_h, before_l = self.last.get("entropy"), self.last.get("loss")
        standing = (f.entropy is not None and f.loss is not None and before_h is not None and before_l is not None
                    and f.entropy >= before_h - tol * abs(before_h) and f.loss >= before_l - tol * abs(before_l))
        return {"entropy": f.entropy is not None and f.entropy >= (1 - tol) * log_k,
                "prototype": f.batch_entropy is not None and f.batch_entropy <= tol * log_k,
                "stall": standing and self.stall_fraction < 1 and f.entropy >= self.stall_fraction * log_k,
                "rank": f.rank <= 1 + tol * (f.width - 1)}

    @property
    def active(self) -> bool:
        """A collapse episode is on (eval/collapse_warning = 1): some count at `evals` or above."""
        return bool(self.evals) and max(self.counts.values()) >= self.evals

    def update(self, f: Figures) -> str | None:
        """Count this evaluation; the warning to say now (None: none), once per episode."""
        for name, hit in self.collapsed(f).items():
            self.counts[name] = self.counts.get(name, 0) + 1 if hit else 0
        self.last = {"entropy": f.entropy, "loss": f.loss}
        if not self.evals:
            return None
        new = [name for name, n in self.counts.items() if n == self.evals]
        if "stall" in new and self.counts["entropy"] >= self.evals:
            new.remove("stall")  # uniform is said (or was): the stall says nothing more
        if not new:
            return None
        return "collapse: " + "; ".join(self._said(name, f) for name in new) + " (docs/dino.md, Collapse)"

    def _said(self, name: str, f: Figures) -> str:
        """One figure's warning: what was measured, what it means, the settings to look at."""
        k, log_k, n, s = self.prototypes, math.log(self.prototypes), self.counts[name], self.section
        flat_targets = (f"look at {s}.teacher_temp (lower: sharper targets), {s}.head_n_prototypes against the "
                        f"global batch, {s}.momentum_teacher, the crops ({s}.global_crops_scale, "
                        f"{s}.local_crops_number, {s}.local_crops_scale) and train.lr")
        if name == "entropy":
            return (f"the teacher's target entropy has been {f.entropy:.3f} nats, at the uniform log {k} = "
                    f"{log_k:.3f}, for {n} evaluations: every image gets the same flat target, so the DINO term "
                    f"teaches nothing; {flat_targets}")
        if name == "stall":
            return (f"the teacher's target entropy has been {f.entropy:.3f} nats, {f.entropy / log_k:.1%} of the "
                    f"uniform log {k} = {log_k:.3f} (a stall from {self.stall_fraction:.0%}), and neither it "
                    f"nor the loss (now {f.loss:.4g}) fell by {self.tolerance:.0%} from one evaluation to the "
                    f"next, for {n} evaluations: the targets barely tell images apart and nothing sharpens them, "
                    f"so the run has stalled; {flat_targets}")
        if name == "prototype":
            return (f"the entropy of the teacher's targets averaged over each batch has been "
                    f"{f.batch_entropy:.3f} nats (one prototype: 0; every prototype: log {k} = {log_k:.3f}) for "
                    f"{n} evaluations: every image's target sits on the same prototype; look at "
                    f"{s}.teacher_temp and {s}.warmup_teacher_temp (too low: one prototype takes the mass before "
                    f"the centre catches up) and train.lr")
        # What the other terms (iBOT, KoLeo, Gram) still do shows in the k-NN, not here.
        return (f"the effective rank of the teacher's class tokens has been {f.rank:.2f} (collapse: 1) for {n} "
                f"evaluations: every image gets the same class token; look at train.lr, train.warmup_steps, "
                f"{s}.koleo_loss_weight and {s}.momentum_teacher")

    def state_dict(self) -> dict[str, object]:
        return {**self.counts, "last": dict(self.last)}

    def load_state_dict(self, state: dict[str, object] | None) -> None:
        """Also a checkpoint written before the stall and one-prototype figures (counts of entropy and rank only)."""
        state = dict(state or {})
        last = state.pop("last", None) or {}
        self.counts = {**dict.fromkeys(FIGURES, 0), **state}
        self.last = {"entropy": last.get("entropy"), "loss": last.get("loss")}
