"""The `model` section of the run configuration (pipeline/config.py): which ViT, its shape and its options. Light:
read with the config, before torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class ModelConfig:
    variant: str = "vit_b16"
    """Preset from `pipeline.model.variants.VARIANTS` (vit_ti16, vit_s16, vit_b16, vit_b32, vit_l16, vit_l32, vit_h14; DINOv2's vit_s14, vit_b14, vit_l14, vit_g14 and their _reg4 forms; DINOv3's RoPE ViTs dinov3_vits16, dinov3_vits16plus, dinov3_vitb16, dinov3_vitl16, dinov3_vith16plus, dinov3_vit7b16; docs/model.md)."""
    img_size: int | tuple[int, int] = 224
    """Training resolution: one int for square images or [height, width]; the data pipeline uses it too."""
    num_classes: int | None = None
    """Classifier outputs; None takes the class count from the data set's dataset.json."""
    in_chans: int | None = None
    """Input channels; None takes dataset.json's `channels` (3 for 8-bit RGB sets and sets written before it said)."""
    patch_size: int | None = None
    """Override the variant's patch size (None keeps the preset)."""
    embed_dim: int | None = None
    """Override the variant's hidden size D."""
    depth: int | None = None
    """Override the variant's number of blocks L."""
    num_heads: int | None = None
    """Override the variant's number of attention heads."""
    mlp_ratio: float | None = None
    """Override the MLP hidden size as a multiple of D (paper: 4)."""
    qkv_bias: bool = True
    """Bias in the query/key/value projection (timm and the paper's released models: True); a DINOv3 ViT's is on the query and value only, the key's fixed at zero (Meta's mask_k_bias)."""
    drop_rate: float = 0.0
    """Dropout after position embeddings, attention projection and each MLP layer (paper: 0.1 for B and L pretraining)."""
    attn_drop_rate: float = 0.0
    """Dropout on attention probabilities."""
    drop_path_rate: float = 0.0
    """Stochastic depth rate, linearly increasing over blocks (DeiT recipe; paper: 0)."""
    representation_size: int | None = None
    """Width of the paper's tanh pre-logits layer for pretraining; None for a plain linear head."""
    grad_checkpointing: bool = False
    """Recompute each block in backward to save activation memory (about 30% more compute)."""
    patch_embed_impl: Literal["conv", "matmul"] = "conv"
    """How the patch embedding's projection is computed: 'conv' (timm's convolution, bit for bit) or 'matmul' (one matrix product of the unfolded patches: the same weights and names, equal within float rounding; for the GPU, where the convolution ran at a fraction of the matmuls' rate: docs/performance.md). Not part of the architecture: a run may resume or fine-tune with the other."""
    stem: Literal["patch", "conv"] = "patch"
    """How the image becomes tokens: 'patch' (the paper's Eq. 1: each P x P patch projected linearly; timm's, Meta's) or 'conv' (a few 3x3 convolutions then a 1x1 to D, the same grid of tokens: Xiao et al. 2021; pipeline/model/layers.py ConvStem; for small images and short runs: the Fashion-MNIST presets, docs/quality.md). 'conv' needs a power-of-2 patch_size, a ViT variant (not DINOv3's) and a recipe that does not mask patches before the stem (not MAE). Part of the architecture: a fine-tune takes it from its source."""
    init_values: float | None = None
    """LayerScale's starting value in every block (DINOv2: 1e-5); None keeps the variant's (the DINOv2 variants have it, the others none)."""
    reg_tokens: int | None = None
    """Register tokens after the class token (DINOv2 with registers: 4); None keeps the variant's."""
    no_embed_class: bool | None = None
    """Position table over the patches only, not the class token (timm's layout of the register models); None keeps the variant's."""
    mlp_layer: Literal["mlp", "swiglu"] | None = None
    """Block MLP: 'mlp' (GELU) or 'swiglu' (DINOv2's ViT-g); None keeps the variant's."""
    dynamic_img_size: bool | None = None
    """Accept inputs of any size divisible by the patch size, interpolating the position table (DINO's local crops); None keeps the variant's (on for the DINOv2 variants)."""
    global_pool: Literal["token", "avg"] = "token"
    """What the head classifies: 'token' the class token after the final norm (the paper), 'avg' the mean of the patch tokens normalised by fc_norm (MAE's fine-tuning; timm's global_pool='avg'); for a DINOv3 ViT the mean of the patch tokens after the final norm, no fc_norm (timm's default for its DINOv3 models)."""
    objective: str = "supervised"
    """What pretraining learns from: a recipe registered in pipeline/objectives/ (docs/objectives.md): 'supervised' (labels, the classifier head), 'mae' (masked autoencoding of the images alone, labels unused; the `mae` section; docs/mae.md) or 'dinov2' (self-distillation from an EMA teacher across multi-crops, labels unused; the `dino` section; docs/dino.md)."""
