"""Distillation (`model.objective: distill`): a frozen teacher from any source into students, in one forward of it.

    objective.py  Distill, the objective: the teacher's forward, each student's loss, the state
    teacher.py    the frozen teacher, read from any source as the commands read it
    student.py    the students: ViTs of ours, timm's CNNs and ViTs
    loss.py       the features target (FeatureLoss: a linear map of the student's tokens onto the teacher's)
    heads.py + head_loss.py   the heads target (DINO heads on both sides, DINO's losses)
    config.py     its declaration, light (no torch): the `distill` section, its checks, the recipe (`RECIPE`)
"""
