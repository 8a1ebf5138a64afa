"""What a run config implies, never written twice: the batch split on a layout (accumulation steps),
DeepSpeed's JSON config, the image size as (height, width), from `pipeline.config`'s sections.

    g, accum = resolve_batch(cfg.train, world_size)     # ConfigError naming the numbers if impossible
    ds_json = deepspeed_config(cfg, world_size)         # train_batch_size is the global batch
"""

from __future__ import annotations

from typing import Any

from pipeline.config import Config, TrainConfig
from pipeline.typed_yaml import ConfigError


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def accumulation_steps(global_batch: int, world_size: int, micro: int) -> int:
    """The micro batches per rank that make `global_batch` on `world_size` ranks; ConfigError naming the
    numbers when the layout cannot make it. The one place the layout arithmetic lives (the train loader
    calls it too)."""
    if global_batch % (micro * world_size):
        raise ConfigError(f"train.global_batch_size={global_batch} is not a multiple of train.micro_batch_size="
                          f"{micro} x world size {world_size} = {micro * world_size}; pick a micro batch that "
                          f"divides {global_batch // world_size if global_batch % world_size == 0 else global_batch}")
    return global_batch // (micro * world_size)


def resolve_batch(train: TrainConfig, world_size: int) -> tuple[int, int]:
    """(global batch, accumulation steps) on `world_size` ranks; ConfigError naming the numbers if the
    layout cannot make the global batch."""
    m = train.micro_batch_size
    if train.global_batch_size is None:
        accum = train.grad_accum_steps or 1
        return m * accum * world_size, accum
    g = train.global_batch_size
    accum = accumulation_steps(g, world_size, m)
    if train.grad_accum_steps is not None and train.grad_accum_steps != accum:
        raise ConfigError(f"train.grad_accum_steps={train.grad_accum_steps} contradicts train.global_batch_size={g} "
                          f"/ (micro_batch_size {m} x world size {world_size}) = {accum}; leave it unset")
    return g, accum


def deepspeed_config(cfg: Config, world_size: int) -> dict[str, Any]:
    """The DeepSpeed JSON config, derived: train_batch_size = the global batch (see `resolve_batch`)."""
    ds, train = cfg.deepspeed, cfg.train
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu"}
    global_batch, accum = resolve_batch(train, world_size)
    out = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": accum,
        "train_batch_size": global_batch,
        "gradient_clipping": train.grad_clip,
        # Its bf16 overflow check reads a flag on the host every step; without train.check_finite the step
        # decides on the device instead (pipeline/train/ds_compat.py: read_free_steps).
        "bf16": {"enabled": ds.bf16, "check_grad_overflow": train.check_finite},
        "zero_optimization": zero,
        # ZeRO wraps any torch optimizer correctly; DeepSpeed only whitelists Adam(W)/Lamb by name.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,  # we log ourselves
        "wall_clock_breakdown": False,
    }
    return _merge(out, ds.extra)


def image_size(img_size: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    """224 -> (224, 224); [384, 512] -> (384, 512)."""
    if isinstance(img_size, int):
        return (img_size, img_size)
    h, w = img_size
    return (int(h), int(w))
