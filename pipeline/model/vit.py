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

import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.model.pos_embed import resize_pos_embed
from pipeline.zero3 import is_partitioned, real_numel

# Table 1 of the paper (+ the Ti and S sizes of DeiT that timm also ships). Patch size is part of the name.
VARIANTS: dict[str, dict[str, int | float | bool | str]] = {
    "vit_ti16": dict(patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "vit_s16": dict(patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "vit_b16": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12),
    "vit_b32": dict(patch_size=32, embed_dim=768, depth=12, num_heads=12),
    "vit_l16": dict(patch_size=16, embed_dim=1024, depth=24, num_heads=16),
    "vit_l32": dict(patch_size=32, embed_dim=1024, depth=24, num_heads=16),
    "vit_h14": dict(patch_size=14, embed_dim=1280, depth=32, num_heads=16),
}

# DINOv2's backbones (Meta's hubconf / timm's vit_*_patch14_dinov2): LayerScale at 1e-5 in every block and a
# position table interpolated at forward time, so 224 px global and 96 px local crops share one model.
_DINOV2 = dict(patch_size=14, init_values=1e-5, dynamic_img_size=True)
# ViT-g: a SwiGLU MLP. timm's packed layout: fc1 is D -> 2H (value and gate halves), fc2 is H -> D, with
# mlp_ratio giving 2H / D; H = 4096 for D = 1536, as Meta's SwiGLUFFNFused rounds (2/3 * 4D, to a multiple of 8).
_GIANT = dict(embed_dim=1536, depth=40, num_heads=24, mlp_ratio=2.66667 * 2, mlp_layer="swiglu")
for _size, _shape in {
    "s": dict(embed_dim=384, depth=12, num_heads=6),
    "b": dict(embed_dim=768, depth=12, num_heads=12),
    "l": dict(embed_dim=1024, depth=24, num_heads=16),
    "g": _GIANT,
}.items():
    VARIANTS[f"vit_{_size}14"] = dict(_DINOV2, **_shape)
    # With registers, timm's layout: the position table covers the patches only (Meta's class-token row is
    # folded into the class token on load); the registers carry no position.
    VARIANTS[f"vit_{_size}14_reg4"] = dict(_DINOV2, **_shape, reg_tokens=4, no_embed_class=True)


def _pair(x: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    return (x, x) if isinstance(x, int) else (int(x[0]), int(x[1]))


def _init_param(param: nn.Parameter, init_fn: Callable[[torch.Tensor], object]) -> None:
    """Initialise a parameter in place, also when ZeRO-3 has already partitioned it.

    Inside `deepspeed.zero.Init` every module's parameters are partitioned as soon as its own
    __init__ returns, so by the time the ViT initialises its Linear layers each rank holds only a
    shard (often an empty tensor); writing to it would silently leave most weights
    uninitialised. GatheredParameters materialises the full tensor, rank 0 initialises it, and
    DeepSpeed broadcasts and re-partitions on exit. Rank 0 consumes the same random numbers in
    the same order as a non-partitioned build, so a given seed gives the same model either way.
    """
    def fill(p: torch.Tensor) -> None:
        if p.is_meta:  # shape-only model (parameter counts): nothing to fill
            return
        # Draw in float32 whatever the parameter's dtype (zero.Init may create bf16 parameters):
        # the same seed then gives the same values, rounded once.
        with torch.no_grad():
            # zero.Init patches torch.empty to return bf16 even when float32 is asked for; .float() copies.
            values = torch.empty(p.shape, dtype=torch.float32, device="cpu").float()
            init_fn(values)
            p.copy_(values)

    if is_partitioned(param):
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if torch.distributed.get_rank() == 0:
                fill(param)
    else:
        fill(param)


def _trunc_normal(std: float) -> Callable[[torch.Tensor], object]:
    # timm's trunc_normal_ truncates at +-2 absolute (i.e. 100 std at 0.02): effectively a normal.
    return partial(nn.init.trunc_normal_, std=std, a=-2.0, b=2.0)


def _uniform(bound: float) -> Callable[[torch.Tensor], object]:
    return partial(nn.init.uniform_, a=-bound, b=bound)


class PatchEmbed(nn.Module):
    """Eq. 1: cut the image into P x P patches and project each linearly to D.

    A Conv2d whose kernel and stride are both P is exactly that per-patch linear projection.
    """

    def __init__(self, img_size: int | tuple[int, int] = 224, patch_size: int = 16, in_chans: int = 3,
                 embed_dim: int = 768, dynamic_img_size: bool = False):
        super().__init__()
        self.img_size = _pair(img_size)
        self.dynamic_img_size = dynamic_img_size
        self.patch_size = (patch_size, patch_size)
        if self.img_size[0] % patch_size or self.img_size[1] % patch_size:
            raise ValueError(f"img_size {self.img_size} is not divisible by patch_size {patch_size}")
        self.grid_size = (self.img_size[0] // patch_size, self.img_size[1] // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dynamic_img_size:
            p = self.patch_size[0]
            if x.shape[-2] % p or x.shape[-1] % p:
                # The convolution would silently drop the last partial row/column of pixels.
                raise ValueError(f"input is {tuple(x.shape[-2:])}, not a multiple of the patch size {p}")
        elif x.shape[-2:] != self.img_size:
            raise ValueError(f"input is {tuple(x.shape[-2:])} but the model was built for {self.img_size}")
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, D, h, w) -> (B, N, D)


class Attention(nn.Module):
    """Multi-head self-attention (MSA); the softmax(QK^T / sqrt(d))V product runs in SDPA's fused kernels."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.attn_drop = attn_drop
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        # (B, N, 3D) -> 3 x (B, heads, N, head_dim): the layout SDPA wants, same split as timm.
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.0)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))


class Mlp(nn.Module):
    """Linear(D, 4D) -> GELU -> Linear(4D, D), dropout after each dense layer as in the paper."""

    def __init__(self, dim: int, hidden_dim: int, drop: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class SwiGLU(nn.Module):
    """SwiGLU MLP (Shazeer, arXiv 2002.05202) in timm's packed layout (`SwiGLUPacked`): fc1 projects to
    both halves at once, SiLU(first half) gates the second, fc2 projects back. Meta's SwiGLUFFNFused is the
    same computation with fc1/fc2 named w12/w3; the names are converted on load."""

    def __init__(self, dim: int, hidden_dim: int, drop: float = 0.0):
        super().__init__()
        if hidden_dim % 2:
            raise ValueError(f"SwiGLU needs an even fc1 width (value and gate halves), got {hidden_dim}")
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.SiLU()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim // 2, dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = self.fc1(x).chunk(2, dim=-1)
        return self.drop2(self.fc2(self.drop1(self.act(x1) * x2)))


MLP_LAYERS: dict[str, type[nn.Module]] = {"mlp": Mlp, "swiglu": SwiGLU}


class LayerScale(nn.Module):
    """Per-channel scale on a residual branch (CaiT, Touvron et al., arXiv 2103.17239): starting near zero
    (DINOv2: 1e-5), every block begins close to the identity, which keeps deep models stable early on."""

    def __init__(self, dim: int, init_values: float):
        super().__init__()
        self.init_values = init_values
        self.gamma = nn.Parameter(torch.full((dim,), float(init_values)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class DropPath(nn.Module):
    """Stochastic depth: drop the whole residual branch per sample (DeiT; the paper uses none)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1.0 - self.p)
        return x * keep / (1.0 - self.p)


class Block(nn.Module):
    """Eq. 2-3: a pre-norm transformer block."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 drop: float = 0.0, attn_drop: float = 0.0, drop_path: float = 0.0,
                 init_values: float | None = None, mlp_layer: str = "mlp"):
        super().__init__()
        if mlp_layer not in MLP_LAYERS:
            raise ValueError(f"mlp_layer must be one of {', '.join(MLP_LAYERS)}, got {mlp_layer!r}")
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=drop)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = MLP_LAYERS[mlp_layer](dim, int(dim * mlp_ratio), drop=drop)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x


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
    patch embeddings (iBOT; Meta's prepare_tokens_with_masks).
    """

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

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, dynamic_img_size)
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
        (`pipeline.objectives.dino.DINOv2Model`) exempts none of these by name, as Meta's parameter groups."""
        return {"pos_embed", "cls_token", "reg_token"}

    def group_matcher(self, coarse: bool = False) -> dict[str, str]:
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
        bound = 1.0 / math.sqrt(proj.in_channels * proj.kernel_size[0] * proj.kernel_size[1])
        _init_param(proj.weight, _uniform(bound))
        _init_param(proj.bias, _uniform(bound))
        _init_param(self.pos_embed, _trunc_normal(0.02))
        _init_param(self.cls_token, _trunc_normal(0.02))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                _init_param(module.weight, _trunc_normal(0.02))
                if module.bias is not None:
                    _init_param(module.bias, nn.init.zeros_)
            elif isinstance(module, LayerScale):  # under zero.Init its constructor's fill is partitioned away
                _init_param(module.gamma, partial(nn.init.constant_, val=module.init_values))
        # Drawn after everything else so that a model without them consumes the same random numbers as before.
        if self.reg_token is not None:
            _init_param(self.reg_token, partial(nn.init.normal_, std=1e-6))  # timm's and Meta's init
        if self.mask_token is not None:
            _init_param(self.mask_token, nn.init.zeros_)  # Meta's init

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
            _init_param(self.head.weight, nn.init.zeros_)
            _init_param(self.head.bias, nn.init.zeros_)

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def variant_kwargs(name: str, **overrides) -> dict:
    """The constructor arguments of a named variant, with overrides applied (None values ignored)."""
    if name not in VARIANTS:
        raise KeyError(f"unknown ViT variant '{name}'; choose one of: {', '.join(VARIANTS)}")
    kwargs: dict = dict(VARIANTS[name])
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    return kwargs


