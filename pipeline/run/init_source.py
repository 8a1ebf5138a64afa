"""A pretraining run that starts from a foundation model's weights: `launch/pretrain.py --init SOURCE` (adapt.init;
docs/adapt.md). SOURCE is anything `launch/finetune.py --from` reads, read as `load_backbone` reads it for every
command (pipeline/run/backbone.py): Meta's DINOv2, DINOv3 and MAE files, timm's, our exports, run directories.

    cfg, hook = prepare_init(cfg, plan, explicit_model_keys)   # at the command, after the start-or-resume plan

At a first start: the architecture is the source's (what the config writes of it must agree: one line naming the
key otherwise), the source's SHA-256 is recorded in the run (adapt.init_digest), and `hook(student)` copies its
backbone into the student before the trainer builds the teacher from it (so the teacher, and DINOv3's Gram
teacher taken from it at step 0, start as the source). What the source lacks (DINO and iBOT heads, iBOT's mask
token, MAE's decoder) keeps the model's own init; a run directory of the same recipe with a checkpoint brings
its heads along (its teacher's, or its MAE's decoder). One line says what came from the file and what did not.

At a resume: the run's checkpoint holds all of that; the source is not loaded, only its digest compared with the
one recorded (another --init is refused in one line). With adapt.anchor on, the frozen source is not in the
checkpoint (it never trains): `reload_source` reads it again from the recorded file (its digest checked here
first: a file gone or changed is one line), into the anchor as the first start read it into the student.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.config import Config, ConfigError
from pipeline.dist import say
from pipeline.model.channels import fit_in_chans
from pipeline.model.dinov3 import DINOv3ViT
from pipeline.model.layers import init_param
from pipeline.model.pos_embed import resize_pos_embed
from pipeline.model.variants import DINOV3_VARIANTS
from pipeline.model.vit import architecture
from pipeline.model.weights import WeightsError
from pipeline.objectives.adapt import anchored
from pipeline.run.backbone import Backbone, load_backbone
from pipeline.run.finetune import ARCH_KEYS, describe_arch, meta_arch_config
from pipeline.run.resume import ResumePlan
from pipeline.train import checkpoint as ckpt
from pipeline.zero3 import real_shape


def source_digest(source: str | Path) -> str:
    """SHA-256 of what SOURCE's weights are read from: the file; a run directory's export, else its newest
    complete tag's trainer_state.json (which names its step and config)."""
    path = Path(source).expanduser()
    if path.is_dir():
        export = path / "model.safetensors"
        if export.is_file():
            path = export
        else:
            tag = ckpt.newest_complete_tag(path)
            path = ckpt.checkpoint_dir(path) / str(tag) / "trainer_state.json"
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def prepare_init(cfg: Config, plan: ResumePlan | None, explicit: set[str]) -> tuple[Config, Any]:
    """(the run config with the source's architecture and digest, the hook that loads the student; None when
    `plan` resumes). `explicit`: the model.* keys the config file or the command line writes."""
    if plan is not None:
        return _resumed(cfg, plan), None
    if not cfg.adapt.init:
        if cfg.adapt.freeze_backbone_steps or cfg.adapt.backbone_warmup_steps or cfg.adapt.anchor:
            raise ConfigError("adapt.freeze_backbone_steps, backbone_warmup_steps and anchor hold what a run started "
                              "from: give the source with --init SOURCE (adapt.init)")
        return cfg, None
    source = cfg.adapt.init
    backbone = load_backbone(source, flag="--init")
    model = _source_model(cfg, backbone, explicit)
    adapt = dataclasses.replace(cfg.adapt, init=str(backbone.source), init_digest=source_digest(backbone.source))
    cfg = anchored(dataclasses.replace(cfg, model=model, adapt=adapt, data=_normalisation(cfg, backbone)))
    held = [backbone]  # handed to the hook once, not kept for the whole run

    def hook(student: nn.Module) -> dict[str, str]:
        line = load_init(student, held.pop(), cfg.model.objective)
        say(f"--init {source}: {line}")
        return {"adapt.init": cfg.adapt.init, "adapt.init_digest": cfg.adapt.init_digest}

    return cfg, hook


