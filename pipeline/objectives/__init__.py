"""Training objectives: what differs between recipes (`base.Objective`), registered by model.objective.

Adding one: a module here with an `Objective` subclass, its config section, and one line below
(docs/objectives.md).
"""

from __future__ import annotations

from typing import Any

from pipeline.config import Config
from pipeline.objectives.base import EvalResult, Objective
from pipeline.objectives.dino import DINOv2
from pipeline.objectives.mae import MAE
from pipeline.objectives.supervised import Supervised

OBJECTIVES: dict[str, type[Objective]] = {
    "supervised": Supervised,
    "mae": MAE,
    "dinov2": DINOv2,
}


def objective_of_run(cfg: Config | None) -> type[Objective]:
    """The objective class a run directory's config.yaml names (`cfg`, None when the run has none: a model
    trained before runs recorded one, read as the plain model): which `weights_from_checkpoint` reads a run
    stopped before its export (`launch/finetune.py --from RUN_DIR`, `launch/export_weights.py`)."""
    return OBJECTIVES[cfg.model.objective] if cfg is not None else Objective


def build_objective(cfg: Config, info: Any) -> Objective:
    """The objective model.objective names, for this run config and data set."""
    return OBJECTIVES[cfg.model.objective](cfg, info)


__all__ = ["OBJECTIVES", "EvalResult", "Objective", "build_objective", "objective_of_run"]
