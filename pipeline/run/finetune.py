"""Fine-tuning: load pretrained weights at a new resolution with a fresh zero head (the paper, Sec. 3.2).

`--from` may name
  - a pretraining run directory: its model.safetensors + config.yaml, or, for a run that was stopped
    before exporting, what it would have exported at its newest complete checkpoint, as its objective reads
    it (`Objective.weights_from_checkpoint`: the model consolidated to fp32, a DINOv2 run's teacher
    backbone), its files read with `weights_only=True` and DeepSpeed's own few types
    (`ds_compat.no_code_from_pickles`);
  - a weights file, its format told by its bytes (`weights.weights_format`: safetensors, torch.save's zip,
    a pickle; pickles read with `torch.load(weights_only=True)`: nothing executes code), its layout by its
    keys (`layouts.recognise`): ours, timm's ViT (e.g. `vit_base_patch16_224`'s model.safetensors), Meta's
    MAE pretraining checkpoint (the decoder left out), Meta's DINOv2 backbone (`dinov2_vitb14_pretrain.pth`:
    its architecture read from the tensors, its keys converted to ours), timm's DINOv3 ViT (its architecture
    read from the tensors; RoPE: no position table to resize).

The architecture (patch size, width, depth, heads) comes from the source's config.yaml when there is one,
from the file for Meta's DINOv2 and timm's DINOv3, else from the fine-tune's config, checked against the
file's patch, width and depth; the source's grid from its img_size (`finetune.source_img_size` for a bare
file with a non-square grid); the new grid from `--res`. Position embeddings are resized with
`resize_pos_embed`, the class token kept (a DINOv3 ViT has none: RoPE).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from pipeline.config import Config, ConfigError, ConfigFiles
from pipeline.derived import image_size
from pipeline.dist import say
from pipeline.model.channels import fit_in_chans
from pipeline.model.layers import init_param
from pipeline.model.layouts import is_ours, recognise
from pipeline.model.mae import sincos_pos_embed_2d
from pipeline.model.pos_embed import resize_pos_embed
from pipeline.model.variants import model_kwargs_from_config
from pipeline.model.vit import VisionTransformer
from pipeline.model.weights import (
    WeightsError,
    load_weights,
    weights_metadata,
)
from pipeline.objectives import config_files, source
from pipeline.objectives.source import (  # noqa: F401 - objective_of_run: read from here too
    ARCH_KEYS,
    FINETUNE_DECIDES,
    Source,
    meta_arch_config,
    objective_of_run,
)
from pipeline.run.resume import ResumePlan
from pipeline.train import checkpoint as ckpt
from pipeline.zero3 import real_shape

HEAD_PREFIXES = ("head.", "pre_logits.")


def find_source(src: str, files: ConfigFiles | None = None, flag: str = "--from") -> Source:
    """`pipeline.objectives.source.find_source`, with every recipe's run configs unless `files` is given."""
    return source.find_source(src, files or config_files(), flag)


def source_state_dict(src: Source) -> dict[str, torch.Tensor]:
    if src.path.is_file():
        return load_weights(src.path)
    if (src.path / "model.safetensors").is_file():
        return load_weights(src.path / "model.safetensors")
    # A run stopped before its export: what it would have exported at its newest complete checkpoint, which
    # its objective reads (a DINOv2 run's teacher backbone, not DeepSpeed's module, the student).
    tag = ckpt.newest_complete_tag(src.path)
    objective = objective_of_run(src.config)
    _say(f"--from {src.path}: no model.safetensors (the run stopped before its export): "
         f"{objective.checkpoint_weights} of its newest complete checkpoint, {tag}")
    return objective.weights_from_checkpoint(src.path, tag, src.config)


