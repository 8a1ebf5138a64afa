"""MAE's declaration, light (read with the config, before torch): the `mae` config section, its checks, and
the recipe `model.objective: mae` (the objective itself: objective.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config import Check, Config
from pipeline.objectives.recipe import ReadBack, Recipe


@dataclass
class MaeConfig:
    mask_ratio: float = 0.75
    """Fraction of each image's patches removed before the encoder (paper: 0.75)."""
    norm_pix_loss: bool = True
    """Predict each patch's pixels normalised by that patch's mean and standard deviation (paper: on, +0.5% fine-tuned top-1 with ViT-L)."""
    decoder_embed_dim: int = 512
    """Width of the decoder (paper: 512)."""
    decoder_depth: int = 8
    """Blocks of the decoder (paper: 8)."""
    decoder_num_heads: int = 16
    """Attention heads of the decoder (paper: 16)."""
    knn_k: int = 20
    """Evaluation: neighbours voting in the k-NN top-1 on the encoder's features (0 disables the k-NN; only where the validation split has labels)."""
    knn_train_samples: int = 10000
    """Evaluation: labelled training samples (the first of the train split) that make the k-NN memory."""
    recon_images: int = 8
    """Evaluation: validation images shown masked, reconstructed and original in the MLflow image artifact (0: none)."""


def mae_checks(cfg: Config) -> list[Check]:
    """The `mae` section's values, and what an MAE run cannot have."""
    return [
        ("mae.mask_ratio", 0 <= cfg.mae.mask_ratio < 1, "in [0, 1)"),
        ("mae.knn_k", cfg.mae.knn_k >= 0, ">= 0"),
        ("mae.recon_images", cfg.mae.recon_images >= 0, ">= 0"),
        ("data.mixup", cfg.model.objective != "mae" or (cfg.data.mixup == 0 and cfg.data.cutmix == 0),
         "0 with model.objective 'mae' (as data.cutmix: mixing images has no meaning without labels)"),
        ("model.representation_size", cfg.model.objective != "mae" or cfg.model.representation_size is None,
         "null with model.objective 'mae' (the encoder has no classifier head)"),
        ("model.stem", cfg.model.objective != "mae" or cfg.model.stem == "patch",
         "'patch' with model.objective 'mae' (a convolutional stem sees the pixels of masked patches beside each "
         "visible one before the mask is applied)"),
    ]


def _objective() -> type:
    # When a run builds it: the config is read before torch.
    from pipeline.objectives.mae.objective import MAE

    return MAE


# A fine-tune of an MAE encoder without --config follows MAE's recipe (avg pool + fc_norm, layer decay), and
# its augmentation (RandAugment, mixup/cutmix, smoothing) replaces the source's.
FINETUNE_RECIPES = {"vit_l16": "configs/finetune/mae_vit_l16.yaml"}  # by variant; others: the B/16 one


def finetune_recipe(variant: str) -> str:
    return FINETUNE_RECIPES.get(variant, "configs/finetune/mae_vit_b16.yaml")


RECIPE = Recipe("mae", _objective, section="mae", config=MaeConfig, checks=mae_checks,
                finetune_recipe=finetune_recipe,
                finetune_data=("auto_augment", "mixup", "cutmix", "label_smoothing", "scale", "interpolation"),
                read_back=ReadBack(model="vit", keys="mae"))
