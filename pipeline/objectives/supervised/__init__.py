"""Supervised classification, `model.objective: supervised` (the default; every fine-tune).

    objective.py  Supervised, the objective: cross-entropy, top-1/top-5 over the val split
    config.py     its declaration, light (no torch): the recipe (`RECIPE`); no section of its own
"""