def prepare_finetune(cfg: Config, plan: ResumePlan | None, cli_model_keys: set[str] | frozenset[str] = frozenset(),
                     files: ConfigFiles | None = None) -> tuple[Config, Callable[[nn.Module], dict[str, str]] | None]:
    """The fine-tune config with the source's architecture, and the hook that loads the weights (None
    when `plan`, the run's start-or-resume plan from `resume.start`, resumes a checkpoint: it has the
    weights, and the source may have moved since). `cli_model_keys`: the model.* keys set on the command
    line; one the source decides is refused unless it agrees. `files`: the config files the command has read
    (its run directory's config.yaml, the source's), each read once; by default read here."""
    files = files or config_files()
    if not cfg.finetune.source:
        raise ConfigError("fine-tuning needs a source: --from RUN_DIR | FILE.safetensors | FILE.pth")
    model_cfg, source_img_size = cfg.model, cfg.finetune.source_img_size
    if plan is not None:  # a restart: the run's first start decided the model
        recorded = Path(cfg.run.dir) / "config.yaml"
        arch_from = files.load(recorded) if recorded.is_file() else None
        if arch_from is not None:
            _refuse_arch_overrides(cfg, arch_from, cli_model_keys, f"{recorded} (this run's first start)")
            model_cfg = dataclasses.replace(model_cfg, **{k: getattr(arch_from.model, k) for k in ARCH_KEYS})
            source_img_size = arch_from.finetune.source_img_size
        model_cfg = dataclasses.replace(model_cfg, representation_size=None)
        return dataclasses.replace(cfg, model=model_cfg, finetune=dataclasses.replace(
            cfg.finetune, source_img_size=source_img_size)), None
    src = find_source(cfg.finetune.source, files)
    if src.config is not None:  # the source's recorded architecture decides: refuse a contrary override first,
        _refuse_arch_overrides(cfg, src.config, cli_model_keys, f"--from {cfg.finetune.source}")  # before any read
    # Read before anything is written: a source that is refused (code in a pickle, not a state dict) leaves no
    # run directory, and no config.yaml recording it as this run's source for the next start to insist on.
    # Whose weights, by their keys: ours (a run directory, or our export's metadata), else whichever of
    # Meta's MAE, Meta's DINOv2 and timm's layouts they match (pipeline/model/layouts.py).
    found = recognise(source_state_dict(src), f"--from {src.path}",
                      ours=src.config is not None or (src.path.is_file() and is_ours(weights_metadata(src.path))))
    state = found.state
    if found.complete:  # Meta's DINOv2, a DINOv3 ViT: the file says the whole architecture
        source_model = dataclasses.replace(model_cfg, **meta_arch_config(found.arch))
        _refuse_arch_overrides(cfg, dataclasses.replace(cfg, model=source_model), cli_model_keys,
                               f"--from {cfg.finetune.source} ({found.layout})")
        model_cfg = dataclasses.replace(model_cfg, **{k: getattr(source_model, k) for k in ARCH_KEYS})
        source_img_size = source_img_size or found.arch.get("img_size")  # DINOv3: none (RoPE has no table)
        _say(f"--from {src.path}: {found.layout}, {describe_arch(found.arch)}"
             + (f"; left out: {found.left_out}" if found.left_out else ""))
    else:  # the file says patch, width and depth, not the heads: the architecture is the config's, checked
        if src.config is not None:
            arch = {k: getattr(src.config.model, k) for k in ARCH_KEYS}
            model_cfg = dataclasses.replace(model_cfg, **arch)
            source_img_size = source_img_size or src.config.model.img_size
        kwargs = model_kwargs_from_config(model_cfg, num_classes=1)
        problem = found.mismatch(kwargs)
        if problem:
            raise WeightsError(f"--from {src.path} ({found.layout}): {problem}")
        _say(f"--from {src.path}: {found.describe()}; {kwargs['num_heads']} heads (from "
             f"{'its config.yaml' if src.config is not None else 'the config: the file does not say'})")
    # The paper replaces the pretraining head (and its tanh pre-logits) with one zero-initialised Linear.
    # An MAE source fine-tunes its encoder as a supervised ViT (its decoder is not loaded).
    model_cfg = dataclasses.replace(model_cfg, representation_size=None, objective="supervised")
    probe = cfg.finetune.probe
    if probe and cfg.deepspeed.zero_stage == 3:
        raise ConfigError("finetune.probe (--probe) replaces the head after the model is built, which ZeRO-3 has "
                          "already partitioned: use deepspeed.zero_stage 0, 1 or 2 (the encoder is frozen anyway)")
    head_init = cfg.finetune.head_init
    if probe and head_init != "zero":
        raise ConfigError(f"finetune.head_init={head_init} with finetune.probe (--probe): the linear probe has a head of its "
                          f"own (BatchNorm, then a Linear drawn trunc-normal 0.01, as MAE's main_linprobe.py); "
                          f"leave finetune.head_init at zero")
    loaded = [state]  # handed to the hook once, not kept for the whole run
    del state
    cfg = dataclasses.replace(cfg, model=model_cfg, finetune=dataclasses.replace(
        cfg.finetune, source=str(src.path), source_img_size=source_img_size))
    fresh_patch = cfg.finetune.fresh_patch_embed
    return cfg, lambda model: load_pretrained(model, src, source_img_size, probe, state=loaded.pop(), head_init=head_init,
                                              fresh_patch_embed=fresh_patch)




def describe_arch(arch: dict) -> str:
    return (f"patch {arch['patch_size']}, width {arch['embed_dim']}, depth {arch['depth']}, {arch['num_heads']} heads, "
            f"{arch['mlp_layer']} MLP, LayerScale {'on' if arch['init_values'] else 'off'}, "
            f"{arch['reg_tokens']} registers" + (f", trained at {arch['img_size']} px" if arch.get("img_size") else ""))


def _refuse_arch_overrides(cfg: Config, source: Config, cli_model_keys, where: str) -> None:
    """An architecture key given on the command line that the source overrules would be ignored: refuse."""
    for key in ARCH_KEYS:
        if key in cli_model_keys and getattr(cfg.model, key) != getattr(source.model, key):
            raise ConfigError(f"model.{key}={getattr(cfg.model, key)} on the command line: a fine-tune takes its "
                              f"architecture from {where}, which has model.{key}={getattr(source.model, key)}; "
                              f"drop the override (or fine-tune from a bare weights file with a --config)")


