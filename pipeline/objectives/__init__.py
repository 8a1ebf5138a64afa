"""Training objectives: what differs between recipes (`base.Objective`), registered by model.objective.

This module is light (no torch, no DeepSpeed): it lists each recipe's declaration (`recipe.Recipe`: its
name, its config section and checks), so that a command reads and checks its whole run config before
torch is imported; a recipe's Objective class is imported when a run builds it (`OBJECTIVES[name]`).

Each recipe is a folder, <name>/, of one shape: objective.py (the `Objective` subclass, imported when a run
builds it), config.py (its config section, checks and `RECIPE`: no torch, no DeepSpeed, no import of the
objective), an __init__.py that imports nothing (so that reading <name>/config.py loads nothing more), and
what else the recipe needs beside them. Adding one: copy a folder and add one line in RECIPES below
(docs/objectives.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pipeline import config
from pipeline.config import Config, ConfigFiles
from pipeline.eval.sets_config import EvalConfig, eval_checks
from pipeline.objectives.adapt import AdaptConfig, adapt_checks
from pipeline.objectives.dino import config as dino_config
from pipeline.objectives.dinov3 import config as dinov3_config
from pipeline.objectives.distill import config as distill_config
from pipeline.objectives.mae import config as mae_config
from pipeline.objectives.recipe import Recipe, objectives_config
from pipeline.objectives.supervised import config as supervised_config
from pipeline.typed_yaml import describe

RECIPES: dict[str, Recipe] = {r.name: r for r in (
    supervised_config.RECIPE,
    mae_config.RECIPE,
    dino_config.RECIPE,
    dinov3_config.RECIPE,
    distill_config.RECIPE,
)}

ObjectivesConfig = objectives_config(RECIPES.values(), [("eval", EvalConfig, eval_checks),
                                                       ("adapt", AdaptConfig, adapt_checks)])
"""The run config: the core sections (pipeline.config.Config), every recipe's own, eval (eval.sets) and adapt
(a start from a foundation model's weights: adapt.py)."""


class _Objectives(Mapping[str, type]):
    """model.objective -> its Objective class, imported on first use."""

    def __getitem__(self, name: str) -> type:
        return RECIPES[name].objective()

    def __iter__(self) -> Iterator[str]:
        return iter(RECIPES)

    def __len__(self) -> int:
        return len(RECIPES)


OBJECTIVES: Mapping[str, type] = _Objectives()


def build_objective(cfg: Config, info: Any) -> Any:
    """The objective model.objective names, for this run config and data set."""
    return OBJECTIVES[cfg.model.objective](cfg, info)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """A run config (`pipeline.config.load_config` with every recipe's section): strict, one-line errors."""
    return config.load_config(path, overrides, ObjectivesConfig)


def load_or_exit(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """`load_config` for launchers: a user error prints one line and exits with code 2."""
    return config.load_or_exit(path, overrides, ObjectivesConfig)


def config_files() -> ConfigFiles:
    """The config files one command reads, each once, as run configs (pipeline.config.ConfigFiles)."""
    return ConfigFiles(ObjectivesConfig)


def reference_markdown() -> str:
    """docs/configuration.md's reference table (launch/config_reference.py --update writes it): every key of a
    run config, the recipes' sections included, its default and its docstring."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    for key, default, doc in describe(ObjectivesConfig):
        lines.append(f"| `{key}` | `{default}` | {doc.replace('|', '/')} |")
    return "\n".join(lines)


__all__ = ["OBJECTIVES", "RECIPES", "ObjectivesConfig", "Recipe", "build_objective", "config_files", "load_config",
           "load_or_exit", "reference_markdown"]