def _resumed(cfg: Config, plan: ResumePlan) -> Config:
    """A restart: the checkpoint wins; the source recorded at the first start must be the one named now."""
    recorded = plan.state.config.get("adapt") or {}
    was, digest = recorded.get("init"), recorded.get("init_digest")
    if cfg.adapt.init:
        if not was:
            raise WeightsError(f"--init {cfg.adapt.init}: {cfg.run.dir} was started without --init (it has a "
                               f"checkpoint); drop --init to continue it, or use a new run.dir")
        if source_digest(cfg.adapt.init) != digest:
            raise WeightsError(f"--init {cfg.adapt.init}: {cfg.run.dir} started from {was} (SHA-256 {digest[:12]}..., "
                               f"recorded at its first start), and this is another file; drop --init to continue "
                               f"it, or use a new run.dir")
    if was and cfg.adapt.anchor > 0:  # the anchor is read again from the source (reload_source): the same file
        if not Path(was).exists():
            raise WeightsError(f"adapt.init={was}: not found; {cfg.run.dir} (adapt.anchor={cfg.adapt.anchor:g}) "
                               f"reads its frozen source from it at a resume (the checkpoints do not store it)")
        if source_digest(was) != digest:
            raise WeightsError(f"adapt.init={was}: its SHA-256 is not the one {cfg.run.dir} recorded at its first "
                               f"start ({digest[:12]}...): the anchor (adapt.anchor) cannot be read again from it")
        say(f"--init: {cfg.run.dir} has a checkpoint ({plan.tag}): it wins; adapt.anchor's frozen source is read "
            f"again from {was} (its SHA-256 as recorded)")
    elif was:
        say(f"--init: {cfg.run.dir} has a checkpoint ({plan.tag}): it wins, {was} is not read again")
    if was:
        saved = plan.state.config.get("model") or {}
        model = dataclasses.replace(cfg.model, **{k: _plain(saved[k]) for k in ARCH_KEYS if k in saved})
        data = cfg.data
        if recorded.get("normalise") == "source":  # the source's, as the first start recorded them
            saved_data = plan.state.config.get("data") or {}
            data = dataclasses.replace(data, mean=_plain(saved_data["mean"]), std=_plain(saved_data["std"]))
        cfg = dataclasses.replace(cfg, model=model, data=data,
                                  adapt=dataclasses.replace(cfg.adapt, init=was, init_digest=digest))
    return anchored(cfg)