def load_pretrained(model: VisionTransformer, src: Source, source_img_size, probe: bool = False,
                    state: dict[str, torch.Tensor] | None = None, head_init: str = "zero",
                    fresh_patch_embed: bool = False) -> dict[str, str]:
    """Copy the source trunk (`state`, else read from `src`) into `model` (resizing position embeddings, an RGB
    patch embedding adapted to the model's channels: pipeline/model/channels.py); the head zeroed (`head_init`
    'zero') or left as the model's init drew it ('model'). ZeRO-3 safe."""
    state = {k: v for k, v in (state if state is not None else source_state_dict(src)).items()
             if not k.startswith(HEAD_PREFIXES)}
    state, channels = fit_in_chans(state, real_shape(model.patch_embed.input_conv.weight)[1], str(src.path),
                                   fresh_patch_embed, name=model.patch_embed.input_weight_name)
    new_grid = model.grid_size
    patch = model.patch_embed.patch_size[0]
    if "pos_embed" not in state and src.config is not None and src.config.model.objective == "mae":
        # An MAE run's checkpoint (consolidated before export) holds parameters only; its position
        # embedding is the fixed sin-cos table of its grid.
        h, w = image_size(source_img_size or src.config.model.img_size)
        state["pos_embed"] = sincos_pos_embed_2d(model.embed_dim, (h // patch, w // patch))
    # The prefix rows of the position table: the class token's, unless the table covers the patches only
    # (no_embed_class: timm's layout of the register models; registers never have one).
    pos_prefix = 0 if model.no_embed_class else 1
    old_tokens = state["pos_embed"].shape[1] - pos_prefix if "pos_embed" in state else 0
    if "pos_embed" in state:
        if source_img_size is not None:
            h, w = image_size(source_img_size)
            old_grid = (h // patch, w // patch)
        else:
            old_grid = None  # a bare file: square grid inferred from the token count
        state["pos_embed"] = resize_pos_embed(state["pos_embed"], new_grid, pos_prefix, old_grid)

    # With global_pool='avg' (MAE's recipe) fc_norm replaces the final norm: a source pretrained with a
    # class token has none and fc_norm starts fresh at (1, 0), as the official fine-tuning does.
    fresh = HEAD_PREFIXES if any(k.startswith("fc_norm.") for k in state) else (*HEAD_PREFIXES, "fc_norm.")
    if fresh_patch_embed:  # the model's own draw (channels.py)
        fresh = (*fresh, model.patch_embed.input_weight_name)
    expected = {name: real_shape(p) for name, p in model.named_parameters() if not name.startswith(fresh)}
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
        init_param(params[name], _copier(state[name]))
    if probe:
        make_linear_probe(model)  # a head of its own (prepare_finetune refuses head_init=model with it)
        head = "linear probe head"
    elif head_init == "zero":
        model.zero_head()  # the fine-tune starts from the pretrained features with all logits 0
        head = "zero head"
    else:
        head = "head drawn by the model's init (finetune.head_init=model)"
    # RoPE (a DINOv3 ViT) has no table: the rotary positions of any grid are computed as the model runs.
    positions = (f"position embeddings {old_tokens} -> {new_grid[0]}x{new_grid[1]} grid tokens"
                 if hasattr(model, "pos_embed") else
                 f"RoPE: no position table to resize, the {new_grid[0]}x{new_grid[1]} grid's positions are computed as it runs")
    _say(f"loaded {len(expected)} tensors from {src.path}; {positions}; new {head} with {model.num_classes} classes"
         + (f"; {channels}" if channels else ""))
    return {}


def make_linear_probe(model: VisionTransformer) -> None:
    """MAE's linear probe (main_linprobe.py there): the head becomes BatchNorm1d(D, affine=False, eps=1e-6)
    then the Linear (trunc-normal 0.01, as the official), and nothing but the head trains. The BatchNorm
    only whitens the frozen features, so the probe is still a linear classifier."""
    linear = nn.Linear(model.embed_dim, model.num_classes)
    nn.init.trunc_normal_(linear.weight, std=0.01)
    nn.init.zeros_(linear.bias)
    model.head = nn.Sequential(nn.BatchNorm1d(model.embed_dim, affine=False, eps=1e-6), linear)
    for name, param in model.named_parameters():
        param.requires_grad = name.startswith("head.")
    _say(f"linear probe: {sum(p.numel() for p in model.head.parameters())} trained parameters (head), the "
         f"encoder frozen")


def _copier(value: torch.Tensor) -> Callable[[torch.Tensor], object]:
    return lambda target: target.copy_(value.to(target.dtype))


_say = say  # rank 0 only, also before the process group exists (pipeline.dist.is_rank0)
