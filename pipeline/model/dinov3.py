"""The DINOv3 backbone (Siméoni et al., "DINOv3", arXiv 2508.10104): a pre-norm ViT whose positions are rotary
(pipeline/model/rope.py) rather than a learned table, with storage (register) tokens and LayerScale.

    tokens      [class; storage x R; patches], patches from a P x P convolution (P = 16), no position added
    block       x = x + gamma_1 * Attn(LN(x)), x = x + gamma_2 * MLP(LN(x)); LayerNorm eps 1e-5
    attention   qkv without bias, or with query and value biases and a key bias fixed at zero (Meta's
                mask_k_bias, on in its released models; under RoPE a key bias is rotated with its patch, so
                it would not cancel in the softmax as without positions); RoPE on the queries and keys of
                the patches, the class and storage tokens unrotated
    MLP         Linear -> GELU -> Linear, or SwiGLU with separate gate and value projections (S+, H+, 7B)
    output      LN of every token; the class token is the image's feature

Parameter names, shapes and forward are those of timm's DINOv3 ViTs (`timm.models.eva.Eva` as
`vit_*_patch16_dinov3[_qkvb]` build it: gamma_1/gamma_2, attn.q_bias/v_bias, mlp.fc1_g/fc1_x/fc2, reg_token),
so state dicts move between timm's class and ours unchanged and give the same features; tests/unit/
test_dinov3.py checks it at two resolutions. Meta's names differ (storage_tokens, ls1.gamma, one qkv.bias
with a bias_mask, SwiGLU's w1/w2/w3, rope_embed.periods); timm's checkpoint_filter_fn maps them.

The variants (`VARIANTS`, reachable as `model.variant` through pipeline.model.variants) are Meta's released
backbones' shapes (dinov3/hub/backbones.py), named as Meta's hub names them. Initialisation is Meta's
(init_weights_vit): trunc-normal(0.02) Linear weights, zero biases, class and storage tokens normal(0.02),
the patch projection U(+-1/sqrt(fan_in)), LayerScale at `init_values`.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.model.layers import Attention, DropPath, Mlp, PatchEmbed, init_param, trunc_normal, uniform
from pipeline.model.rope import NormalizeCoords, RopeAugment, RopePositionEmbedding, apply_rope
from pipeline.model.variants import DINOV3_VARIANTS as VARIANTS  # noqa: F401 - the DINOv3 presets, re-exported
from pipeline.model.variants import is_dinov3, swiglu_hidden, variant_kwargs
from pipeline.model.vit import TokenFeatures, VisionTransformer


class SwiGLU(nn.Module):
    """SwiGLU (Shazeer, arXiv 2002.05202) with separate projections, timm's `SwiGLU` names: fc2(SiLU(fc1_g(x)) *
    fc1_x(x)). Meta's SwiGLUFFN is the same with w1 (gate), w2 (value), w3. Not vit.py's packed SwiGLU (one fc1
    of both halves, DINOv2's layout): timm's DINOv3 models use this one."""

    def __init__(self, dim: int, hidden_dim: int, drop: float = 0.0):
        super().__init__()
        self.fc1_g = nn.Linear(dim, hidden_dim)
        self.fc1_x = nn.Linear(dim, hidden_dim)
        self.act = nn.SiLU()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1_g(x)) * self.fc1_x(x))))


class RopeAttention(Attention):
    """Multi-head self-attention with RoPE on the patch tokens, in SDPA (layers.Attention's, the rotation added).
    `qkv_bias`: query and value biases (timm's q_bias, v_bias), the key's fixed at zero."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = False, attn_drop: float = 0.0,
                 proj_drop: float = 0.0):
        super().__init__(dim, num_heads, qkv_bias=False, attn_drop=attn_drop, proj_drop=proj_drop)
        self.q_bias = nn.Parameter(torch.zeros(dim)) if qkv_bias else None
        self.v_bias = nn.Parameter(torch.zeros(dim)) if qkv_bias else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        B, N, C = x.shape
        # Through qkv's own forward (timm's qkv_bias_separate), not F.linear on its weight: ZeRO-3 gathers a
        # module's parameters when that module runs.
        qkv = self.qkv(x)
        if self.q_bias is not None:
            qkv = qkv + torch.cat([self.q_bias, torch.zeros_like(self.q_bias), self.v_bias])
        q, k, v = qkv.reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.0)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))


