"""DINOv3 (Siméoni et al. 2025), in the pieces a reader looks for, beside DINOv2's (pipeline/objectives/dino/):

    gram_loss.py      GramLoss (Meta's dinov3/loss/gram_loss.py)
"""

from pipeline.objectives.dinov3.gram_loss import GramLoss

__all__ = ["GramLoss"]
