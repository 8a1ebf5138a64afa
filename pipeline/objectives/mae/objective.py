"""The MAE objective (He et al. 2021): the model from the config, each sample's mask from its
position in the global order, and the MAE evaluation (reconstruction loss, reconstructions as an image,
k-NN top-1 of the encoder's features where the validation split has labels).

Masks are drawn like augmentations (pipeline/data/order.py): the noise that decides which patches of the
sample at global position p are kept is a function of (train.seed, p) only, so step t masks the same
patches on 1 GPU or 64, with any micro batch, and after a resume. Validation masks are a function of
(train.seed, the sample's index in the split): every evaluation of a run scores the same patches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch import nn

from pipeline.config import Config, DataConfig
from pipeline.data import label_free, raise_if_any_failed
from pipeline.data.order import MASK, MASK_EVAL
from pipeline.dist import DistEnv
from pipeline.eval.features import Features, extract
from pipeline.eval.knn import knn_loaders, knn_top1
from pipeline.model.mae import MaskedAutoencoderViT, mae_flops, mae_kwargs
from pipeline.objectives.adapt import backbone_lr_schedule, wants_roles
from pipeline.objectives.base import EvalResult, Objective, TrainView


def mae_model_kwargs(cfg: Config) -> dict[str, Any]:
    """`MaskedAutoencoderViT` arguments from model.* (the encoder, as for a supervised ViT) and mae.*."""
    m, mae = cfg.model, cfg.mae
    img = m.img_size if isinstance(m.img_size, int) else (int(m.img_size[0]), int(m.img_size[1]))
    return mae_kwargs(m.variant, img_size=img, patch_size=m.patch_size, embed_dim=m.embed_dim, depth=m.depth,
                      num_heads=m.num_heads, mlp_ratio=m.mlp_ratio, qkv_bias=m.qkv_bias,
                      drop_path_rate=m.drop_path_rate, decoder_embed_dim=mae.decoder_embed_dim,
                      decoder_depth=mae.decoder_depth, decoder_num_heads=mae.decoder_num_heads,
                      norm_pix_loss=mae.norm_pix_loss,
                      **({"patch_embed_impl": m.patch_embed_impl} if m.patch_embed_impl != "conv" else {}),
                      # the set's channels (pipeline/data/pixels.py): the pixel target follows; RGB kwargs unchanged
                      **({"in_chans": m.in_chans} if m.in_chans not in (None, 3) else {}))


def mask_noise(namespace: int, seed: int, positions, num_patches: int) -> torch.Tensor:
    """(len(positions), num_patches) float64 uniform noise, row i a function of (namespace, seed,
    positions[i]) only. float64: ties among 196 float32 draws happen about once per thousand images, and
    argsort breaks ties differently on different devices."""
    return torch.from_numpy(noise_rows(namespace, seed, positions, num_patches))


def noise_rows(namespace: int, seed: int, positions, num_patches: int) -> np.ndarray:
    """`mask_noise` as a NumPy array: what DataLoader workers compute with each batch (`train_noise_fn`)."""
    return np.stack([np.random.Generator(np.random.PCG64(np.random.SeedSequence([namespace, seed, int(p)])))
                     .random(num_patches) for p in positions])


def train_noise(seed: int, positions, num_patches: int) -> torch.Tensor:
    """The noise of the training samples at these global positions (the mask: the smallest 25% kept)."""
    return mask_noise(MASK, seed, positions, num_patches)


def num_patches(model_kwargs: dict[str, Any]) -> int:
    """Patches per image of a `MaskedAutoencoderViT(**model_kwargs)`: the width of each noise row."""
    size, p = model_kwargs["img_size"], model_kwargs["patch_size"]
    h, w = (size, size) if isinstance(size, int) else size
    return (h // p) * (w // p)


def train_noise_fn(seed: int, num_patches: int) -> Callable[[range], np.ndarray]:
    """`train_noise` for the train loader's workers (`build_train_loader(per_batch=...)`): about 8 ms per
    256 samples of SeedSequence work that stays off the training thread."""
    return functools.partial(noise_rows, MASK, seed, num_patches=num_patches)


def eval_noise(seed: int, indices, num_patches: int) -> torch.Tensor:
    """The noise of validation samples by their index in the split."""
    return mask_noise(MASK_EVAL, seed, indices, num_patches)


# ----------------------------------------------------------------------------- evaluation


def _unwrap(engine) -> MaskedAutoencoderViT:
    return engine.module if hasattr(engine, "module") else engine


@torch.no_grad()
def evaluate_mae(engine, eval_loader, knn_loader, cfg: Config, dtype: torch.dtype, run_dir: Path | None,
                 step: int) -> tuple[dict[str, float], Path | None]:
    """Reconstruction loss over the validation split (each image's masked patches, fixed masks), the
    reconstructions of its first `mae.recon_images` images as a PNG (rank 0 writes it; returned), and the
    k-NN top-1 of the encoder's average-pooled features when `knn_loader` (a labelled train subset) is
    given and the validation split has labels. Every rank runs the same number of forwards (ZeRO-3)."""
    engine.eval()
    model = _unwrap(engine)
    device, n_patches = engine.device, model.patch_embed.num_patches
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # sum of per-image losses, images
    shown: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    val = Features()
    for images, targets, valid in eval_loader:
        ids = eval_loader.last_ids
        images = images.to(device, dtype, non_blocking=True)
        noise = eval_noise(cfg.train.seed, ids.tolist(), n_patches).to(device)
        _, pred, mask = engine(images, mask_ratio=cfg.mae.mask_ratio, noise=noise)
        # Per image, as the official loss per batch: mean over its removed patches.
        per_patch = ((pred.float() - model.target(images)) ** 2).mean(-1)
        per_image = (per_patch * mask).sum(1) / mask.sum(1).clamp(min=1)
        v = valid.to(device, torch.float64)
        totals += torch.stack([(per_image.double() * v).sum(), v.sum()])
        for k, i in enumerate(ids.tolist()):
            if i < cfg.mae.recon_images and bool(valid[k]):
                shown[i] = (images[k].float().cpu(), pred[k].float().cpu(), mask[k].cpu())
        if knn_loader is not None:
            val.add(_features(engine, images), targets, valid)
    metrics: dict[str, float] = {}
    if knn_loader is not None:
        memory = extract(knn_loader, lambda x: _features(engine, x), device, dtype)
        metrics.update(knn_top1(*val.tensors(), *memory.tensors(), cfg.mae.knn_k))
    raise_if_any_failed(eval_loader, knn_loader)  # collective: one rank's failed pass stops all of them here
    if dist.is_initialized():
        dist.all_reduce(totals)
    engine.train()
    metrics["eval/recon_loss"] = totals[0].item() / max(totals[1].item(), 1.0)
    metrics["eval/samples"] = totals[1].item()
    image = None
    if shown and run_dir is not None:
        image = save_reconstructions(model, [shown[i] for i in sorted(shown)], cfg.data,
                                     run_dir / "reconstructions" / f"step{step:08d}.png")
    return metrics, image


def _features(engine, images: torch.Tensor) -> torch.Tensor:
    """The encoder on the whole image, its patch tokens averaged and L2-normalised (what fine-tuning's
    global pool sees): (N, D) float32."""
    tokens = engine(images, encode_only=True)
    return F.normalize(tokens[:, 1:].float().mean(1), dim=-1)


def save_reconstructions(model: MaskedAutoencoderViT, shown: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                         data: DataConfig, path: Path) -> Path:
    """One PNG, a row per image: the masked input (removed patches grey), the reconstruction (predicted
    patches with the visible ones pasted back, as the paper's figures) and the original."""
    rows = []
    for image, pred, mask in shown:
        img = image.unsqueeze(0)
        if model.norm_pix_loss:  # the prediction is in per-patch normalised units: undo with the true patch's
            patches = model.patchify(img)
            mean, var = patches.mean(-1, keepdim=True), patches.var(-1, keepdim=True)
            pred = pred.unsqueeze(0) * (var + 1e-6) ** 0.5 + mean
        else:
            pred = pred.unsqueeze(0)
        removed = mask.view(1, -1, 1)
        pasted = model.unpatchify(model.patchify(img) * (1 - removed) + pred * removed)
        masked = model.unpatchify(model.patchify(img) * (1 - removed))
        grey = model.unpatchify(removed.expand_as(pred).float()) > 0  # removed pixels
        rows.append(torch.cat([_to_unit(masked, data, grey), _to_unit(pasted, data), _to_unit(img, data)], dim=3))
    grid = torch.cat(rows, dim=2)[0]  # (3, rows x H, 3 x W)
    pixels = (grid.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    path.parent.mkdir(parents=True, exist_ok=True)
    small = Image.fromarray(pixels)
    scale = max(1, 256 // max(1, shown[0][0].shape[-1]))  # tiny digits: enlarge to be seen
    small.resize((small.width * scale, small.height * scale), Image.NEAREST).save(path)
    return path


def _to_unit(x: torch.Tensor, data: DataConfig, grey: torch.Tensor | None = None) -> torch.Tensor:
    if x.shape[1] != 3:  # C channels of an array set (pixels.py): the first, as normalised (about N(0, 1)), in grey
        out = (x[:, :1] * 0.25 + 0.5).expand(-1, 3, -1, -1)
        grey = grey[:, :1].expand_as(out) if grey is not None else None
    else:
        mean = torch.tensor(data.mean).view(1, 3, 1, 1)
        std = torch.tensor(data.std).view(1, 3, 1, 1)
        out = x * std + mean
    if grey is not None:
        out = torch.where(grey, torch.full_like(out, 0.5), out)
    return out


class MAE(Objective):
    """Masked autoencoder pretraining: labels unread, each micro batch's mask noise drawn in the loader
    workers from its samples' global positions, reconstruction loss (+ k-NN top-1 where labelled)."""

    model_class = MaskedAutoencoderViT

    def model_kwargs(self) -> dict[str, Any]:
        return mae_model_kwargs(self.cfg)

    def build_model(self, model_kwargs: dict[str, Any]) -> nn.Module:
        return self.model_class(**model_kwargs, fresh_roles=wants_roles(self.cfg))

    def before_step(self, engine: Any, step: int) -> None:
        """adapt.*: the encoder of a run started from a source (--init) held while the decoder learns."""
        backbone_lr_schedule(engine.optimizer.param_groups, self.cfg.adapt, step)

    def train_view(self, model_kwargs: dict[str, Any]) -> TrainView:
        # Label-free shards train, and a labelled set's labels are not needed; each micro batch's mask noise
        # is drawn in the loader workers.
        return TrainView(label_free(self.cfg.data),
                         per_batch=train_noise_fn(self.cfg.train.seed, num_patches(model_kwargs)))

    def build_eval(self, env: DistEnv, img_size: tuple[int, int], batch: int) -> list[Any]:
        self.val_loader, self.knn_loader = knn_loaders(self.cfg.data, self.info, env, img_size, batch,
                                                        self.cfg.mae.knn_k, self.cfg.mae.knn_train_samples)
        return [x for x in (self.val_loader, self.knn_loader) if x is not None]

    def loss(self, engine: Any, images: torch.Tensor, targets: torch.Tensor,  # noqa: ARG002 - the interface
             extras: torch.Tensor | None) -> torch.Tensor:
        # The mask of each sample is a function of its global position: the same on any layout.
        return engine(images, mask_ratio=self.cfg.mae.mask_ratio, noise=extras.to(engine.device))[0].float()

    def evaluate(self, engine: Any, dtype: torch.dtype, run_dir: Path | None, step: int) -> EvalResult:
        metrics, image = evaluate_mae(engine, self.val_loader, self.knn_loader, self.cfg, dtype, run_dir, step)
        knn = f" | k-NN top-1 {100 * metrics['eval/knn_top1']:.2f}%" if "eval/knn_top1" in metrics else ""
        return EvalResult(metrics, f"eval step {step} | reconstruction loss {metrics['eval/recon_loss']:.4f}{knn}",
                          [(image, "reconstructions")] if image is not None else [])

    def flops_per_image(self, model_kwargs: dict[str, Any]) -> float:
        return mae_flops(model_kwargs, self.cfg.mae.mask_ratio)

    # The encoder's tokens of the whole image, unmasked: what eval.sets judges (Objective.features).
    features_kwargs = {"encode_only": True}
