"""The Vision Transformer of Dosovitskiy et al., "An Image is Worth 16x16 Words" (arXiv 2010.11929).

Eq. 1   z_0 = [x_class; x_p^1 E; ...; x_p^N E] + E_pos           PatchEmbed, cls_token, pos_embed
Eq. 2   z'_l = MSA(LN(z_{l-1})) + z_{l-1}                         Block: first residual line
Eq. 3   z_l = MLP(LN(z'_l)) + z'_l                                Block: second residual line
Eq. 4   y = LN(z_L^0)                                             norm, then head on the class token

Parameter names and shapes are those of timm's `VisionTransformer` (class token, global_pool='token'),
so state dicts move between the two unchanged; tests/unit/test_vit.py checks logits are equal.

The DINOv2 backbone (Oquab et al., arXiv 2304.07193; registers: Darcet et al., arXiv 2309.16588) is the
same model with four options, each a constructor argument and each an nn.Identity()/absent when off, as in
timm's `VisionTransformer`: LayerScale (`init_values`), register tokens (`reg_tokens`), a position table over
the patches only (`no_embed_class`) and a SwiGLU MLP (`mlp_layer='swiglu'`, ViT-g); `dynamic_img_size`
interpolates the position table for inputs of another size (DINO's 96 px local crops). Meta's released
files load through `pipeline.model.layouts.convert_dinov2_state_dict` (docs/model.md).
"""

from __future__ import annotations

import inspect
import math
from functools import partial
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.model.layers import Block, ConvStem, LayerScale, PatchEmbed, init_param, trunc_normal, uniform
from pipeline.model.pos_embed import resize_pos_embed
from pipeline.model.variants import (  # noqa: F401 (VARIANTS, model_flops, model_kwargs_from_config: re-exported)
    VARIANTS,
    model_flops,
    model_kwargs_from_config,
    pair,
    variant_kwargs,
)
from pipeline.zero3 import real_numel


class TokenFeatures(NamedTuple):
    """`VisionTransformer.forward_tokens`: the tokens after the final norm, split by kind (Meta's
    x_norm_clstoken / x_norm_regtokens / x_norm_patchtokens / x_prenorm)."""

    cls_token: torch.Tensor
    """(B, D)"""
    reg_tokens: torch.Tensor
    """(B, R, D); R = 0 without registers"""
    patch_tokens: torch.Tensor
    """(B, N, D), row-major over the patch grid"""
    prenorm: torch.Tensor
    """(B, 1 + R + N, D) before the final norm"""


