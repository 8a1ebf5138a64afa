"""DINOv2 (Oquab et al. 2023), in the pieces a reader looks for, as Meta lays them out:

    loss/         DINOLoss (dino_clstoken_loss.py), iBOTPatchLoss, KoLeoLoss: one file per loss
    view.py       MultiCropView: each sample's crops and iBOT masks, in the loader workers
    masked.py     iBOT's masked patches gathered at a fixed size per micro batch (no host read)
    evaluate.py   the teacher's k-NN top-1 and the PCA figure of its patch features
    objective.py  DINOv2, the objective `model.objective: dinov2`: the schedules, the step, the state
    config.py     its declaration, light (no torch): the `dino` section, its checks, the recipe (`RECIPE`)

The head (`DINOHead`, pipeline/model/dino_head.py) and the student/teacher module (`DINOv2Model`,
pipeline/model/dino.py) are models, beside MAE's.
"""
