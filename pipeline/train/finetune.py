"""Fine-tuning: load pretrained weights at a new resolution with a fresh zero head (the paper, Sec. 3.2).

`--from` may name
  - a pretraining run directory: its model.safetensors + config.yaml, or, for a run that was stopped
    before exporting, its latest DeepSpeed checkpoint (consolidated to fp32 here);
  - a .safetensors file (ours, or timm's, e.g. `vit_base_patch16_224`'s model.safetensors);
  - a timm-format .pth/.bin state dict, read with `torch.load(weights_only=True)`: nothing executes code.

The architecture (patch size, width, depth, heads) comes from the source's config.yaml when there is one;
the source's grid from its img_size (`finetune.source_img_size` for a bare file with a non-square grid);
the new grid from `--res`. Position embeddings are resized with `resize_pos_embed`, the class token kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from pipeline.config import Config, ConfigError, FinetuneConfig, image_size, load_config
from pipeline.model.pos_embed import resize_pos_embed
from pipeline.model.vit import VisionTransformer, _init_param
from pipeline.model.weights import WeightsError, load_weights
from pipeline.train import checkpoint as ckpt

ARCH_KEYS = ("variant", "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias")
HEAD_PREFIXES = ("head.", "pre_logits.")


@dataclass
class Source:
    path: Path  # what the user named
    config: Config | None  # the source run's config, when known


def find_source(source: str) -> Source:
    path = Path(source).expanduser()
    if not path.exists():
        raise WeightsError(f"--from '{source}': no such run directory or weights file")
    folder = path if path.is_dir() else path.parent
    config = load_config(folder / "config.yaml") if (folder / "config.yaml").is_file() else None
    if path.is_dir() and not (path / "model.safetensors").is_file() and ckpt.latest_tag(path) is None:
        raise WeightsError(f"--from '{source}': a directory without model.safetensors or checkpoints/latest")
    return Source(path, config)


def source_state_dict(src: Source) -> dict[str, torch.Tensor]:
    if src.path.is_file():
        return load_weights(src.path)
    if (src.path / "model.safetensors").is_file():
        return load_weights(src.path / "model.safetensors")
    return ckpt.consolidate(src.path)  # a run stopped before export: its newest checkpoint


def prepare_finetune(cfg: Config) -> tuple[Config, Callable[[nn.Module], dict[str, str]]]:
    """The fine-tune config with the source's architecture, and the hook that loads the weights."""
    if not cfg.finetune.source:
        raise ConfigError("fine-tuning needs a source: --from RUN_DIR | FILE.safetensors | FILE.pth")
    src = find_source(cfg.finetune.source)
    model_cfg, source_img_size = cfg.model, cfg.finetune.source_img_size
    if src.config is not None:
        arch = {k: getattr(src.config.model, k) for k in ARCH_KEYS}
        model_cfg = dataclasses.replace(model_cfg, **arch)
        source_img_size = source_img_size or src.config.model.img_size
    # The paper replaces the pretraining head (and its tanh pre-logits) with one zero-initialised Linear.
    model_cfg = dataclasses.replace(model_cfg, representation_size=None)
    cfg = dataclasses.replace(cfg, model=model_cfg,
                              finetune=FinetuneConfig(source=str(src.path), source_img_size=source_img_size))
    return cfg, lambda model: load_pretrained(model, src, source_img_size)


def load_pretrained(model: VisionTransformer, src: Source, source_img_size) -> dict[str, str]:
    """Copy the source trunk into `model` (resizing position embeddings), zero the head. ZeRO-3 safe."""
    state = {k: v for k, v in source_state_dict(src).items() if not k.startswith(HEAD_PREFIXES)}
    new_grid = model.grid_size
    patch = model.patch_embed.patch_size[0]
    old_tokens = state["pos_embed"].shape[1] - model.num_prefix_tokens if "pos_embed" in state else 0
    if "pos_embed" in state:
        if source_img_size is not None:
            h, w = image_size(source_img_size)
            old_grid = (h // patch, w // patch)
        else:
            old_grid = None  # a bare file: square grid inferred from the token count
        state["pos_embed"] = resize_pos_embed(state["pos_embed"], new_grid, model.num_prefix_tokens, old_grid)

    expected = {name: tuple(p.ds_shape if hasattr(p, "ds_shape") else p.shape)
                for name, p in model.named_parameters() if not name.startswith(HEAD_PREFIXES)}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise WeightsError(f"{src.path}: missing parameters {', '.join(missing)}")
    if unexpected:
        _say(f"warning: {src.path}: ignoring parameters the model does not have: {', '.join(unexpected)}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise WeightsError(f"{src.path}: parameter '{name}' has shape {tuple(state[name].shape)}, the model "
                               f"expects {shape} (check the variant/patch size in the fine-tune config)")

    params = dict(model.named_parameters())
    for name in expected:
        _init_param(params[name], _copier(state[name]))
    # Zero head: the fine-tune starts from the pretrained features with all logits 0.
    _init_param(model.head.weight, nn.init.zeros_)
    _init_param(model.head.bias, nn.init.zeros_)
    _say(f"loaded {len(expected)} tensors from {src.path}; position embeddings {old_tokens} -> "
         f"{new_grid[0]}x{new_grid[1]} grid tokens; new zero head with {model.num_classes} classes")
    return {}


def _copier(value: torch.Tensor) -> Callable[[torch.Tensor], object]:
    return lambda target: target.copy_(value.to(target.dtype))


def _say(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)
