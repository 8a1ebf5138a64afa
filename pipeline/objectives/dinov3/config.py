"""DINOv3's declaration, light (read with the config, before torch): the `dinov3` and `gram` config sections,
their checks, and the recipe `model.objective: dinov3` (the objective itself: dinov3/).

`dinov3` is DINOv2's `dino` section (the same losses, crops and Sinkhorn-Knopp centring; heads of Meta's DINOv3
layout, plain prototypes: pipeline/model/dino_head.py's `DINOv3Head`) with DINOv3's
defaults (Meta's dinov3/configs/train/dinov3_vit7b16_pretrain.yaml where they do not depend on the model's size:
constant weight decay and teacher momentum, Sinkhorn-Knopp, a separate iBOT head, no flips, RoPE rescaling) and
what DINOv3 adds: the RoPE augmentation, the high-resolution stage's mix of crop sizes, and the run it continues.
`gram` is Gram anchoring (Meta's `gram:` and crops.gram_teacher_* keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pipeline.config import Check, Config
from pipeline.model.variants import DINOV3_VARIANTS
from pipeline.objectives.dino.config import DinoConfig, section_checks
from pipeline.objectives.recipe import ReadBack, Recipe


@dataclass
class CropSizes:
    """One resolution of the high-resolution stage (Meta's dinov3_vit7b16_high_res_adapt.yaml: the i-th entry of
    each of its crops.* lists)."""

    global_crops_size: int = 512
    """Side of the 2 global crops at this resolution (a multiple of the patch size)."""
    local_crops_size: int = 112
    """Side of the local crops at this resolution."""
    gram_crops_size: int | None = None
    """Side of the Gram teacher's crops at this resolution; None: gram.crops_size's rule (twice the global crops)."""
    weight: float = 1.0
    """How often a step is at this resolution, relative to the others (Meta's global_local_crop_pairs_ratios)."""


@dataclass
class Dinov3Config(DinoConfig):
    """DINOv3's recipe (Siméoni et al. 2025, arXiv 2508.10104; Meta's dinov3/configs/): DINOv2's keys with DINOv3's
    defaults, and its own. The global crops are model.img_size; the weight decay is train.weight_decay."""

    local_crops_size: int = 112
    """Side of a local crop in pixels, a multiple of the patch size (DINOv3: 112 = 7 x 16)."""
    head_bottleneck_dim: int = 256
    """Bottleneck before the prototypes (Meta's DINOv3 head: a plain Linear drawn trunc-normal 0.02, not weight-normalised)."""
    ibot_separate_head: bool = True
    """Give iBOT its own head (every DINOv3 config)."""
    centering: Literal["centering", "sinkhorn_knopp"] = "sinkhorn_knopp"
    """Teacher targets: Sinkhorn-Knopp (3 iterations; every DINOv3 config), or DINOv2's softmax of the centred output."""
    teacher_temp_warmup_steps: int = 100000
    """Steps of the teacher temperature warm-up (Meta's 7B: 100 epochs of 1000 iterations)."""
    momentum_teacher: float = 0.994
    """EMA momentum of the teacher (Meta's 7B pretraining; its Gram stage: 0.999)."""
    final_momentum_teacher: float | None = None
    """None: the momentum stays at momentum_teacher (DINOv3's constant schedule); a value: DINOv2's cosine to it over train.steps."""
    weight_decay_end: float | None = None
    """None: the weight decay stays at train.weight_decay (DINOv3's constant 0.04); a value: DINOv2's cosine to it."""
    freeze_last_layer_steps: int = 5000
    """Steps at the start during which the heads' prototypes have lr 0 (Meta's 7B: 5 epochs of 1000 iterations)."""
    horizontal_flips: bool = False
    """Flip the crops with probability 0.5 (DINOv3's configs: off)."""
    rope_shift_coords: float | None = None
    """RoPE augmentation in the student's training forward: each axis' patch coordinates shifted by U(-s, s) (None: off)."""
    rope_jitter_coords: float | None = None
    """RoPE augmentation: each axis' coordinates scaled by exp(U(-log j, log j)) (None: off)."""
    rope_rescale_coords: float | None = 2.0
    """RoPE augmentation: both axes' coordinates scaled by exp(U(-log r, log r)) (Meta's DINOv3 configs: 2; None: off). Drawn per crop from its sample's seed."""
    resolutions: list[CropSizes] = field(default_factory=list)
    """The high-resolution stage: each step's global, local and Gram crop sizes are one entry of this list, drawn by weight from (train.seed, step) (the same for every sample of the step, on any layout). Empty: model.img_size, local_crops_size and gram.crops_size at every step."""
    continue_from: str | None = None
    """A finished (or stopped) model.objective 'dinov3' run this one continues: its student, teacher, Gram teacher and centres are the start of this run, whose own optimizer, schedules and data order start at step 0 (Meta's Gram and high-resolution stages). `launch/pretrain.py --from RUN_DIR` sets it."""


@dataclass
class GramConfig:
    """Gram anchoring (DINOv3, Sec. 4; Meta's `gram:` section and crops.gram_teacher_*): the MSE between the Gram
    matrices of the student's and the Gram teacher's L2-normalised patch features of the global crops. The Gram
    teacher is a frozen copy of the EMA teacher taken at gram.start_step, then every gram.update_every steps,
    gram.max_updates times (Meta's it_load_ema_teacher, update_frequency, max_updates); it sees the global crops
    at gram.crops_size and its patch features are resized to the student's grid."""

    loss_weight: float = 0.0
    """Weight of the Gram loss (Meta's 7B Gram stage: 2 at the end of its warm-up; its high-res stage 1.5); 0: no Gram anchoring (no Gram teacher is built)."""
    start_step: int = 0
    """The step the Gram teacher is first taken from the EMA teacher, and the loss is on from."""
    update_every: int = 10000
    """Steps between two copies of the EMA teacher into the Gram teacher (Meta's update_frequency); 0: the first copy only."""
    max_updates: int | None = 3
    """Copies after the first at most (Meta's max_updates); None: no limit."""
    crops_size: int | None = None
    """Side of the Gram teacher's crops (Meta's gram_teacher_crops_size: 512 for 256 px global crops); None: twice model.img_size."""
    no_distortions: bool = True
    """The Gram teacher's crops without colour jitter, blur and solarisation (Meta's gram_teacher_no_distortions)."""
    normalized: bool = True
    """L2-normalise the patch features before their Gram matrices (Meta's gram.normalized)."""
    img_level: bool = True
    """One Gram matrix per image (Meta's Gram configs); false: one over all patches of the micro batch."""
    remove_neg: bool = False
    """Zero the negative similarities of both Gram matrices before the loss."""
    remove_only_teacher_neg: bool = False
    """Zero the teacher's negative similarities only (Meta's GramLoss leaves the student's)."""
    tokens_used: Literal["all", "masked", "unmasked"] = "all"
    """The patches in the loss: all, or only those iBOT masks (not) for the student (those need img_level false)."""
    resize_method: Literal["bicubic", "bilinear"] = "bicubic"
    """How the Gram teacher's patch features are resized to the student's grid (Meta's global_teacher_resize_method)."""
    resize_antialias: bool = False
    """Antialias that resize (Meta's global_teacher_resize_antialias)."""


def dinov3_checks(cfg: Config) -> list[Check]:
    """`validate`'s checks of a model.objective 'dinov3' run (none for another objective)."""
    if cfg.model.objective != "dinov3":
        return []
    d, g, patch = cfg.dinov3, cfg.gram, cfg.model.patch_size or 16
    sizes = [(r.global_crops_size, r.local_crops_size, r.gram_crops_size) for r in d.resolutions]
    return [
        *section_checks(cfg, "dinov3", "dinov3"),
        ("model.variant", cfg.model.variant in DINOV3_VARIANTS,
         f"a DINOv3 variant ({', '.join(DINOV3_VARIANTS)}) with model.objective 'dinov3' (its RoPE backbone)"),
        ("dinov3.resolutions", all(s % patch == 0 for row in sizes for s in row if s is not None)
         and all(r.weight > 0 for r in d.resolutions),
         f"crop sizes that are multiples of the patch size ({patch}) and weights > 0"),
        ("gram.loss_weight", g.loss_weight >= 0, ">= 0"),
        ("gram.start_step", g.start_step >= 0, ">= 0"),
        ("gram.update_every", g.update_every >= 0, ">= 0"),
        ("gram.max_updates", g.max_updates is None or g.max_updates >= 0, ">= 0 or null"),
        ("gram.crops_size", g.crops_size is None or (g.crops_size > 0 and g.crops_size % patch == 0),
         f"null or a multiple of the patch size ({patch})"),
        ("gram.remove_only_teacher_neg", not (g.remove_neg and g.remove_only_teacher_neg),
         "false with gram.remove_neg (one or the other, as Meta's GramLoss)"),
        ("gram.tokens_used", g.tokens_used == "all" or not g.img_level,
         "'all' with gram.img_level true (masked patches differ in number between images)"),
    ]


def _objective() -> type:
    # When a run builds it: the config is read before torch.
    from pipeline.objectives.dinov3.objective import DINOv3

    return DINOv3


RECIPE = Recipe("dinov3", _objective, section="dinov3", config=Dinov3Config, checks=dinov3_checks,
                more_sections=(("gram", GramConfig),), continue_key="dinov3.continue_from",
                read_back=ReadBack(model="dinov3"))
