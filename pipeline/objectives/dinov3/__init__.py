"""DINOv3 (Siméoni et al. 2025), in the pieces a reader looks for, beside DINOv2's (pipeline/objectives/dino/):

    gram_loss.py      GramLoss (Meta's dinov3/loss/gram_loss.py)
    gram_teacher.py   the Gram teacher: its copies of the EMA teacher, its resized patch features, its state
    view.py           DINOv3View: each sample's crops (and the step's sizes), iBOT masks, RoPE boxes, Gram crops
    continuation.py   a later stage (Gram anchoring, high resolution) from a finished run
    objective.py      DINOv3, the objective `model.objective: dinov3`
    config.py         its declaration, light (no torch): the `dinov3` and `gram` sections, checks, `RECIPE`

The student/teacher module is `DINOv3Model` (pipeline/model/dino.py) on `DINOv3ViT` (pipeline/model/dinov3.py).
"""
