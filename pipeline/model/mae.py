"""Masked autoencoder (He et al., "Masked Autoencoders Are Scalable Vision Learners", arXiv 2111.06377).

Sec. 3 of the paper, as this module computes it:
  - patchify, embed every patch, add the fixed 2-D sin-cos position embedding;
  - keep a random 25% of the patches per sample (argsort of uniform noise: the smallest noise is kept);
  - the encoder (our ViT: class token + blocks + norm) sees only the kept patches;
  - the decoder embeds the encoder's tokens to its own width, puts a shared learnable mask token at every
    removed position, adds its own fixed sin-cos position embedding, runs its blocks and predicts each
    patch's pixels;
  - the loss is the mean squared error on the removed patches only, against the pixels normalised per
    patch (mean and unbiased variance of the patch, eps 1e-6) when `norm_pix_loss`.

Parameter names and shapes are those of the official `MaskedAutoencoderViT` (facebookresearch/mae,
models_mae.py): patch_embed.proj, cls_token, pos_embed, blocks.N.*, norm, mask_token, decoder_embed,
decoder_pos_embed, decoder_blocks.N.*, decoder_norm, decoder_pred. Meta's released checkpoints load with
`load_state_dict` unchanged, and the encoder's names are timm's, so `pipeline.model.vit` loads the encoder
for fine-tuning. tests/unit/test_mae.py pins that layout, the tables, the masking and the loss.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.model.layers import Block, init_param
from pipeline.model.variants import pair, variant_kwargs
from pipeline.model.vit import VisionTransformer

# The paper's decoder (Sec. 3, "MAE decoder"; Table 1a/1b pick 8 blocks of width 512).
DECODER_DEFAULTS: dict[str, int] = dict(decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16)


def sincos_pos_embed_2d(dim: int, grid: tuple[int, int] | int, cls_token: bool = True) -> torch.Tensor:
    """The fixed 2-D sin-cos table of MAE (util/pos_embed.py there; MoCo v3 before it): (1, [1 +] h*w, dim).

    Tokens are numbered row-major (row i, column j -> i * w + j). The first dim/2 channels encode the
    column j, the last dim/2 the row i; each half is [sin(pos * omega_k), cos(pos * omega_k)] with
    omega_k = 10000 ** (-k / (dim / 4)), k = 0 .. dim/4 - 1. The class token's row is zeros. Computed in
    float64 and rounded once to float32, as the official numpy code does.
    """
    if dim % 4:
        raise ValueError(f"a 2-D sin-cos position embedding needs a width divisible by 4, got {dim}")
    h, w = pair(grid)
    omega = 1.0 / 10000 ** (np.arange(dim // 4, dtype=np.float64) / (dim / 4))

    def one_axis(pos: np.ndarray) -> np.ndarray:  # (M,) -> (M, dim/2)
        out = np.outer(pos.astype(np.float64), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")  # (h, w) each, row-major below
    table = np.concatenate([one_axis(cols.reshape(-1)), one_axis(rows.reshape(-1))], axis=1)
    if cls_token:
        table = np.concatenate([np.zeros((1, dim)), table], axis=0)
    return torch.from_numpy(table).float().unsqueeze(0)


def random_masking(x: torch.Tensor, mask_ratio: float, noise: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep int(L * (1 - mask_ratio)) tokens of each sample: those with the smallest `noise`.

    x: (N, L, D). noise: (N, L), uniform in [0, 1) when not given (the official `random_masking`; Hugging
    Face's ViTMAE takes the same argument). Returns the kept tokens in ascending-noise order (N, keep, D),
    the mask (N, L; 1 = removed, 0 = kept, in the original patch order) and ids_restore (N, L), the
    permutation that puts [kept, removed] back into patch order.
    """
    n, length, dim = x.shape
    keep = int(length * (1 - mask_ratio))
    if noise is None:
        noise = torch.rand(n, length, device=x.device)
    if noise.shape != (n, length):
        raise ValueError(f"noise has shape {tuple(noise.shape)}, expected ({n}, {length}): one value per patch")
    ids_shuffle = torch.argsort(noise.to(x.device), dim=1)  # ascending: the first `keep` are kept
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    kept = torch.gather(x, 1, ids_shuffle[:, :keep].unsqueeze(-1).expand(-1, -1, dim))
    mask = torch.ones(n, length, device=x.device)
    mask[:, :keep] = 0
    mask = torch.gather(mask, 1, ids_restore)  # back to patch order
    return kept, mask, ids_restore


