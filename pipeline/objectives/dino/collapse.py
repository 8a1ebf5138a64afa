"""Collapse monitoring for self-distillation (DINOv2): two figures of the teacher at every evaluation, each
with the value it takes when the teacher has collapsed, and a warning when either has sat at that value for
`dino.collapse_evals` evaluations in a row.

    target entropy   the mean entropy of the teacher's DINO targets over the training micro batches since the
                     last evaluation (`train/dino_teacher_entropy` is the same per log window). Uniform
                     collapse (every image gets the same flat target): log K for K prototypes.
    effective rank   exp of the entropy of the normalised singular values of the teacher's L2-normalised
                     class tokens over the validation pass (Roy & Vetterli 2007; RankMe, Garrido et al. 2023,
                     judges SSL features without labels by it). Complete collapse (one token for every
                     image): 1.

"At its collapse value" is within `dino.collapse_tolerance` of it, relatively: entropy >= (1 - tol) log K, and
effective rank <= 1 + tol x (D - 1) for width D. The DINOv2 digits demo's teacher entropy is 6.91 of
log 1024 = 6.93 nats at step 200 and 6.925 at step 600 (docs/dino.md), above (1 - 0.01) log 1024 = 6.86.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


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
class CollapseMonitor:
    """How many evaluations in a row each figure has been at its collapse value (state: saved and resumed
    with the objective), and the warning once either count reaches `evals` (0: never)."""

    prototypes: int
    evals: int = 2
    tolerance: float = 0.01
    counts: dict[str, int] = field(default_factory=lambda: {"entropy": 0, "rank": 0})

    def collapsed(self, entropy: float | None, rank: float, width: int) -> dict[str, bool]:
        """Whether each figure is at its collapse value (no entropy: no training step since the last check)."""
        return {"entropy": entropy is not None and entropy >= (1 - self.tolerance) * math.log(self.prototypes),
                "rank": rank <= 1 + self.tolerance * (width - 1)}

    def update(self, entropy: float | None, rank: float, width: int) -> str | None:
        """Count this evaluation; the warning to give (None: none)."""
        for name, hit in self.collapsed(entropy, rank, width).items():
            self.counts[name] = self.counts[name] + 1 if hit else 0
        if not self.evals or max(self.counts.values()) < self.evals:
            return None
        said = []
        if self.counts["entropy"] >= self.evals:
            said.append(f"the teacher's target entropy has been {entropy:.3f} nats, at the uniform log "
                        f"{self.prototypes} = {math.log(self.prototypes):.3f}, for {self.counts['entropy']} "
                        f"evaluations: every image gets the same flat target, so the DINO term teaches nothing")
        if self.counts["rank"] >= self.evals:
            said.append(f"the effective rank of the teacher's class tokens has been {rank:.2f} (collapse: 1) for "
                        f"{self.counts['rank']} evaluations: every image gets the same class token")
        # What the other terms (iBOT, KoLeo, Gram) still do shows in the k-NN, not here.
        return "collapse: " + "; ".join(said) + " (docs/dino.md, Collapse)"

    def state_dict(self) -> dict[str, int]:
        return dict(self.counts)

    def load_state_dict(self, state: dict[str, int] | None) -> None:
        self.counts = {"entropy": 0, "rank": 0, **(state or {})}
