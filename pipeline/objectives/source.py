"""Where a source of weights is found, and what it is: a run directory (its config.yaml, its recipe) or a weights
file, as every command that reads one names it (`launch/finetune.py --from`, `launch/evaluate.py`, a distillation's
`distill.teacher`). Below pipeline/run/ so that an objective reads a source too (pipeline/objectives/backbone.py)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import Config, ConfigFiles, ModelConfig
from pipeline.model.variants import DINOV3_VARIANTS, VARIANTS, variant_kwargs
from pipeline.model.vit import VisionTransformer, architecture
from pipeline.model.weights import NotWeightsFile, WeightsError, weights_format
from pipeline.objectives.base import Objective
from pipeline.train import checkpoint as ckpt

# What a fine-tune sets itself of the model's architecture: the resolution (the position table is resized), the
# classes (a new head), the pre-logits (dropped, as the paper), the pooling (the recipe's) and the input channels
# (its data set's, pipeline/data/pixels.py; RGB weights into other channels: issue 62, not yet).
FINETUNE_DECIDES = ("img_size", "num_classes", "representation_size", "global_pool", "in_chans")
# What it takes from its source: the rest of the model's architecture keys that the run config has (the
# source's config.yaml, or what a Meta file's tensors say), and the variant that names them.
ARCH_KEYS = ("variant", *(k for k in VisionTransformer.ARCH_KEYS
                          if k in {f.name for f in dataclasses.fields(ModelConfig)} and k not in FINETUNE_DECIDES))


def objective_of_run(cfg: Config | None) -> type[Objective]:
    """The objective class a run directory's config.yaml names (`cfg`, None when the run has none: a model
    trained before runs recorded one, read as the plain model): which `weights_from_checkpoint` reads a run
    stopped before its export (`launch/finetune.py --from RUN_DIR`, `launch/export_weights.py`)."""
    return type(cfg).recipes[cfg.model.objective].objective() if cfg is not None else Objective


@dataclass
class Source:
    path: Path  # what the user named
    config: Config | None  # the source run's config, when known


def find_source(source: str, files: ConfigFiles, flag: str = "--from") -> Source:
    """The source `--from` names, and its run's config.yaml when it has one (read through `files`, the run configs
    of every recipe: `pipeline.objectives.config_files()`, or `ConfigFiles(type(cfg))` inside an objective).
    `flag`: how the command names the source in its messages ('': a positional argument)."""
    path = Path(source).expanduser()
    named = f"{flag} '{source}'" if flag else f"'{source}'"
    if not path.exists():
        raise WeightsError(f"{named}: no such run directory or weights file")
    if path.is_file():
        try:
            weights_format(path)
        except NotWeightsFile as e:
            raise WeightsError(f"{named} is not a weights file: {e}") from None
    folder = path if path.is_dir() else path.parent
    config = files.load(folder / "config.yaml") if (folder / "config.yaml").is_file() else None
    if path.is_dir() and not (path / "model.safetensors").is_file() and ckpt.newest_complete_tag(path) is None:
        raise WeightsError(f"{named}: a directory without model.safetensors or a complete checkpoint in checkpoints/")
    return Source(path.resolve(), config)


def meta_arch_config(arch: dict) -> dict:
    """ModelConfig fields for the architecture `convert_dinov2_state_dict` read from a Meta file, every
    architecture key explicit, and the variant of `VARIANTS` that has that architecture (for the name in
    config.yaml); a file no variant matches (a width Meta did not release) is named after the variant of its
    patch size and registers nearest in width, which its explicit keys override. A DINOv3 ViT's architecture
    (`layouts_dinov3.dinov3_arch`) names its variant already."""
    arch = {"stem": "patch", **arch}  # Meta's and timm's files patchify (their layouts do not say it)
    keys = [k for k in ARCH_KEYS if k != "variant"]
    if "variant" in arch:  # a DINOv3 ViT's (layouts_dinov3.dinov3_arch) names its variant already
        return {k: arch[k] for k in ARCH_KEYS}

    def same(a: Any, b: Any) -> bool:  # mlp_ratio is a ratio of integers: ViT-g's 5.33333 vs the preset's 5.33334
        return math.isclose(a, b, rel_tol=1e-4) if isinstance(a, float) and isinstance(b, float) else a == b

    presets = {v: architecture(VisionTransformer, variant_kwargs(v)) for v in VARIANTS if v not in DINOV3_VARIANTS}
    exact = [v for v, a in presets.items() if all(same(a[k], arch[k]) for k in keys)]
    kin = [v for v, a in presets.items() if (a["patch_size"], a["reg_tokens"]) == (arch["patch_size"], arch["reg_tokens"])]
    variant = exact[0] if exact else min(kin or presets, key=lambda v: abs(presets[v]["embed_dim"] - arch["embed_dim"]))
    return dict(variant=variant, **{k: arch[k] for k in keys})
