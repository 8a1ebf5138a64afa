"""The models, one file each (imported by what uses them: this package imports nothing, so that a light module,
variants.py, can be read before torch is).

    vit.py        VisionTransformer (the paper's ViT, timm's Block; DINOv2's options)
    dinov3.py     DINOv3ViT (RoPE, storage tokens)
    mae.py        MaskedAutoencoderViT (MAE's encoder and decoder)
    dino.py + dino_head.py   the DINO student/teacher modules and their heads
    layers.py     the blocks' parts (PatchEmbed, the convolutional stem, LayerScale, ...)
    variants.py   every model.variant preset and the FLOPs of a model's arguments (no torch)
    rope.py       DINOv3's rotary position embedding
    timm_backbone.py  a timm model as a distillation student or teacher
    pos_embed.py, weights.py, layouts.py (+ layouts_dinov3.py, layout_parts.py), channels.py: position tables,
                  the weights files, what a file from elsewhere holds
"""
