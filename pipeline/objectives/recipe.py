"""What a recipe declares before torch is imported: its name (model.objective's value), its config
section and the checks a run of it needs, and how to import its Objective class.

Each objective declares one `Recipe` in its light module (<name>/config.py: no torch, no DeepSpeed), and
pipeline/objectives/__init__.py lists them. The run config is the core sections (pipeline.config.Config)
plus every recipe's section (`objectives_config`), so a typo in `mae.mask_ratio` is reported as soon as the
command has read its config, before the seconds that importing torch takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from pipeline.config import Check, Config


@dataclass(frozen=True)
class ReadBack:
    """How the backbone a run of the recipe exports is read back outside training (pipeline/run/backbone.py, for
    launch/evaluate.py, embed.py and export_weights.py): the class it is, the names its weights are in, and what
    the recipe built it with beyond model.*. tests/unit/test_recipe_matrix.py runs every command on every recipe."""

    model: Literal["variant", "vit", "dinov3"] = "variant"
    """'vit': pipeline.model.vit.VisionTransformer; 'dinov3': pipeline.model.dinov3.DINOv3ViT (RoPE, storage
    tokens); 'variant': the class model.variant builds (a supervised run, or a fine-tune, of either)."""
    keys: Literal["model", "mae"] = "model"
    """Its weights' names: 'model' the class's own (a DINO run's backbone adds iBOT's mask_token, left out);
    'mae' MaskedAutoencoderViT's (the encoder read, the decoder left out; the fixed sin-cos position table
    rebuilt where a checkpoint, which holds parameters only, lacks it)."""
    kwargs: tuple[tuple[str, Any], ...] = ()
    """Constructor arguments beyond model.* that the recipe builds its backbone with (DINOv2's position table
    interpolated at forward time, for its local crops)."""


@dataclass(frozen=True)
class Recipe:
    name: str
    """model.objective's value."""
    objective: Callable[[], type]
    """The Objective subclass, imported when a run builds it (not when the config is read)."""
    section: str | None = None
    """The config section the recipe owns (mae, dino), or None."""
    config: type | None = None
    """That section's dataclass: every field a docstring (docs/configuration.md's reference follows)."""
    checks: Callable[[Any], list[Check]] = lambda _cfg: []
    """`validate`'s checks a run config needs for this recipe (its section's values, keys of other sections
    it cannot run with), given the whole config; each recipe's are checked whatever model.objective is, so
    its own conditions say when a check applies."""
    finetune_recipe: Callable[[str], str] | None = None
    """The fine-tune recipe (a config file, by the source's model.variant) for a source pretrained with this
    recipe when `launch/finetune.py` has no --config; None: the paper's (pipeline/commands.py)."""
    finetune_data: tuple[str, ...] = ()
    """data.* keys such a fine-tune takes from its recipe rather than from the source (its augmentation)."""
    more_sections: tuple[tuple[str, type], ...] = ()
    """Further sections the recipe owns, (key, dataclass) each (DINOv3's `gram`)."""
    continue_key: str | None = None
    """The config key `launch/pretrain.py --from RUN_DIR` sets: the recipe continues a finished run of its own
    (DINOv3's later stages, dinov3.continue_from); None: the recipe does not continue runs."""
    read_back: ReadBack = ReadBack()
    """How its backbone is read back after training (evaluate, embed, the timm and ONNX exports)."""


def objectives_config(recipes: Iterable[Recipe],
                      sections: Iterable[tuple[str, type, Callable[[Any], list[Check]]]] = ()) -> type[Config]:
    """The run config class: `Config`'s core sections, then each recipe's section (its key, its dataclass,
    its defaults), then `sections` that belong to no recipe (key, dataclass, checks: eval), and
    `section_checks` giving model.objective's check, every recipe's and every section's, and `recipes` (name ->
    Recipe): what a config says of its recipe without importing the registry (a reader inside an objective, as a
    distillation's teacher, would close a loop through pipeline/objectives/__init__.py)."""
    recipes, sections = list(recipes), list(sections)
    names = [r.name for r in recipes]

    def section_checks(cfg: Config) -> list[Check]:
        return [("model.objective", cfg.model.objective in names, "one of " + ", ".join(repr(n) for n in names)),
                *(check for r in recipes for check in r.checks(cfg)),
                *(check for _, _, checks in sections for check in checks(cfg))]

    fields = [(r.section, r.config, dataclasses.field(default_factory=r.config))
              for r in recipes if r.section is not None]
    fields += [(key, section, dataclasses.field(default_factory=section)) for r in recipes for key, section in r.more_sections]
    fields += [(key, section, dataclasses.field(default_factory=section)) for key, section, _ in sections]
    cls = dataclasses.make_dataclass("ObjectivesConfig", fields, bases=(Config,),
                                     namespace={"section_checks": section_checks,
                                                "recipes": {r.name: r for r in recipes}})
    cls.__module__ = "pipeline.objectives"  # where it is bound (pickled by that name)
    cls.__doc__ = "The run config: the core sections and every objective's own (pipeline/objectives/recipe.py)."
    return cls