class VisionTransformer(nn.Module):
    """ViT with a class token. `img_size` may be non-square, (H, W).

    DINOv2 options (all off by default, and then the model is the paper's): `init_values` LayerScale's
    starting value (None: no LayerScale); `reg_tokens` learnable register tokens after the class token;
    `no_embed_class` the position table covers the patches only (timm's layout for the register models);
    `mlp_layer` 'mlp' or 'swiglu'; `dynamic_img_size` accept any input size divisible by the patch size and
    resize the position table to it at forward time (bicubic, antialiased: timm's resample_abs_pos_embed,
    and Meta's for its register models); `mask_token` a learnable embedding that `masks` put in place of
    patch embeddings (iBOT; Meta's prepare_tokens_with_masks); `patch_embed_impl` how the patch projection is
    computed, 'conv' (timm's, bit for bit) or 'matmul' (layers.PatchProjection): the same weights either way.
    `stem` 'patch' (the paper's Eq. 1) or 'conv' (layers.ConvStem: a few convolutions make the same grid of
    tokens; for small images and short runs, docs/model.md).
    """

    ARCH_KEYS: tuple[str, ...] = ("img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads", "mlp_ratio",
                                  "qkv_bias", "num_classes", "representation_size", "global_pool", "init_values",
                                  "reg_tokens", "no_embed_class", "mlp_layer", "mask_token", "stem")
    """The constructor arguments that decide the weights (their names and shapes): what a resume compares
    with its checkpoint (`architecture`), what a fine-tune takes from its source (those a fine-tune does not
    set itself: pipeline/run/finetune.py), what model.safetensors records. A model built on this one
    declares its own (MAE's decoder, DINOv2's heads added)."""

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        representation_size: int | None = None,
        global_pool: str = "token",
        init_values: float | None = None,
        reg_tokens: int = 0,
        no_embed_class: bool = False,
        mlp_layer: str = "mlp",
        dynamic_img_size: bool = False,
        mask_token: bool = False,
        patch_embed_impl: str = "conv",
        stem: str = "patch",
    ):
        super().__init__()
        if global_pool not in ("token", "avg"):
            raise ValueError(f"global_pool must be 'token' or 'avg', got {global_pool!r}")
        self.global_pool = global_pool
        self.num_classes = num_classes
        self.embed_dim = embed_dim
        if reg_tokens < 0:
            raise ValueError(f"reg_tokens must be >= 0, got {reg_tokens}")
        self.num_reg_tokens = reg_tokens
        self.num_prefix_tokens = 1 + reg_tokens
        self.no_embed_class = no_embed_class
        self.dynamic_img_size = dynamic_img_size
        self.grad_checkpointing = False

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, dynamic_img_size, patch_embed_impl,
                                      stem)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        # timm's name and shape; Meta calls it register_tokens (converted on load).
        self.reg_token = nn.Parameter(torch.zeros(1, reg_tokens, embed_dim)) if reg_tokens else None
        # Meta's name and shape (1, D); timm has none. Only iBOT-style masking needs it.
        self.mask_token = nn.Parameter(torch.zeros(1, embed_dim)) if mask_token else None
        pos_rows = self.patch_embed.num_patches + (0 if no_embed_class else 1)
        self.pos_embed = nn.Parameter(torch.zeros(1, pos_rows, embed_dim))
        self.pos_drop = nn.Dropout(drop_rate)
        # Stochastic depth grows linearly with depth, as in DeiT/timm.
        rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = nn.Sequential(*[
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate, rates[i],
                  init_values=init_values, mlp_layer=mlp_layer)
            for i in range(depth)
        ])
        # 'avg' (MAE's fine-tuning, timm's global_pool='avg'): the patch tokens are averaged and normalised
        # by fc_norm instead of normalising every token; the names stay timm's, so weights load both ways.
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6) if global_pool == "token" else nn.Identity()
        self.fc_norm = nn.LayerNorm(embed_dim, eps=1e-6) if global_pool == "avg" else nn.Identity()
        # The paper's pretraining head: a hidden tanh layer before the classifier ("pre-logits").
        if representation_size:
            self.pre_logits = nn.Sequential()
            self.pre_logits.add_module("fc", nn.Linear(embed_dim, representation_size))
            self.pre_logits.add_module("act", nn.Tanh())
            head_in = representation_size
        else:
            self.pre_logits = nn.Identity()
            head_in = embed_dim
        self.head = nn.Linear(head_in, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights()

    @property
    def grid_size(self) -> tuple[int, int]:
        return self.patch_embed.grid_size

    def no_weight_decay(self) -> set[str]:
        """Names of parameters with more than one dimension that are not decayed (timm's and DeiT's set:
        the position embedding, the class token and timm's register tokens). Biases, norm weights and
        LayerScale gammas (ndim <= 1) are never decayed whatever this says; the optimizer adds them
        (`pipeline.train.optim.param_groups`). mask_token is decayed. DINOv2's student
        (`pipeline.model.dino.DINOv2Model`) exempts none of these by name, as Meta's parameter groups."""
        return {"pos_embed", "cls_token", "reg_token"}

    def group_matcher(self, coarse: bool = False) -> dict[str, str]:  # noqa: ARG002 - timm's signature
        """Which parameters make up the stem (layer 0) and block i (layer i + 1), as regular expressions
        over parameter names in timm's style; everything else (the final norm, the head) is the last
        layer. Layer-wise lr decay numbers layers by it (BEiT numbering). `coarse` is timm's argument,
        kept for its signature: the blocks are the unit either way."""
        return {"stem": r"^(cls_token|reg_token|mask_token|pos_embed|patch_embed)", "blocks": r"^blocks\.(\d+)"}

    def init_weights(self) -> None:
        """timm's 'original' ViT init: trunc-normal(0.02) for Linear weights, position embedding and
        class token; zero biases; LayerNorm at (1, 0); the patch projection as PyTorch's Conv2d default
        (kaiming-uniform with a=sqrt(5), i.e. U(+-1/sqrt(fan_in)) for weight and bias), redone here so
        it is drawn the same way under zero.Init."""
        proj = self.patch_embed.proj
        for conv in proj if isinstance(proj, ConvStem) else (proj,):
            if isinstance(conv, nn.Conv2d):
                bound = 1.0 / math.sqrt(conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1])
                init_param(conv.weight, uniform(bound))
                if conv.bias is not None:
                    init_param(conv.bias, uniform(bound))
        init_param(self.pos_embed, trunc_normal(0.02))
        init_param(self.cls_token, trunc_normal(0.02))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                init_param(module.weight, trunc_normal(0.02))
                if module.bias is not None:
                    init_param(module.bias, nn.init.zeros_)
            elif isinstance(module, LayerScale):  # under zero.Init its constructor's fill is partitioned away
                init_param(module.gamma, partial(nn.init.constant_, val=module.init_values))
        # Drawn after everything else so that a model without them consumes the same random numbers as before.
        if self.reg_token is not None:
            init_param(self.reg_token, partial(nn.init.normal_, std=1e-6))  # timm's and Meta's init
        if self.mask_token is not None:
            init_param(self.mask_token, nn.init.zeros_)  # Meta's init

    def reset_classifier(self, num_classes: int) -> None:
        """Fine-tuning head (the paper, Sec. 3.2): a zero-initialised Linear(D, K) replaces the head and
        the pre-logits layer, so training starts from the pretrained features with zero logits."""
        self.pre_logits = nn.Identity()
        self.num_classes = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.zero_head()

    def zero_head(self) -> None:
        """Zero the classifier's weight and bias (the paper's fine-tuning head: all logits 0 at the start).
        In place, so also on a model ZeRO-3 has already partitioned, where replacing the module (as
        `reset_classifier` does) is not possible: fine-tuning builds the model with its head and calls this."""
        if isinstance(self.head, nn.Linear):
            init_param(self.head.weight, nn.init.zeros_)
            init_param(self.head.bias, nn.init.zeros_)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def _pos_embed_for(self, grid: tuple[int, int]) -> torch.Tensor:
        """The position table for a patch grid: the built one, or (dynamic_img_size) resized to `grid`."""
        if grid == self.patch_embed.grid_size:
            return self.pos_embed
        return resize_pos_embed(self.pos_embed, grid, num_prefix_tokens=0 if self.no_embed_class else 1,
                                old_grid=self.patch_embed.grid_size)

    def prepare_tokens(self, x: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
        """Eq. 1: (B, C, H, W) images -> (B, 1 + R + N, D) tokens [class, registers, patches], positions added.

        `masks` (B, N) bool, True where a patch embedding is replaced by `mask_token` before the positions
        are added (Meta's prepare_tokens_with_masks; iBOT's masked patches)."""
        h, w = x.shape[-2] // self.patch_embed.patch_size[0], x.shape[-1] // self.patch_embed.patch_size[1]
        x = self.patch_embed(x)
        if masks is not None:
            if self.mask_token is None:
                raise ValueError("masks given but the model has no mask_token (build it with mask_token=True)")
            if masks.shape != x.shape[:2]:
                raise ValueError(f"masks is {tuple(masks.shape)}, expected (batch, patches) = {tuple(x.shape[:2])}")
            x = torch.where(masks.unsqueeze(-1), self.mask_token.to(x.dtype).unsqueeze(0), x)
        pos_embed = self._pos_embed_for((h, w))
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        if self.no_embed_class:
            # timm's DeiT-3 / register layout: positions on the patches only, then the prefix tokens.
            x = x + pos_embed
            prefix = [cls] if self.reg_token is None else [cls, self.reg_token.expand(x.shape[0], -1, -1)]
            x = torch.cat(prefix + [x], dim=1)
        else:
            x = torch.cat([cls, x], dim=1) + pos_embed
            if self.reg_token is not None:  # Meta's order: registers go in after the positions, unpositioned
                x = torch.cat([x[:, :1], self.reg_token.expand(x.shape[0], -1, -1), x[:, 1:]], dim=1)
        return self.pos_drop(x)

    def _blocks_and_prenorm(self, x: torch.Tensor, masks: torch.Tensor | None) -> torch.Tensor:
        x = self.prepare_tokens(x, masks)
        for block in self.blocks:
            if self.grad_checkpointing and self.training and torch.is_grad_enabled():
                # Non-reentrant checkpointing: keeps only the block input and recomputes the rest in backward.
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x

    def forward_features(self, x: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
        """Eq. 1-3 and the final LayerNorm: all tokens, (B, 1 + R + N, D) (timm's forward_features)."""
        return self.norm(self._blocks_and_prenorm(x, masks))

    def forward_tokens(self, x: torch.Tensor, masks: torch.Tensor | None = None) -> TokenFeatures:
        """The class token, the registers and the patch tokens after the final norm, apart (what DINO's and
        iBOT's heads and the PCA image read; Meta's forward_features dict). `masks` as in prepare_tokens."""
        prenorm = self._blocks_and_prenorm(x, masks)
        x = self.norm(prenorm)
        r = 1 + self.num_reg_tokens
        return TokenFeatures(x[:, 0], x[:, 1:r], x[:, r:], prenorm)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Eq. 4: classify from the class token z_L^0 (or, with global_pool='avg', the patch tokens' mean)."""
        x = x[:, self.num_prefix_tokens:].mean(dim=1) if self.global_pool == "avg" else x[:, 0]
        x = self.pre_logits(self.fc_norm(x))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor, *, features: bool = False) -> torch.Tensor:
        """The logits; `features`: the tokens after the final norm instead (forward_features), through
        forward so that ZeRO-3's hooks gather the weights (what eval.sets reads of a run's model)."""
        tokens = self.forward_features(x)
        return tokens if features else self.forward_head(tokens)


def architecture(model_class: type[nn.Module], kwargs: dict) -> dict:
    """The architecture of `model_class(**kwargs)`: each of its ARCH_KEYS with the value it is built with (a key
    not in `kwargs` takes the constructor's default, or the ViT's for arguments passed through to it)."""
    defaults = {}
    for cls in (VisionTransformer, model_class):
        for name, param in inspect.signature(cls.__init__).parameters.items():
            if param.default is not inspect.Parameter.empty:
                defaults[name] = param.default
    return {k: kwargs.get(k, defaults.get(k)) for k in model_class.ARCH_KEYS}


def build_vit(name: str, **overrides) -> VisionTransformer:
    """`build_vit("vit_b16", num_classes=10, img_size=384)`."""
    return VisionTransformer(**variant_kwargs(name, **overrides))


def num_params(model: nn.Module) -> int:
    return sum(real_numel(p) for p in model.parameters())  # full sizes, also of ZeRO-3's 1-D placeholders
