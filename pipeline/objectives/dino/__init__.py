"""DINOv2 (Oquab et al. 2023), in the pieces a reader looks for, as Meta lays them out:

    loss/         DINOLoss (dino_clstoken_loss.py), iBOTPatchLoss, KoLeoLoss: one file per loss
    view.py       MultiCropView: each sample's crops and iBOT masks, in the loader workers
    masked.py     iBOT's masked patches gathered at a fixed size per micro batch (no host read)
    evaluate.py   the teacher's k-NN top-1 and the PCA figure of its patch features
    objective.py  DINOv2, the objective `model.objective: dinov2`: the schedules, the step, the state

The head (`DINOHead`, pipeline/model/dino_head.py) and the student/teacher module (`DINOv2Model`,
pipeline/model/dino.py) are models, beside MAE's.
"""

from pipeline.model.dino import HEAD_KEYS, DINOv2Model
from pipeline.model.dino_head import DINOHead
from pipeline.objectives.dino.evaluate import evaluate_teacher, pca_rgb, save_pca_image
from pipeline.objectives.dino.loss import DINOLoss, KoLeoLoss, iBOTPatchLoss
from pipeline.objectives.dino.objective import DINOv2, dinov2_model_kwargs
from pipeline.objectives.dino.view import MultiCropView

__all__ = ["HEAD_KEYS", "DINOHead", "DINOLoss", "DINOv2", "DINOv2Model", "KoLeoLoss", "MultiCropView",
           "dinov2_model_kwargs", "evaluate_teacher", "iBOTPatchLoss", "pca_rgb", "save_pca_image"]
