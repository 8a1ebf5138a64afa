"""DINOv3 (Siméoni et al. 2025), in the pieces a reader looks for, beside DINOv2's (pipeline/objectives/dino/):

    gram_loss.py      GramLoss (Meta's dinov3/loss/gram_loss.py)
    gram_teacher.py   the Gram teacher: its copies of the EMA teacher, its resized patch features, its state
    view.py           DINOv3View: each sample's crops (and the step's sizes), iBOT masks, RoPE boxes, Gram crops
    continuation.py   a later stage (Gram anchoring, high resolution) from a finished run
    objective.py      DINOv3, the objective `model.objective: dinov3`

The student/teacher module is `DINOv3Model` (pipeline/model/dino.py) on `DINOv3ViT` (pipeline/model/dinov3.py).
"""

from pipeline.objectives.dinov3.gram_loss import GramLoss
from pipeline.objectives.dinov3.gram_teacher import GramTeacher, resize_patches, takes_copy
from pipeline.objectives.dinov3.objective import DINOv3
from pipeline.objectives.dinov3.view import DINOv3View, pick

__all__ = ["DINOv3", "DINOv3View", "GramLoss", "GramTeacher", "pick", "resize_patches", "takes_copy"]
