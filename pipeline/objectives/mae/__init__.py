"""MAE (He et al. 2021), `model.objective: mae`.

    objective.py  MAE, the objective: masks from the global order, the loss, its evaluation
    config.py     its declaration, light (no torch): the `mae` section, its checks, the recipe (`RECIPE`)

The model (encoder and decoder: `MaskedAutoencoderViT`) is pipeline/model/mae.py.
"""
