"""DINOv2's declaration, light (read with the config, before torch): the `dino` config section, its checks,
and the recipe `model.objective: dinov2` (the objective itself: dino/)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipeline.config import Check, Config
from pipeline.objectives.recipe import ReadBack, Recipe


@dataclass
class DinoConfig:
    """DINOv2's recipe (Oquab et al. 2023; Meta's dinov2/configs/ssl_default_config.yaml). The global crops
    are model.img_size; the teacher's starting weight decay is train.weight_decay."""

    global_crops_scale: tuple[float, float] = (0.32, 1.0)
    """Area range of the 2 global crops (teacher and student), as a fraction of the image."""
    local_crops_number: int = 8
    """Local crops per image (student only; 0: none)."""
    local_crops_size: int = 98
    """Side of a local crop in pixels, a multiple of the patch size (98 = 7 x 14; Meta's default 96 does not tile patch 14)."""
    local_crops_scale: tuple[float, float] = (0.05, 0.32)
    """Area range of a local crop."""
    color_jitter_p: float = 0.8
    """Probability of colour jitter on each crop (brightness 0.4, contrast 0.4, saturation 0.2, hue 0.1)."""
    greyscale_p: float = 0.2
    """Probability of greyscale on each crop."""
    blur_p: tuple[float, float, float] = (0.0, 0.9, 0.5)
    """Probability of Gaussian blur (kernel 9, sigma 0.1-2) on global crop 1, global crop 2 and each local crop: what Meta's code applies (pipeline/data/multicrop.py says why not what its names say)."""
    solarize_p: float = 0.2
    """Probability of solarisation (threshold 128) on the second global crop."""
    head_n_prototypes: int = 65536
    """Prototypes of the DINO head (its output width K)."""
    head_hidden_dim: int = 2048
    """Hidden width of the heads' MLP."""
    head_bottleneck_dim: int = 256
    """Bottleneck before the weight-normalised prototypes."""
    head_nlayers: int = 3
    """Linear layers of the heads' MLP."""
    ibot_separate_head: bool = False
    """Give iBOT its own head (Meta's ViT-L/g recipes); false: iBOT shares the DINO head."""
    ibot_head_n_prototypes: int = 65536
    """Prototypes of the separate iBOT head."""
    ibot_head_bottleneck_dim: int = 256
    """Bottleneck of the separate iBOT head (Meta's ViT-L/g: 256 where the DINO head has 384)."""
    dino_loss_weight: float = 1.0
    """Weight of the class-token (DINO) loss."""
    ibot_loss_weight: float = 1.0
    """Weight of the masked-patch (iBOT) loss (0: no masks, no iBOT)."""
    koleo_loss_weight: float = 0.1
    """Weight of the KoLeo regulariser on the student's global class tokens (0: off)."""
    mask_probability: float = 0.5
    """Probability that a global crop is masked for iBOT."""
    mask_ratio: tuple[float, float] = (0.1, 0.5)
    """Range of the fraction of patches masked in a masked crop (uniform, per image)."""
    centering: Literal["centering", "sinkhorn_knopp"] = "centering"
    """Teacher targets: softmax of the centred output (EMA centre, momentum 0.9), or Sinkhorn-Knopp (3 iterations)."""
    student_temp: float = 0.1
    """Temperature of the student's softmax."""
    teacher_temp: float = 0.07
    """Temperature of the teacher's softmax after the warm-up."""
    warmup_teacher_temp: float = 0.04
    """Temperature of the teacher's softmax at step 0, raised linearly to teacher_temp."""
    teacher_temp_warmup_steps: int = 37500
    """Steps of the teacher temperature warm-up (Meta: 30 epochs of 1250 iterations)."""
    momentum_teacher: float = 0.992
    """EMA momentum of the teacher at step 0, raised to final_momentum_teacher on a cosine over train.steps."""
    final_momentum_teacher: float = 1.0
    """EMA momentum of the teacher at the last step."""
    weight_decay_end: float = 0.4
    """Weight decay at the last step: a cosine from train.weight_decay (Meta: 0.04) to this."""
    freeze_last_layer_steps: int = 1250
    """Steps at the start during which the heads' prototypes (last_layer) have lr 0: their gradients are computed (and clipped with the rest) but the weights do not move (Meta's freeze_last_layer_epochs: 1 epoch of 1250 iterations)."""
    patch_embed_lr_mult: float = 0.2
    """Factor on the patch embedding's lr, on top of train.layer_decay's (Meta's optim.patch_embed_lr_mult)."""
    knn_k: int = 20
    """Evaluation: neighbours voting in the k-NN top-1 on the teacher's class token (0 disables; only where the validation split has labels)."""
    knn_train_samples: int = 10000
    """Evaluation: labelled training samples (the first of the train split) that make the k-NN memory."""
    pca_images: int = 4
    """Evaluation: validation images whose teacher patch features' first 3 principal components are drawn as RGB in the MLflow image artifact (0: none)."""
    collapse_evals: int = 2
    """Evaluation: warn, once per episode (in the log, and a file under MLflow's Artifacts, warnings/; eval/collapse_warning is 1 while it lasts), when a collapse figure has been at its collapse value for this many evaluations in a row: the teacher's target entropy at the uniform log K, the entropy of its batch-averaged target at 0 (one prototype), a stall (collapse_stall_fraction), the effective rank of its class tokens at 1 (0: never; the rule: pipeline/objectives/dino/collapse.py)."""
    collapse_tolerance: float = 0.01
    """Evaluation: how near its collapse value a figure counts as there, relatively: entropy >= (1 - tol) log K, batch-averaged target entropy <= tol log K, effective rank <= 1 + tol (D - 1); and how little the target entropy and the loss may fall between evaluations for a stall."""
    collapse_stall_fraction: float = 0.95
    """Evaluation: a stall is the teacher's target entropy at or above this fraction of log K with neither it nor the loss falling by collapse_tolerance from one evaluation to the next (issue 69's stalled run: 0.98; 1: no stall warning)."""