def build_vit(name: str, **overrides) -> VisionTransformer:
    """`build_vit("vit_b16", num_classes=10, img_size=384)`."""
    return VisionTransformer(**variant_kwargs(name, **overrides))


def model_kwargs_from_config(model_cfg, num_classes: int | None = None) -> dict:
    """Constructor arguments from a `pipeline.config.ModelConfig` (num_classes from the data if unset)."""
    classes = model_cfg.num_classes if model_cfg.num_classes is not None else num_classes
    if classes is None:
        raise ValueError("model.num_classes is not set and no data set gave a class count")
    return variant_kwargs(
        model_cfg.variant,
        img_size=_pair(model_cfg.img_size), num_classes=classes,
        patch_size=model_cfg.patch_size, embed_dim=model_cfg.embed_dim, depth=model_cfg.depth,
        num_heads=model_cfg.num_heads, mlp_ratio=model_cfg.mlp_ratio, qkv_bias=model_cfg.qkv_bias,
        drop_rate=model_cfg.drop_rate, attn_drop_rate=model_cfg.attn_drop_rate,
        drop_path_rate=model_cfg.drop_path_rate, representation_size=model_cfg.representation_size,
        global_pool=model_cfg.global_pool,
        # None keeps the variant's choice (the DINOv2 variants set these).
        init_values=model_cfg.init_values, reg_tokens=model_cfg.reg_tokens, no_embed_class=model_cfg.no_embed_class,
        mlp_layer=model_cfg.mlp_layer, dynamic_img_size=model_cfg.dynamic_img_size,
    )


