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


def build_objective(cfg: Config, info: Any) -> Objective:
    """The objective model.objective names, for this run config and data set."""
    return OBJECTIVES[cfg.model.objective](cfg, info)


__all__ = ["OBJECTIVES", "EvalResult", "Objective", "build_objective"]
