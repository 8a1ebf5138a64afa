"""DINO's projection head (Meta's dinov2/layers/dino_head.py): `DINOHead` with the official class's name,
constructor arguments, defaults and state-dict keys, so Meta's head weights load (checked against the
official code in tests/unit/test_dino_official.py, skipped without DINOV2_OFFICIAL_REPO). `DINOv3Head` is
Meta's DINOv3 head (dinov3/layers/dino_head.py): the same MLP, its prototypes a plain bias-free Linear
(tests/unit/test_dinov3_head.py, against DINOV3_OFFICIAL_REPO's code when set).

Where we differ from Meta's code, on purpose: `DINOHead.last_layer` is weight-normalised by a small module
of ours holding `weight_g` and `weight_v`, the parameters (names and shapes) that Meta's
`torch.nn.utils.weight_norm` creates, instead of that deprecated hook; the state dicts are interchangeable.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.model.layers import init_param, trunc_normal


class _WeightNormLinear(nn.Module):
    """A bias-free Linear with weight = g * v / ||v|| (norm over the input dimension, per output row):
    what `torch.nn.utils.weight_norm(nn.Linear(...), dim=0)` computes, with the same parameter names
    (`weight_g` of shape (out, 1), `weight_v` of shape (out, in)), so Meta's head state dict loads."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        # g before v: the order weight_norm registers them in, so the state dicts list the same keys in turn.
        self.weight_g = nn.Parameter(torch.ones(out_features, 1))  # Meta fills g with 1
        # nn.Linear's init for v, as Meta's (the same draws as nn.Linear(bias=False).reset_parameters), made
        # here and not copied from an inner nn.Linear: under deepspeed.zero.Init that Linear would already be
        # partitioned (an empty tensor) when copied.
        self.weight_v = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.kaiming_uniform_(self.weight_v, a=math.sqrt(5))

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_g * self.weight_v / self.weight_v.norm(dim=1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _build_mlp(nlayers: int, in_dim: int, bottleneck_dim: int, hidden_dim: int, use_bn: bool,
               bias: bool) -> nn.Module:
    """Meta's layout (module indices included, so `mlp.N.weight` keys match): Linear [BN] GELU ... Linear."""
    if nlayers == 1:
        return nn.Linear(in_dim, bottleneck_dim, bias=bias)
    layers: list[nn.Module] = []
    dims = [in_dim] + [hidden_dim] * (nlayers - 1)
    for d_in, d_out in zip(dims[:-1], dims[1:]):
        layers.append(nn.Linear(d_in, d_out, bias=bias))
        if use_bn:
            layers.append(nn.BatchNorm1d(d_out))
        layers.append(nn.GELU())
    layers.append(nn.Linear(hidden_dim, bottleneck_dim, bias=bias))
    return nn.Sequential(*layers)


class DINOHead(nn.Module):
    """DINO's projection head: an MLP to a bottleneck, L2-normalised, then weight-normalised prototypes.

    Same arguments, defaults and state-dict keys as Meta's `dinov2.layers.DINOHead`
    (`mlp.{0,2,4}.weight/bias`, `last_layer.weight_g`, `last_layer.weight_v`). The MLP's Linears start
    truncated-normal (std 0.02) with zero biases; the prototypes keep nn.Linear's init with g = 1.
    """

    def __init__(self, in_dim: int, out_dim: int, use_bn: bool = False, nlayers: int = 3,
                 hidden_dim: int = 2048, bottleneck_dim: int = 256, mlp_bias: bool = True) -> None:
        super().__init__()
        nlayers = max(nlayers, 1)
        self.mlp = _build_mlp(nlayers, in_dim, bottleneck_dim, hidden_dim, use_bn, mlp_bias)
        self.apply(self._init_weights)
        self.last_layer = self.prototypes(bottleneck_dim, out_dim)

    @staticmethod
    def prototypes(bottleneck_dim: int, out_dim: int) -> nn.Module:
        """The last layer, the K prototypes: DINOv2's weight-normalised rows of norm g = 1."""
        return _WeightNormLinear(bottleneck_dim, out_dim)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mlp(x)
        # fp16 cannot represent 1e-12; Meta's choice of eps per dtype.
        eps = 1e-6 if x.dtype == torch.float16 else 1e-12
        x = F.normalize(x, dim=-1, p=2, eps=eps)
        return self.last_layer(x)


class DINOv3Head(DINOHead):
    """Meta's DINOv3 head: DINOv2's MLP and L2-normalised bottleneck, then the prototypes as a plain bias-free
    Linear drawn truncated-normal (std 0.02) as the MLP's Linears are (Meta's `init_weights` applies one init to
    every Linear). Its state-dict key is `last_layer.weight`, as Meta's; the prototypes' rows start at norm about
    0.02 x sqrt(bottleneck) (0.32 for 256), not 1, so the first logits are that much smaller; and their weight is
    decayed as every matrix is (Meta's `get_params_groups_with_decay`, dino_head_wd_multiplier 1)."""

    @staticmethod
    def prototypes(bottleneck_dim: int, out_dim: int) -> nn.Module:
        layer = nn.Linear(bottleneck_dim, out_dim, bias=False)
        # Through init_param: under deepspeed.zero.Init the Linear is partitioned when it is built, and a draw on
        # its empty shard would consume no random numbers where a ZeRO-1 build draws them all: the same seed
        # would then give other weights after this layer at ZeRO-3 (the DINOv3 resume test's ZeRO-3 case).
        init_param(layer.weight, trunc_normal(0.02))
        return layer


def dino_head_flops(head: dict[str, Any], embed_dim: int, prototypes: int) -> float:
    """Forward FLOPs of one token through a DINOHead (its Linears; the norm and GELU left out). `head`: the
    head keys of a `DINOv2Model`'s arguments (head_nlayers, head_hidden_dim, head_bottleneck_dim)."""
    n, hidden, bottleneck = head["head_nlayers"], head["head_hidden_dim"], head["head_bottleneck_dim"]
    dims = [embed_dim] + [hidden] * (n - 1) + [bottleneck] if n > 1 else [embed_dim, bottleneck]
    return 2.0 * (sum(a * b for a, b in zip(dims[:-1], dims[1:])) + bottleneck * prototypes)