def model_flops(kwargs: dict, img_size: int | tuple[int, int] | None = None) -> float:
    """Forward FLOPs per image (multiply-adds x 2) from the model's shape alone.

    Counts the matrix products: patch projection, per block QKV (3D^2 N), QK^T and AV (2 N^2 D),
    output projection (D^2 N), MLP (2 r D^2 N), pre-logits and head. Norms, softmax and GELU are
    O(ND) and left out, as in timm's published GMACs (B/16@224: 17.58 G, ours 17.56 G).
    A training step costs 3x this (backward = 2x forward).
    """
    h, w = _pair(img_size if img_size is not None else kwargs.get("img_size", 224))
    p, d = kwargs.get("patch_size", 16), kwargs.get("embed_dim", 768)
    depth, ratio = kwargs.get("depth", 12), kwargs.get("mlp_ratio", 4.0)
    in_chans, classes = kwargs.get("in_chans", 3), kwargs.get("num_classes", 1000)
    rep = kwargs.get("representation_size") or 0
    n_patches = (h // p) * (w // p)
    n = n_patches + 1 + kwargs.get("reg_tokens", 0)
    # MLP: fc1 D -> rD and fc2 rD -> D; SwiGLU's fc2 takes half of fc1's width (the gated half).
    mlp = 1.5 * ratio if kwargs.get("mlp_layer", "mlp") == "swiglu" else 2 * ratio
    macs = n_patches * in_chans * p * p * d
    macs += depth * (n * d * d * (4 + mlp) + 2 * n * n * d)
    macs += d * rep + (rep or d) * classes
    return 2.0 * macs


def num_params(model: nn.Module) -> int:
    return sum(real_numel(p) for p in model.parameters())  # full sizes, also of ZeRO-3's 1-D placeholders
