"""A parameter as ZeRO-3 partitions it, read without importing DeepSpeed: the one home of the attributes
DeepSpeed puts on a partitioned parameter (`ds_id`, `ds_shape`).

Under `deepspeed.zero.Init` each parameter is a 1-D placeholder holding this rank's slice; its real shape
is DeepSpeed's `ds_shape` attribute. Reading it is DeepSpeed internals, which otherwise live in
`pipeline/train/ds_compat.py` (whose import checks the DeepSpeed version); these three live here, below
both model/ and train/, because the model reads them (`_init_param`, `num_params`) and model/ imports
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


def real_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The parameter's full shape, also for a ZeRO-3 placeholder (whose own shape is its 1-D slice)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def real_numel(param: torch.Tensor) -> int:
    """The parameter's full element count, also for a ZeRO-3 placeholder."""
    return math.prod(real_shape(param))