class Block(nn.Module):
    """A pre-norm block with LayerScale as parameters of the block (timm's Eva: gamma_1, gamma_2)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = False, drop: float = 0.0,
                 attn_drop: float = 0.0, drop_path: float = 0.0, init_values: float | None = None,
                 mlp_layer: str = "mlp", swiglu_align_to: int = 0, norm_eps: float = 1e-5):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = RopeAttention(dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=drop)
        self.init_values = init_values
        self.gamma_1 = nn.Parameter(torch.full((dim,), float(init_values))) if init_values is not None else None
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        if mlp_layer == "mlp":
            self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)
        elif mlp_layer == "swiglu":
            self.mlp = SwiGLU(dim, swiglu_hidden(dim, mlp_ratio, swiglu_align_to), drop=drop)
        else:
            raise ValueError(f"mlp_layer must be 'mlp' or 'swiglu', got {mlp_layer!r}")
        self.gamma_2 = nn.Parameter(torch.full((dim,), float(init_values))) if init_values is not None else None
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        y = self.attn(self.norm1(x), rope)
        x = x + self.drop_path1(y if self.gamma_1 is None else self.gamma_1 * y)
        y = self.mlp(self.norm2(x))
        return x + self.drop_path2(y if self.gamma_2 is None else self.gamma_2 * y)


class DINOv3ViT(nn.Module):
    """The DINOv3 ViT: any input whose sides are multiples of the patch size (RoPE has no table to resize).

    Every option a constructor argument, in vit.py's names where they mean the same: `init_values` LayerScale's
    start (None: none); `reg_tokens` storage tokens; `qkv_bias` query/value biases; `mlp_layer` 'mlp' or
    'swiglu' (`swiglu_align_to` rounds its width); `norm_eps`; `rope_temperature` (or `rope_min_period` and
    `rope_max_period`) and `rope_normalize_coords` the positions; `rope_shift_coords`, `rope_jitter_coords`,
    `rope_rescale_coords` their training-time augmentation, whose per-sample draws (`rope_augment()`) come in
    as `rope_aug`; `drop_path_uniform` the same stochastic-depth rate in every block (Meta's) instead of one
    growing linearly (timm's); `mask_token` iBOT's (1, D) embedding for masked patches (Meta's name and shape);
    `global_pool` 'token' (the class token; Meta's) or 'avg' (the mean of the patch tokens after the final
    norm: timm's default for these models, without fc_norm). `img_size` is the size the model is built for
    (FLOPs, the data pipeline); any other size of the patch grid runs too.
    """

    ARCH_KEYS: tuple[str, ...] = ("img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads", "mlp_ratio",
                                  "qkv_bias", "num_classes", "global_pool", "init_values", "reg_tokens", "mlp_layer",
                                  "swiglu_align_to", "norm_eps", "rope_temperature", "rope_min_period",
                                  "rope_max_period", "rope_normalize_coords", "mask_token")
    """As VisionTransformer.ARCH_KEYS: what decides the weights and what they mean (the RoPE's periods and
    coordinates; not its training-time augmentation, which a later stage may change)."""

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
        drop_path_uniform: bool = False,
        global_pool: str = "token",
        init_values: float | None = 1e-5,
        reg_tokens: int = 4,
        mlp_layer: str = "mlp",
        swiglu_align_to: int = 0,
        norm_eps: float = 1e-5,
        rope_temperature: float | None = 100.0,
        rope_min_period: float | None = None,
        rope_max_period: float | None = None,
        rope_normalize_coords: NormalizeCoords = "separate",
        rope_shift_coords: float | None = None,
        rope_jitter_coords: float | None = None,
        rope_rescale_coords: float | None = None,
        mask_token: bool = False,
        patch_embed_impl: str = "conv",
    ):
        super().__init__()
        if global_pool not in ("token", "avg"):
            raise ValueError(f"global_pool must be 'token' or 'avg', got {global_pool!r}")
        if reg_tokens < 0:
            raise ValueError(f"reg_tokens must be >= 0, got {reg_tokens}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        self.global_pool = global_pool
        self.num_classes = num_classes
        self.embed_dim = embed_dim
        self.num_reg_tokens = reg_tokens
        self.num_prefix_tokens = 1 + reg_tokens
        self.no_embed_class = True  # no position table at all: nothing for a class row (what fine-tuning asks)
        self.dynamic_img_size = True
        self.grad_checkpointing = False

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, dynamic_img_size=True,
                                      impl=patch_embed_impl)  # 'conv' or 'matmul': layers.PatchProjection
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.reg_token = nn.Parameter(torch.zeros(1, reg_tokens, embed_dim)) if reg_tokens else None  # Meta: storage_tokens
        self.mask_token = nn.Parameter(torch.zeros(1, embed_dim)) if mask_token else None
        self.rope = RopePositionEmbedding(embed_dim // num_heads, rope_temperature, rope_min_period, rope_max_period,
                                          rope_normalize_coords, rope_shift_coords, rope_jitter_coords,
                                          rope_rescale_coords)
        rates = [drop_path_rate if drop_path_uniform else drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = nn.ModuleList([
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate, rates[i], init_values,
                  mlp_layer, swiglu_align_to, norm_eps)
            for i in range(depth)
        ])
        self.norm = nn.LayerNorm(embed_dim, eps=norm_eps)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights()

    @property
    def grid_size(self) -> tuple[int, int]:
        return self.patch_embed.grid_size

    def rope_augment(self) -> RopeAugment:
        """The per-sample draw of this model's RoPE augmentation, a box per block (as Meta's code draws):
        `rope_augment()(seed)` in the loader, stacked to (B, depth, 5), is `forward(..., rope_aug=)`."""
        a = self.rope.augment
        return RopeAugment(a.shift, a.jitter, a.rescale, blocks=len(self.blocks))

    def no_weight_decay(self) -> set[str]:
        """As timm's Eva (no position table here); biases, norms and gammas (ndim <= 1) are never decayed."""
        return {"cls_token", "reg_token"}

    def group_matcher(self, coarse: bool = False) -> dict[str, str]:  # noqa: ARG002 - timm's signature
        """The stem (layer 0) and block i (layer i + 1) for layer-wise lr decay, as vit.py's."""
        return {"stem": r"^(cls_token|reg_token|mask_token|patch_embed)", "blocks": r"^blocks\.(\d+)"}

    def init_weights(self) -> None:
        """Meta's init_weights_vit, each parameter through `_init_param` (ZeRO-3's partitioned ones too)."""
        proj = self.patch_embed.proj
        bound = 1.0 / math.sqrt(proj.in_channels * proj.kernel_size[0] * proj.kernel_size[1])
        init_param(proj.weight, uniform(bound))
        init_param(proj.bias, uniform(bound))
        init_param(self.cls_token, partial(nn.init.normal_, std=0.02))
        if self.reg_token is not None:
            init_param(self.reg_token, partial(nn.init.normal_, std=0.02))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                init_param(module.weight, trunc_normal(0.02))
                if module.bias is not None:
                    init_param(module.bias, nn.init.zeros_)
            elif isinstance(module, RopeAttention) and module.q_bias is not None:
                init_param(module.q_bias, nn.init.zeros_)
                init_param(module.v_bias, nn.init.zeros_)
            elif isinstance(module, Block) and module.gamma_1 is not None:
                # under zero.Init the constructor's fill is partitioned away
                init_param(module.gamma_1, partial(nn.init.constant_, val=module.init_values))
                init_param(module.gamma_2, partial(nn.init.constant_, val=module.init_values))
        if self.mask_token is not None:
            init_param(self.mask_token, nn.init.zeros_)

    def reset_classifier(self, num_classes: int) -> None:
        """A zero-initialised Linear(D, K) head (the ViT paper's fine-tuning head, as vit.py's)."""
        self.num_classes = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.zero_head()

    def zero_head(self) -> None:
        if isinstance(self.head, nn.Linear):
            init_param(self.head.weight, nn.init.zeros_)
            init_param(self.head.bias, nn.init.zeros_)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def prepare_tokens(self, x: torch.Tensor, masks: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, tuple[int, int]]:
        """(B, C, H, W) -> ((B, 1 + R + N, D) tokens [class, storage, patches], the patch grid). `masks` (B, N)
        bool: those patch embeddings become `mask_token` (Meta's prepare_tokens_with_masks)."""
        p = self.patch_embed.patch_size
        grid = (x.shape[-2] // p[0], x.shape[-1] // p[1])
        x = self.patch_embed(x)
        if masks is not None:
            if self.mask_token is None:
                raise ValueError("masks given but the model has no mask_token (build it with mask_token=True)")
            if masks.shape != x.shape[:2]:
                raise ValueError(f"masks is {tuple(masks.shape)}, expected (batch, patches) = {tuple(x.shape[:2])}")
            x = torch.where(masks.unsqueeze(-1), self.mask_token.to(x.dtype).unsqueeze(0), x)
        prefix = [self.cls_token.expand(x.shape[0], -1, -1)]
        if self.reg_token is not None:
            prefix.append(self.reg_token.expand(x.shape[0], -1, -1))
        return torch.cat(prefix + [x], dim=1), grid

    def _ropes(self, grid: tuple[int, int], batch: int, rope_aug: torch.Tensor | None) -> list:
        """(sin, cos) for each block: one for all without augmentation; in training with augmentation, one per
        sample from `rope_aug` (B, 5) for every block, or (B, depth, 5) per block."""
        augment = self.rope.augment
        if not self.training:  # no augmentation in eval, whatever was passed
            return [self.rope(grid)] * len(self.blocks)
        if rope_aug is None:
            if augment.active:
                raise ValueError(
                    f"RoPE augmentation is configured ({augment}) but no rope_aug was given: in training the boxes "
                    f"are drawn per sample from its seed (model.rope_augment()(seed) in the loader; pipeline/model/"
                    f"rope.py), so that a sample's positions are the same on any layout")
            return [self.rope(grid)] * len(self.blocks)
        if not augment.active:
            raise ValueError("rope_aug given to a model without RoPE augmentation (rope_shift_coords, "
                             "rope_jitter_coords, rope_rescale_coords all None)")
        depth = len(self.blocks)
        if rope_aug.ndim == 2:
            rope_aug = rope_aug.unsqueeze(1).expand(-1, depth, -1)
        if rope_aug.shape[0] != batch or rope_aug.shape[1:] != (depth, 5):
            raise ValueError(f"rope_aug is {tuple(rope_aug.shape)}, expected ({batch}, 5) or ({batch}, {depth}, 5)")
        return [self.rope(grid, rope_aug[:, i]) for i in range(depth)]

    def _blocks_and_prenorm(self, x: torch.Tensor, masks: torch.Tensor | None,
                            rope_aug: torch.Tensor | None) -> torch.Tensor:
        x, grid = self.prepare_tokens(x, masks)
        for block, rope in zip(self.blocks, self._ropes(grid, x.shape[0], rope_aug)):
            if self.grad_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, rope, use_reentrant=False)
            else:
                x = block(x, rope)
        return x

    def forward_features(self, x: torch.Tensor, masks: torch.Tensor | None = None,
                         rope_aug: torch.Tensor | None = None) -> torch.Tensor:
        """All tokens after the final norm, (B, 1 + R + N, D) (timm's forward_features)."""
        return self.norm(self._blocks_and_prenorm(x, masks, rope_aug))

    def forward_tokens(self, x: torch.Tensor, masks: torch.Tensor | None = None,
                       rope_aug: torch.Tensor | None = None) -> TokenFeatures:
        """Class, storage and patch tokens after the final norm, and the tokens before it (Meta's
        x_norm_clstoken / x_storage_tokens / x_norm_patchtokens / x_prenorm)."""
        prenorm = self._blocks_and_prenorm(x, masks, rope_aug)
        x = self.norm(prenorm)
        r = self.num_prefix_tokens
        return TokenFeatures(x[:, 0], x[:, 1:r], x[:, r:], prenorm)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = x[:, self.num_prefix_tokens:].mean(dim=1) if self.global_pool == "avg" else x[:, 0]
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor, rope_aug: torch.Tensor | None = None, *, features: bool = False) -> torch.Tensor:
        """The logits; `features`: the tokens after the final norm instead, as VisionTransformer's (what
        eval.sets judges, through the engine's forward so that ZeRO-3's hooks gather the weights)."""
        tokens = self.forward_features(x, rope_aug=rope_aug)
        return tokens if features else self.forward_head(tokens)


def build_dinov3(name: str, **overrides) -> DINOv3ViT:
    """`build_dinov3("dinov3_vitb16", num_classes=10)`."""
    return DINOv3ViT(**variant_kwargs(name, **overrides))


def backbone_class(kwargs: dict) -> type[nn.Module]:
    """The class constructor arguments are for: DINOv3ViT's name its RoPE, VisionTransformer's do not."""
    return DINOv3ViT if is_dinov3(kwargs) else VisionTransformer


def build_backbone(kwargs: dict) -> nn.Module:
    """`VisionTransformer(**kwargs)` or `DINOv3ViT(**kwargs)`, whichever the arguments are for."""
    return backbone_class(kwargs)(**kwargs)
