"""Distillation (`model.objective: distill`): a frozen teacher from any source into a student ViT (objective.py)."""

from pipeline.objectives.distill.objective import Distill

__all__ = ["Distill"]
