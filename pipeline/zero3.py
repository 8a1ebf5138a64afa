"""A parameter as ZeRO-3 partitions it, read without importing DeepSpeed: the one home of the attributes
DeepSpeed puts on a partitioned parameter (`ds_id`, `ds_shape`, `ds_tensor`).

Under `deepspeed.zero.Init` each parameter is a 1-D placeholder holding this rank's slice; its real shape
is DeepSpeed's `ds_shape` attribute. Reading it is DeepSpeed internals, which otherwise live in
`pipeline/train/ds_compat.py` (whose import checks the DeepSpeed version); these three live here, below
both model/ and train/, because the model reads them (`init_param`, `num_params`) and model/ imports
neither train/ nor DeepSpeed when it is imported (a model builds and runs without DeepSpeed: timm
equivalence tests, parameter counts on the meta device). Attribute names are those of the DeepSpeed
versions `ds_compat.TESTED` accepts.
"""

from __future__ import annotations

import math

import torch


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether ZeRO-3 partitioned `param` (built under deepspeed.zero.Init): this rank holds a slice."""
    return hasattr(param, "ds_id")


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """This rank's values of `param`: under ZeRO-3 its slice (`ds_tensor`, flat; two models of the same shapes
    built under zero.Init on the same world size hold the same slices: an EMA of one into the other needs no
    communication, pipeline/train/ema.py), else the whole tensor."""
    return param.ds_tensor if is_partitioned(param) else param


def real_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The parameter's full shape, also for a ZeRO-3 placeholder (whose own shape is its 1-D slice)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def real_numel(param: torch.Tensor) -> int:
    """The parameter's full element count, also for a ZeRO-3 placeholder."""
    return math.prod(real_shape(param))
