"""The ViT's building blocks, in timm's names and shapes (timm/layers): the patch embedding, attention, the
MLPs (GELU, SwiGLU), LayerScale, stochastic depth and the pre-norm block; and in-place init that also works
on a parameter ZeRO-3 has partitioned (`init_param`). pipeline/model/vit.py assembles them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.model.variants import conv_stem_widths, pair
from pipeline.zero3 import is_partitioned


def init_param(param: nn.Parameter, init_fn: Callable[[torch.Tensor], object]) -> None:
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


def trunc_normal(std: float) -> Callable[[torch.Tensor], object]:
    # timm's trunc_normal_ truncates at +-2 absolute (i.e. 100 std at 0.02): effectively a normal.
    return partial(nn.init.trunc_normal_, std=std, a=-2.0, b=2.0)


def uniform(bound: float) -> Callable[[torch.Tensor], object]:
    return partial(nn.init.uniform_, a=-bound, b=bound)


PATCH_EMBED_IMPLS = ("conv", "matmul")


class PatchProjection(nn.Conv2d):
    """The per-patch linear projection E of Eq. 1, stored as timm stores it (a Conv2d with kernel = stride = P:
    `proj.weight` (D, C, P, P), `proj.bias`), computed one of two ways:

    - 'conv' (default): the convolution, bit for bit timm's;
    - 'matmul': one matrix product of the unfolded patches (B, N, C P P) with the weight as (D, C P P). The same
      sum of products in another order: equal to the convolution within float rounding, not bit for bit. On an
      H100 the convolution ran as cuDNN's `precomputed_convolve_sgemm` at about 30 TFLOP/s (7.8 ms of a ViT-B/16
      step, docs/performance.md); as a matmul the product goes to cuBLAS's tensor-core kernels.

    The matmul runs in this module's own forward, not on its weight from outside: ZeRO-3 gathers a module's
    parameters when that module runs."""

    def __init__(self, in_chans: int, embed_dim: int, patch_size: int, impl: str = "conv"):
        super().__init__(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        if impl not in PATCH_EMBED_IMPLS:
            raise ValueError(f"patch_embed_impl must be one of {', '.join(PATCH_EMBED_IMPLS)}, got {impl!r}")
        self.impl = impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "conv":
            return super().forward(x)
        B, C, H, W = x.shape
        p = self.kernel_size[0]
        h, w = H // p, W // p  # as the convolution, a partial last row/column is dropped (PatchEmbed refuses it)
        # (B, C, h, p, w, p) -> (B, h, w, C, p, p): each patch's pixels in the weight's (C, P, P) order.
        patches = x[..., :h * p, :w * p].reshape(B, C, h, p, w, p).permute(0, 2, 4, 1, 3, 5).reshape(B, h * w, -1)
        y = F.linear(patches, self.weight.reshape(self.out_channels, -1), self.bias)  # (B, N, D)
        # The convolution's (B, D, h, w), as a view: PatchEmbed's flatten and transpose give y back uncopied.
        return y.transpose(1, 2).unflatten(2, (h, w))


STEMS = ("patch", "conv")


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of a (B, C, H, W) map at each position (ConvNeXt's): a sample's output never
    depends on the rest of its batch, so a run is the same whatever the ranks and micro batches (BatchNorm's is
    not)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvStem(nn.Sequential):
    """The patchify projection replaced by a few convolutions (Xiao et al. 2021, "Early convolutions help
    transformers see better", arXiv 2106.14881): a 3x3 convolution at full resolution, then one 3x3 convolution
    of stride 2 per halving of the patch size (log2 P of them), each followed by a norm and a ReLU, the widths
    doubling up to D; then a 1x1 convolution to D, as the paper's stem ends. The grid is the patchify's (H/P x
    W/P); each token sees its patch and a few pixels around it. The paper's norm is BatchNorm; here it is
    LayerNorm2d, so that a sample's tokens do not depend on its batch. The Fashion-MNIST presets use it
    (docs/quality.md). `patch_size` must be a power of 2."""

    def __init__(self, in_chans: int, embed_dim: int, patch_size: int):
        layers: list[nn.Module] = []
        chans = in_chans
        for i, width in enumerate(conv_stem_widths(embed_dim, patch_size)):  # FLOPs: variants.conv_stem_macs
            layers += [nn.Conv2d(chans, width, 3, stride=1 if i == 0 else 2, padding=1, bias=False),
                       LayerNorm2d(width, eps=1e-6), nn.ReLU()]
            chans = width
        layers.append(nn.Conv2d(chans, embed_dim, 1))
        super().__init__(*layers)


class PatchEmbed(nn.Module):
    """Eq. 1: cut the image into P x P patches and project each linearly to D (or, with stem='conv', the same
    grid of tokens from ConvStem).

    A Conv2d whose kernel and stride are both P is exactly that per-patch linear projection (`impl`: how it is
    computed, PatchProjection).
    """

    def __init__(self, img_size: int | tuple[int, int] = 224, patch_size: int = 16, in_chans: int = 3,
                 embed_dim: int = 768, dynamic_img_size: bool = False, impl: str = "conv", stem: str = "patch"):
        super().__init__()
        self.img_size = pair(img_size)
        self.dynamic_img_size = dynamic_img_size
        self.patch_size = (patch_size, patch_size)
        if self.img_size[0] % patch_size or self.img_size[1] % patch_size:
            raise ValueError(f"img_size {self.img_size} is not divisible by patch_size {patch_size}")
        self.grid_size = (self.img_size[0] // patch_size, self.img_size[1] // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        if stem not in STEMS:
            raise ValueError(f"stem must be one of {', '.join(STEMS)}, got {stem!r}")
        # 'conv': the same grid of tokens from a convolutional stem (ConvStem), not one linear map per patch.
        self.proj = PatchProjection(in_chans, embed_dim, patch_size, impl) if stem == "patch" else \
            ConvStem(in_chans, embed_dim, patch_size)

    @property
    def input_conv(self) -> nn.Conv2d:
        """The convolution the image enters (the projection, or the conv stem's first): its weight's channels are
        what a change of channels adapts (pipeline/model/channels.py)."""
        return self.proj[0] if isinstance(self.proj, ConvStem) else self.proj

    @property
    def input_weight_name(self) -> str:
        """`input_conv`'s weight's name in the model's state dict."""
        return "patch_embed.proj.0.weight" if isinstance(self.proj, ConvStem) else "patch_embed.proj.weight"

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