class MaskedAutoencoderViT(VisionTransformer):
    """Our ViT as MAE's encoder (no classifier), plus the decoder; fixed sin-cos position embeddings.

    The position tables are persistent buffers, not parameters: they are in the state dict under the
    official names (so checkpoints load either way) but never trained, decayed or partitioned by ZeRO-3.
    """

    ARCH_KEYS = ("img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias",
                 "decoder_embed_dim", "decoder_depth", "decoder_num_heads")
    """The constructor arguments that decide the weights (VisionTransformer.ARCH_KEYS': the encoder's, no head)."""

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        embed_dim: int = 1024,
        depth: int = 24,
        num_heads: int = 16,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_path_rate: float = 0.0,
        decoder_embed_dim: int = 512,
        decoder_depth: int = 8,
        decoder_num_heads: int = 16,
        norm_pix_loss: bool = True,
        patch_embed_impl: str = "conv",
        fresh_roles: bool = False,
    ):
        super().__init__(img_size=img_size, patch_size=patch_size, in_chans=in_chans, num_classes=0,
                         embed_dim=embed_dim, depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio,
                         qkv_bias=qkv_bias, drop_path_rate=drop_path_rate, patch_embed_impl=patch_embed_impl)
        self.in_chans = in_chans
        self.norm_pix_loss = norm_pix_loss
        self.fresh_roles = fresh_roles  # optimizer metadata (adapt.*), not an architecture key
        grid = self.patch_embed.grid_size
        # Fixed tables replace the ViT's learnable position embedding (Sec. 3: "we add positional
        # embeddings (the sine-cosine version) to all input tokens").
        del self.pos_embed
        self.register_buffer("pos_embed", sincos_pos_embed_2d(embed_dim, grid))

        self.decoder_embed = nn.Linear(embed_dim, decoder_embed_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        self.register_buffer("decoder_pos_embed", sincos_pos_embed_2d(decoder_embed_dim, grid))
        self.decoder_blocks = nn.Sequential(*[
            Block(decoder_embed_dim, decoder_num_heads, mlp_ratio, qkv_bias=True) for _ in range(decoder_depth)])
        self.decoder_norm = nn.LayerNorm(decoder_embed_dim, eps=1e-6)
        self.decoder_pred = nn.Linear(decoder_embed_dim, patch_size * patch_size * in_chans)
        self.init_mae_weights()

    def fp32_buffers(self) -> dict[str, torch.Tensor]:
        """The fixed tables as they are exported: float32, exact (a bf16 engine casts the buffers it trains
        with; the checkpoint keeps Meta's layout and values)."""
        grid = self.patch_embed.grid_size
        return {"pos_embed": sincos_pos_embed_2d(self.embed_dim, grid),
                "decoder_pos_embed": sincos_pos_embed_2d(self.decoder_pos_embed.shape[-1], grid)}

    def param_roles(self) -> dict[str, str]:
        """With `fresh_roles` (a run started from an encoder's weights whose backbone warms up: adapt.*), the
        decoder, which no source holds, is a parameter group of its own (`pipeline.train.optim.param_groups`);
        otherwise none, and the groups are those of every MAE run."""
        return {"decoder": r"^(decoder_|mask_token$)"} if self.fresh_roles else {}

    def no_weight_decay(self) -> set[str]:
        """None: official MAE pretraining (main_pretrain.py, timm's `add_weight_decay` with no skip list)
        exempts only 1-D parameters and biases, so the class token and the mask token are decayed. The
        position tables are fixed buffers here (frozen parameters there), never decayed either way."""
        return set()

    def init_mae_weights(self) -> None:
        """The official initialisation: xavier-uniform for every Linear (as the JAX ViT) and for the patch
        projection seen as a Linear (D, C*P*P), zero biases, normal(0.02) class and mask tokens. The patch
        projection's bias keeps Conv2d's default U(+-1/sqrt(fan_in)), as there (VisionTransformer drew it)."""
        proj = self.patch_embed.proj
        fan_in = proj.in_channels * proj.kernel_size[0] * proj.kernel_size[1]
        init_param(proj.weight, _xavier_uniform(proj.out_channels, fan_in))
        init_param(self.cls_token, _normal(0.02))
        init_param(self.mask_token, _normal(0.02))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                init_param(module.weight, _xavier_uniform(module.out_features, module.in_features))
                if module.bias is not None:
                    init_param(module.bias, nn.init.zeros_)

    # ----------------------------------------------------------------------- pixels <-> patches

    def patchify(self, imgs: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) -> (N, h*w, P*P*C), each patch's pixels in (row, column, channel) order as the official."""
        p = self.patch_embed.patch_size[0]
        n, c, height, width = imgs.shape
        h, w = height // p, width // p
        x = imgs.reshape(n, c, h, p, w, p).permute(0, 2, 4, 3, 5, 1)  # n h w p q c
        return x.reshape(n, h * w, p * p * c)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """(N, h*w, P*P*C) -> (N, C, H, W), the inverse of `patchify` on this model's grid."""
        p = self.patch_embed.patch_size[0]
        h, w = self.patch_embed.grid_size
        n, c = x.shape[0], self.in_chans
        x = x.reshape(n, h, w, p, p, c).permute(0, 5, 1, 3, 2, 4)  # n c h p w q
        return x.reshape(n, c, h * p, w * p)

    # ----------------------------------------------------------------------- forward

    def _run(self, blocks: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            if self.grad_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)  # keep only block inputs; recompute in backward
            else:
                x = block(x)
        return x

    def forward_encoder(self, imgs: torch.Tensor, mask_ratio: float, noise: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Embed all patches, keep the unmasked ones, prepend the class token, encode: (N, 1 + keep, D)."""
        x = self.patch_embed(imgs) + self.pos_embed[:, 1:].to(imgs.dtype)
        x, mask, ids_restore = random_masking(x, mask_ratio, noise)
        cls = (self.cls_token + self.pos_embed[:, :1].to(self.cls_token.dtype)).expand(x.shape[0], -1, -1)
        x = self._run(self.blocks, torch.cat([cls.to(x.dtype), x], dim=1))
        return self.norm(x), mask, ids_restore

    def forward_decoder(self, latent: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
        """Mask tokens at the removed positions, patch order restored, decode: (N, L, P*P*C) pixels."""
        x = self.decoder_embed(latent)
        n, length, dim = x.shape[0], ids_restore.shape[1], x.shape[2]
        mask_tokens = self.mask_token.to(x.dtype).expand(n, length + 1 - x.shape[1], -1)
        patches = torch.cat([x[:, 1:], mask_tokens], dim=1)  # [kept..., removed...], class token aside
        patches = torch.gather(patches, 1, ids_restore.unsqueeze(-1).expand(-1, -1, dim))  # patch order
        x = torch.cat([x[:, :1], patches], dim=1) + self.decoder_pos_embed.to(x.dtype)
        x = self.decoder_norm(self._run(self.decoder_blocks, x))
        return self.decoder_pred(x)[:, 1:]  # the class token predicts nothing

    def target(self, imgs: torch.Tensor) -> torch.Tensor:
        """What the decoder must predict, in float32: the patches, normalised per patch with `norm_pix_loss`
        (its mean and unbiased variance, eps 1e-6: the official target)."""
        target = self.patchify(imgs.float())
        if self.norm_pix_loss:
            mean = target.mean(dim=-1, keepdim=True)
            var = target.var(dim=-1, keepdim=True)  # unbiased (N - 1), as torch's default and the official
            target = (target - mean) / (var + 1e-6) ** 0.5
        return target

    def forward_loss(self, imgs: torch.Tensor, pred: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean squared error per patch, averaged over the removed patches only (Sec. 3: "we compute the loss
        only on masked patches, similar to BERT")."""
        per_patch = ((pred.float() - self.target(imgs)) ** 2).mean(dim=-1)
        return (per_patch * mask).sum() / mask.sum()

    def forward(self, imgs: torch.Tensor, mask_ratio: float = 0.75, noise: torch.Tensor | None = None, *,
                encode_only: bool = False):
        """-> (loss, pred (N, L, P*P*C), mask (N, L) with 1 = removed). `noise` (N, L) fixes the mask.

        encode_only: the encoder's tokens of the whole image, unmasked, in patch order (N, 1 + L, D) - the
        features a k-NN or a probe reads. Through forward (not a method call) so ZeRO-3 gathers the weights."""
        if encode_only:
            x = self.patch_embed(imgs) + self.pos_embed[:, 1:].to(imgs.dtype)
            cls = (self.cls_token + self.pos_embed[:, :1].to(self.cls_token.dtype)).expand(x.shape[0], -1, -1)
            return self.norm(self._run(self.blocks, torch.cat([cls.to(x.dtype), x], dim=1)))
        latent, mask, ids_restore = self.forward_encoder(imgs, mask_ratio, noise)
        pred = self.forward_decoder(latent, ids_restore)
        return self.forward_loss(imgs, pred, mask), pred, mask


def _xavier_uniform(fan_out: int, fan_in: int):
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return lambda t: nn.init.uniform_(t, -bound, bound)


def _normal(std: float):
    return lambda t: nn.init.normal_(t, std=std)


def mae_kwargs(variant: str, **overrides) -> dict:
    """Constructor arguments of `MaskedAutoencoderViT` for a ViT variant, the paper's decoder, and overrides
    (None values ignored). Supervised-only options (num_classes, dropout, pre-logits) are refused."""
    decoder = {k: overrides.pop(k) for k in list(overrides) if k in DECODER_DEFAULTS or k == "norm_pix_loss"}
    kwargs = variant_kwargs(variant, **overrides)
    unsupported = sorted(k for k in kwargs if k not in _MAE_ARGS)
    if unsupported:
        raise ValueError(f"MAE takes no {', '.join(unsupported)} (encoder options: {', '.join(sorted(_MAE_ARGS))})")
    kwargs.update(DECODER_DEFAULTS)
    kwargs.update({k: v for k, v in decoder.items() if v is not None})
    return kwargs


_MAE_ARGS = ("img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias",
             "drop_path_rate", "patch_embed_impl")


def build_mae(variant: str, img_size: int | tuple[int, int] = 224, **overrides) -> MaskedAutoencoderViT:
    """`build_mae("vit_b16")` is the official mae_vit_base_patch16 (decoder 512 wide, 8 blocks, 16 heads)."""
    return MaskedAutoencoderViT(**mae_kwargs(variant, img_size=img_size, **overrides))


def mae_flops(kwargs: dict, mask_ratio: float = 0.75) -> float:
    """Forward FLOPs of one image's MAE step (multiply-adds x 2), counted as `model_flops` counts the ViT.

    What the step computes: the patch projection on every patch, the encoder's blocks on the class token
    and the kept patches, decoder_embed on those, the decoder's blocks on the class token and all
    patches, decoder_pred on all tokens. A training step costs 3x this.
    """
    h, w = pair(kwargs.get("img_size", 224))
    p, d = kwargs.get("patch_size", 16), kwargs.get("embed_dim", 768)
    depth, ratio = kwargs.get("depth", 12), kwargs.get("mlp_ratio", 4.0)
    c = kwargs.get("in_chans", 3)
    dd = kwargs.get("decoder_embed_dim", 512)
    ddepth = kwargs.get("decoder_depth", 8)
    n_patches = (h // p) * (w // p)
    n_enc = int(n_patches * (1 - mask_ratio)) + 1
    n_dec = n_patches + 1

    def blocks(n: int, dim: int, count: int) -> float:  # QKV + proj + MLP (linear in n), QK^T and AV (n^2)
        return count * (n * dim * dim * (4 + 2 * ratio) + 2 * n * n * dim)

    macs = n_patches * c * p * p * d + blocks(n_enc, d, depth)
    macs += n_enc * d * dd + blocks(n_dec, dd, ddepth) + n_dec * dd * p * p * c
    return 2.0 * macs