def _plain(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _source_model(cfg: Config, backbone: Backbone, explicit: set[str]):
    """The run's model.* with the source's architecture; a key the config writes otherwise is refused (not
    model.variant: a name, which a config needs to be read at all, replaced by the source's and said)."""
    found = backbone.found
    if found is not None and found.complete:  # Meta's DINOv2, a DINOv3 file: the file says it all
        arch = meta_arch_config(found.arch)
    elif backbone.config is not None:
        arch = {k: getattr(backbone.config.model, k) for k in ARCH_KEYS}
    elif isinstance(backbone.model, DINOv3ViT):
        raise WeightsError(f"--init {backbone.source}: a DINOv3 ViT without its run's config.yaml; give the run "
                           f"directory")
    else:  # our export: its metadata's architecture
        arch = meta_arch_config(architecture(type(backbone.model), backbone.kwargs))
    where = f"--init {backbone.source}"
    dinov3 = arch["variant"] in DINOV3_VARIANTS
    if dinov3 != (cfg.model.objective == "dinov3"):
        kind = "a DINOv3 ViT (RoPE)" if dinov3 else "a ViT (position table)"
        raise WeightsError(f"{where} is {kind}: model.objective={cfg.model.objective} cannot start from it "
                           f"({'dinov3 starts from DINOv3 weights' if not dinov3 else 'use model.objective: dinov3'})")
    regs = cfg.model.reg_tokens
    if "reg_tokens" in explicit and regs is not None and regs != (arch["reg_tokens"] or 0):  # registers beyond the source's
        if regs < (arch["reg_tokens"] or 0):
            raise ConfigError(f"model.reg_tokens={regs}: {where} has {arch['reg_tokens']} registers, which all load; "
                              f"model.reg_tokens may add fresh ones, not drop the source's (>= {arch['reg_tokens']})")
        arch = {**arch, "reg_tokens": regs}  # the source's in the first slots, the rest fresh (`_copy`)
    for key in ARCH_KEYS:  # a key the config writes, contradicting the source
        if key not in ("variant", "reg_tokens") and key in explicit and not _same(getattr(cfg.model, key), arch[key]):
            raise ConfigError(f"model.{key}={getattr(cfg.model, key)}: {where} has model.{key}={arch[key]} (the "
                              f"architecture is the source's); drop model.{key} from the config")
    if arch["variant"] != cfg.model.variant:  # a name (needed to pick the recipe's class), not a contradiction
        say(f"{where}: model.variant {cfg.model.variant} -> {arch['variant']} (the source's architecture)")
    return dataclasses.replace(cfg.model, **arch)


def _normalisation(cfg: Config, backbone: Backbone) -> Any:
    """The run's data.* with adapt.normalise applied: 'source' takes the source's mean and std; 'run' keeps the
    config's, and says in one line where they are not the source's (its first layer would meet inputs it never saw,
    silently: ImageNet's statistics against a set's 0.5 move every input by about 0.1-0.3 of its range)."""
    mean, std = tuple(backbone.data.mean), tuple(backbone.data.std)
    where = f"--init {backbone.source}"
    origin = "its run's data.mean/std" if backbone.config is not None else "what its authors trained it with"
    if cfg.adapt.normalise == "source":
        say(f"{where}: data.mean {_fmt(mean)}, data.std {_fmt(std)} ({origin}; adapt.normalise=source)")
        return dataclasses.replace(cfg.data, mean=mean, std=std)
    run_mean, run_std = cfg.data.mean, cfg.data.std
    if run_mean is not None and run_std is not None and _close(run_mean, mean) and _close(run_std, std):
        return cfg.data
    ours = ("data.mean/std null (the set's own statistics, dataset.json)" if run_mean is None or run_std is None
            else f"data.mean {_fmt(run_mean)}, data.std {_fmt(run_std)}")
    say(f"warning: {where} was trained on inputs normalised with mean {_fmt(mean)}, std {_fmt(std)} ({origin}), "
        f"and this run normalises with {ours}: set adapt.normalise=source to take the source's")
    return cfg.data


def _close(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(_same(float(x), float(y)) for x, y in zip(a, b))


def _fmt(values: Any) -> str:
    return "[" + ", ".join(f"{v:g}" for v in values) + "]"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-4)
    return _plain(a) == _plain(b)


@torch.no_grad()
def load_init(student: nn.Module, backbone: Backbone, objective: str) -> str:
    """The source into the student (built, not yet wrapped; partitioned under ZeRO-3); what came, what did not."""
    whole = _run_state(backbone, objective)
    target = student.backbone if hasattr(student, "backbone") else student
    fit = dict(in_chans=real_shape(target.patch_embed.input_conv.weight)[1], where=f"--init {backbone.source}",
               key=None, name=target.patch_embed.input_weight_name)
    if whole is not None:  # a run of this recipe: its student-shaped state, heads (decoder) included
        name = ("backbone." if target is not student else "") + fit.pop("name")  # RGB -> C channels: model/channels.py
        whole, channels = fit_in_chans(whole, **fit, name=name)
        loaded, fresh = _copy(student, whole, "")
        what = f"{backbone.source} ({backbone.tag}): the whole model, heads included"
    else:
        prefix = "backbone." if target is not student else ""
        state = _fit_positions(backbone.model.state_dict(), target, backbone.kwargs)
        state, channels = fit_in_chans(state, **fit)
        loaded, fresh = _copy(target, state, prefix)
        if prefix:
            fresh += [n for n, _ in student.named_parameters() if not n.startswith(prefix)]
        arch = backbone.found.arch if backbone.found is not None and backbone.found.complete else backbone.kwargs
        what = f"{backbone.found.layout if backbone.found else 'weights'}, {describe_arch({**_arch_defaults(), **arch})}"
    parts = sorted({".".join(n.split(".")[:1 if not n.startswith("backbone.") else 2]) for n in fresh})
    into = "the student (and so the teacher)" if hasattr(student, "backbone") else "the model (its position table "\
        "MAE's fixed sin-cos)"
    return (f"{what}: {loaded} tensors from the file into {into}; fresh: {', '.join(parts) or 'nothing'}"
            + (f"; {channels}" if channels else ""))


@torch.no_grad()
def reload_source(module: nn.Module, cfg: Config, what: str) -> None:
    """A resumed run's anchor (`module`: the teacher's backbone's structure, partitioned alike under ZeRO-3)
    read again from adapt.init (its digest checked by `_resumed`), by `load_init` as the first start loaded the
    student's backbone, which the EMA teacher, and so the anchor at step 0, was: the same tensors, bit for bit.
    (Its mask token, fresh at the first start, is its own init here: the anchor's forward uses no mask.)"""
    holder = nn.Module()
    holder.backbone = module  # a student's shape: load_init's path, run directories' heads left out
    line = load_init(holder, load_backbone(cfg.adapt.init, flag="adapt.init"), cfg.model.objective)
    say(f"{what}: the frozen source read again from adapt.init: {line.split('; fresh:')[0]}")


def _arch_defaults() -> dict[str, Any]:
    return {"mlp_layer": "mlp", "init_values": None, "reg_tokens": 0}


def _run_state(backbone: Backbone, objective: str) -> dict[str, torch.Tensor] | None:
    """A run directory of the same recipe with a complete checkpoint: what its student would be at the tag (the
    DINO teacher with its heads; MAE's model with its decoder), else None."""
    cfg = backbone.config
    if cfg is None or cfg.model.objective != objective or not backbone.source.is_dir():
        return None
    tag = backbone.tag or ckpt.newest_complete_tag(backbone.source)
    if tag is None:
        return None
    backbone.tag = tag
    if objective == "mae":
        return ckpt.consolidate(backbone.source, tag)
    return (ckpt.read_client_state(backbone.source, tag).get("objective") or {}).get("teacher")


def _fit_positions(state: dict[str, torch.Tensor], target: nn.Module, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The source's position table resized to the student's grid (a DINOv3 ViT has none: RoPE); an MAE student
    keeps its fixed sin-cos table (a buffer: not copied)."""
    params = dict(target.named_parameters())
    if "pos_embed" not in state or "pos_embed" not in params:
        return state
    img, patch = kwargs["img_size"], kwargs["patch_size"]
    h, w = (img, img) if isinstance(img, int) else img
    prefix = 0 if getattr(target, "no_embed_class", False) else 1
    return {**state, "pos_embed": resize_pos_embed(state["pos_embed"], target.grid_size, prefix,
                                                   (h // patch, w // patch))}


def _copy(target: nn.Module, state: dict[str, torch.Tensor], prefix: str) -> tuple[int, list[str]]:
    """Every parameter of `target` that `state` holds, copied (shapes checked); (how many, the names left fresh)."""
    loaded, fresh = 0, []
    for name, param in target.named_parameters():
        if name == "reg_token" and (name not in state or state[name].shape[1] < real_shape(param)[1]):
            loaded += _more_registers(param, state.get(name))
            have = state[name].shape[1] if name in state else 0
            fresh.append(f"{prefix}{name} {have}-{real_shape(param)[1] - 1} (registers past the source's {have})")
            continue
        if name not in state:
            fresh.append(prefix + name)
            continue
        value = state[name]
        if tuple(value.shape) != tuple(real_shape(param)):
            raise WeightsError(f"the source's '{name}' is {tuple(value.shape)}, the run's model has "
                               f"{tuple(real_shape(param))}")
        init_param(param, lambda t, v=value: t.copy_(v.to(t.dtype)))
        loaded += 1
    return loaded, fresh


def _more_registers(param: nn.Parameter, source: torch.Tensor | None) -> int:
    """model.reg_tokens above the source's: its registers (None: it has none) in the first slots, the rest fresh
    at the model's init (normal, std 1e-6), drawn from a fixed seed so that a resumed anchor's read of the source
    (reload_source) gives the same registers, bit for bit. 1 when the file gave some, else 0."""
    shape = real_shape(param)
    if source is not None and tuple(source.shape[::2]) != (shape[0], shape[2]):
        raise WeightsError(f"the source's 'reg_token' is {tuple(source.shape)}, the run's model has {tuple(shape)}")

    def fill(t: torch.Tensor) -> None:
        t.copy_(1e-6 * torch.randn(shape, generator=torch.Generator().manual_seed(0)))
        if source is not None:
            t[:, :source.shape[1]].copy_(source.to(t.dtype))

    init_param(param, fill)
    return int(source is not None)


INIT_EVAL = "eval_init.json"  # RUN_DIR/: the eval.sets figures of the source itself (step 0)


def versus_init(judged: dict[str, float], run_dir: Path, step: int,
                warn_drop: float | None = None) -> dict[str, float]:
    """eval.sets' figures of a run started with --init, with eval/<name>/knn_top1_vs_init (the change against the
    source's own figure, in points of the fraction) from the second evaluation on; the step-0 figures written to
    RUN_DIR/eval_init.json, where a resumed run finds them; a warning for each figure more than `warn_drop`
    points below the source's (adapt.warn_drop). Rank 0 (the one that logs)."""
    path = run_dir / INIT_EVAL
    if step == 0:
        path.write_text(json.dumps(judged, indent=1) + "\n")
        return judged
    try:
        first = json.loads(path.read_text())
    except (OSError, ValueError):
        return judged  # (a run whose step-0 evaluation did not happen: no eval.sets then)
    extra = {f"{k}_vs_init": v - first[k] for k, v in judged.items() if k.endswith("/knn_top1") and k in first}
    for key, change in extra.items():  # adapt.warn_drop is in points (percent); the figures are fractions
        if warn_drop is not None and -100 * change > warn_drop:
            figure = key.removesuffix("_vs_init")
            say(f"warning: step {step}: {figure} is {100 * judged[figure]:.2f}%, {-100 * change:.2f} points below "
                f"the source's {100 * first[figure]:.2f}% (adapt.warn_drop={warn_drop:g})")
    return {**judged, **extra}
