from pipeline.model.pos_embed import resize_pos_embed
from pipeline.model.vit import VARIANTS, VisionTransformer, build_vit, model_flops, model_kwargs_from_config

__all__ = ["VARIANTS", "VisionTransformer", "build_vit", "model_flops", "model_kwargs_from_config", "resize_pos_embed"]
