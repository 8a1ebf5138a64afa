"""Supervised classification's declaration, light (read with the config, before torch): the recipe
`model.objective: supervised`, the default. It has no section of its own: data.* and train.* are its."""

from __future__ import annotations

from pipeline.objectives.recipe import Recipe


def _objective() -> type:
    # When a run builds it: the config is read before torch.
    from pipeline.objectives.supervised.objective import Supervised

    return Supervised


RECIPE = Recipe("supervised", _objective)