def dino_checks(cfg: Config) -> list[Check]:
    """`validate`'s checks of a model.objective 'dinov2' run (none for another objective)."""
    return section_checks(cfg, "dinov2", "dino") if cfg.model.objective == "dinov2" else []


def section_checks(cfg: Config, objective: str, key: str) -> list[Check]:
    """The checks of a self-distillation run whose section is `key` (dino; DINOv3's dinov3 extends DinoConfig)."""
    d, o = getattr(cfg, key), f"model.objective '{objective}'"
    return [
        ("data.mixup", cfg.data.mixup == 0 and cfg.data.cutmix == 0,
         f"0 with {o} (as data.cutmix: the crops are the augmentation)"),
        ("data.decode_device", cfg.data.decode_device == "cpu", f"'cpu' with {o} (multi-crop runs in the loader "
         "workers)"),
        ("model.representation_size", cfg.model.representation_size is None,
         f"null with {o} (the backbone has no classifier head)"),
        ("train.ema_decay", cfg.train.ema_decay is None,
         f"null with {o} (its teacher is the EMA of the student: {key}.momentum_teacher)"),
        *((f"{key}.{name}", holds, expected) for name, holds, expected in _section_values(d)),
    ]


def _section_values(d: DinoConfig) -> list[Check]:
    final = d.final_momentum_teacher if d.final_momentum_teacher is not None else d.momentum_teacher  # DINOv3's None
    return [
        ("local_crops_number", d.local_crops_number >= 0, ">= 0"),
        ("local_crops_size", d.local_crops_size > 0, "> 0"),
        ("mask_probability", 0 <= d.mask_probability <= 1, "in [0, 1]"),
        ("color_jitter_p", 0 <= d.color_jitter_p <= 1, "in [0, 1]"),
        ("greyscale_p", 0 <= d.greyscale_p <= 1, "in [0, 1]"),
        ("blur_p", all(0 <= p <= 1 for p in d.blur_p), "3 probabilities in [0, 1]"),
        ("solarize_p", 0 <= d.solarize_p <= 1, "in [0, 1]"),
        ("mask_ratio", 0 <= d.mask_ratio[0] <= d.mask_ratio[1] < 1, "[low, high] with 0 <= low <= high < 1"),
        ("head_n_prototypes", d.head_n_prototypes > 0, "> 0"),
        ("head_nlayers", d.head_nlayers >= 1, ">= 1"),
        ("teacher_temp_warmup_steps", d.teacher_temp_warmup_steps >= 0, ">= 0"),
        ("momentum_teacher", 0 <= d.momentum_teacher <= final <= 1,
         "in [0, final_momentum_teacher] (and that at most 1)"),
        ("freeze_last_layer_steps", d.freeze_last_layer_steps >= 0, ">= 0"),
        ("patch_embed_lr_mult", d.patch_embed_lr_mult >= 0, ">= 0"),
        ("knn_k", d.knn_k >= 0, ">= 0"),
        ("pca_images", d.pca_images >= 0, ">= 0"),
        ("collapse_evals", d.collapse_evals >= 0, ">= 0"),
        ("collapse_tolerance", 0 <= d.collapse_tolerance < 1, "in [0, 1)"),
        ("collapse_stall_fraction", 0 < d.collapse_stall_fraction <= 1, "in (0, 1]"),
    ]


def _objective() -> type:
    # When a run builds it: the config is read before torch.
    from pipeline.objectives.dino.objective import DINOv2

    return DINOv2


RECIPE = Recipe("dinov2", _objective, section="dino", config=DinoConfig, checks=dino_checks,
                read_back=ReadBack(model="vit", kwargs=(("dynamic_img_size", True),)))
