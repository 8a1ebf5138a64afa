from pipeline.model.mae import MaskedAutoencoderViT, build_mae, mae_flops
from pipeline.model.pos_embed import resize_pos_embed
from pipeline.model.vit import VARIANTS, VisionTransformer, build_vit, model_flops, model_kwargs_from_config

__all__ = ["VARIANTS", "MaskedAutoencoderViT", "VisionTransformer", "build_mae", "build_vit", "mae_flops", "model_flops",
           "model_kwargs_from_config", "resize_pos_embed"]
