"""DINOv2's evaluation of its teacher: the k-NN top-1 of the class token (pipeline/eval/) and DINOv2's figure,
the first 3 principal components of the patch features as RGB."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch import nn

from pipeline.config import Config, DataConfig
from pipeline.data import raise_if_any_failed
from pipeline.eval.features import Features, extract
from pipeline.eval.knn import knn_top1
from pipeline.objectives.dino.collapse import ClassTokenGram
from pipeline.train import ds_compat


def class_token(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """A `DINOv2Model`'s L2-normalised class token (float32): the feature DINOv2's k-NN scores."""
    return F.normalize(model.backbone.forward_tokens(images).cls_token.float(), dim=-1)


def evaluate_teacher(teacher: nn.Module, val_loader: Any, knn_loader: Any, cfg: Config, device: torch.device,
                     run_dir: Path | None, step: int, section: Any = None) -> tuple[dict[str, float], Path | None]:
    """The teacher over the validation split: k-NN top-1 of its L2-normalised class token against the
    labelled train subset (where there are labels; `pipeline.eval.knn_top1`, DINO's weighted vote), the
    effective rank of those class tokens over the whole pass (collapse.py), and on rank 0 the PCA image of the
    patch features of its first `pca_images` validation images (`section`: the objective's config section,
    cfg.dino for DINOv2). Every rank runs the same number of forwards (the teacher is gathered once under ZeRO-3)."""
    section = section or cfg.dino
    teacher_dtype = next(teacher.parameters()).dtype
    val, shown, gram = Features(), [], ClassTokenGram()
    samples = torch.zeros(1, dtype=torch.float64, device=device)
    with ds_compat.gathered(teacher):
        for images, targets, valid in val_loader:
            tokens = teacher.backbone.forward_tokens(images.to(device, teacher_dtype, non_blocking=True))
            cls = F.normalize(tokens.cls_token.float(), dim=-1)
            val.add(cls, targets, valid)
            gram.add(cls, valid)
            samples += valid.sum()
            keep = [k for k in range(len(valid)) if bool(valid[k])][:section.pca_images - len(shown)]
            shown += [(images[k].float().cpu(), tokens.patch_tokens[k].float().cpu()) for k in keep]
        if knn_loader is not None:
            memory = extract(knn_loader, lambda x: class_token(teacher, x), device, teacher_dtype)
    metrics: dict[str, float] = {}
    if knn_loader is not None:
        metrics.update(knn_top1(*val.tensors(), *memory.tensors(), section.knn_k))
    raise_if_any_failed(val_loader, knn_loader)  # collective: one failed pass stops all
    if dist.is_initialized():
        dist.all_reduce(samples)
    metrics["eval/samples"] = samples.item()
    metrics["eval/effective_rank"] = gram.effective_rank()
    image = None
    if shown and run_dir is not None:
        grid = teacher.backbone.grid_size
        image = save_pca_image(shown, grid, cfg.data, run_dir / "pca" / f"step{step:08d}.png")
    return metrics, image


def pca_rgb(patch_tokens: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """DINOv2's figure: the first 3 principal components of the patch features of all given images
    (n, N, D), each scaled to [0, 1] over them, as RGB: (n, 3, h, w)."""
    n, count, dim = patch_tokens.shape
    x = patch_tokens.reshape(n * count, dim).double()
    x = x - x.mean(0, keepdim=True)
    _, _, v = torch.linalg.svd(x, full_matrices=False)
    comps = x @ v[:3].T  # (n N, <=3)
    if comps.shape[1] < 3:  # fewer than 3 features or patches: pad with zeros
        comps = F.pad(comps, (0, 3 - comps.shape[1]))
    low, high = comps.min(0).values, comps.max(0).values
    comps = (comps - low) / (high - low).clamp(min=1e-12)
    return comps.float().T.reshape(3, n, *grid).transpose(0, 1)


def save_pca_image(shown: list[tuple[torch.Tensor, torch.Tensor]], grid: tuple[int, int], data: DataConfig,
                   path: Path) -> Path:
    """One PNG, a row per image: the image and its patch features' first 3 principal components as RGB."""
    images = torch.stack([im for im, _ in shown])
    rgb = pca_rgb(torch.stack([t for _, t in shown]), grid)
    rgb = F.interpolate(rgb, size=images.shape[-2:], mode="nearest")  # one colour per patch
    if images.shape[1] != 3:  # C channels of an array set (pixels.py): the first, as normalised, in grey (as MAE's)
        shown_images = (images[:, :1] * 0.25 + 0.5).clamp(0, 1).expand(-1, 3, -1, -1)
    else:
        mean, std = torch.tensor(data.mean).view(1, 3, 1, 1), torch.tensor(data.std).view(1, 3, 1, 1)
        shown_images = (images * std + mean).clamp(0, 1)
    rows = torch.cat([shown_images, rgb], dim=3)  # (n, 3, H, 2W)
    grid_img = torch.cat(list(rows), dim=1)  # (3, n H, 2W)
    pixels = (grid_img * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.fromarray(pixels)
    scale = max(1, 256 // max(1, images.shape[-1]))  # tiny digits: enlarge to be seen
    img.resize((img.width * scale, img.height * scale), Image.NEAREST).save(path)
    return path
