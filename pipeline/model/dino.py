"""DINOv2's student and teacher (Meta's `SSLMetaArch` holds them as ModuleDicts): `DINOv2Model`, a
`VisionTransformer` backbone with its mask token and the DINO head, plus a separate iBOT head when asked;
`DINOv3Model`, the same on the DINOv3 backbone (`DINOv3ViT`: RoPE, storage tokens), whose student takes each
crop's RoPE augmentation draws. The objectives that train them are pipeline/objectives/dino/ and dinov3/;
these are the modules, beside MAE's (mae.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipeline.model.dino_head import DINOHead, DINOv3Head
from pipeline.model.dinov3 import DINOv3ViT
from pipeline.model.layers import init_param, trunc_normal
from pipeline.model.vit import VisionTransformer

HEAD_KEYS = ("head_n_prototypes", "head_hidden_dim", "head_bottleneck_dim", "head_nlayers", "ibot_separate_head",
             "ibot_head_n_prototypes", "ibot_head_bottleneck_dim")


def redraw_head(h: nn.Module) -> nn.Module:
    """`h` (a DINOHead or DINOv3Head) with its Linears drawn again through init_param: the head's own
    trunc-normal init ran on partitions under deepspeed.zero.Init (its Linears were partitioned when built, and
    a draw on an empty shard draws nothing); redone on the gathered tensors (a no-op difference otherwise),
    DINOv3's plain prototypes included."""
    mlp = list(h.mlp.modules()) if isinstance(h.mlp, nn.Sequential) else [h.mlp]
    for m in mlp + ([h.last_layer] if isinstance(h.last_layer, nn.Linear) else []):
        if isinstance(m, nn.Linear):
            init_param(m.weight, trunc_normal(0.02))
            if m.bias is not None:
                init_param(m.bias, nn.init.zeros_)
    return h


class DINOv2Model(nn.Module):
    """The student (and, another instance, the teacher) of DINOv2: a `VisionTransformer` backbone (with
    `mask_token`, no classifier) and the DINO head, plus an iBOT head when it is separate (Meta's
    `student`/`teacher` ModuleDicts: `backbone`, `dino_head`, `ibot_head`). The constructor takes the
    backbone's arguments and the heads' (`HEAD_KEYS`) in one flat dict, the run's recorded model kwargs;
    `patch_embed_lr_mult` (dino.patch_embed_lr_mult) is optimizer metadata the objective passes, not
    recorded with the model: it may change on resume, the parameter groups do not (see `param_roles`)."""

    ARCH_KEYS = (*VisionTransformer.ARCH_KEYS, *HEAD_KEYS)
    """The constructor arguments that decide the weights: the backbone's and the heads'."""
    backbone_class: type[nn.Module] = VisionTransformer
    head_class: type[DINOHead] = DINOHead  # the DINO and iBOT heads' class

    def __init__(self, head_n_prototypes: int = 65536, head_hidden_dim: int = 2048, head_bottleneck_dim: int = 256,
                 head_nlayers: int = 3, ibot_separate_head: bool = False, ibot_head_n_prototypes: int = 65536,
                 ibot_head_bottleneck_dim: int = 256, patch_embed_lr_mult: float = 1.0, fresh_roles: bool = False,
                 **vit_kwargs: Any) -> None:
        super().__init__()
        self.patch_embed_lr_mult = patch_embed_lr_mult
        self.fresh_roles = fresh_roles  # optimizer metadata (adapt.*, as patch_embed_lr_mult): see param_roles
        self.backbone = self.backbone_class(**{**vit_kwargs, "num_classes": 0, "mask_token": True})
        dim = self.backbone.embed_dim

        def head(out_dim: int, bottleneck_dim: int) -> DINOHead:
            return redraw_head(self.head_class(dim, out_dim, hidden_dim=head_hidden_dim,
                                               bottleneck_dim=bottleneck_dim, nlayers=head_nlayers))

        self.dino_head = head(head_n_prototypes, head_bottleneck_dim)
        self.ibot_head = head(ibot_head_n_prototypes, ibot_head_bottleneck_dim) if ibot_separate_head else None

    # -- what the trainer and the optimizer ask of a model
    def no_weight_decay(self) -> set[str]:
        """None beyond the optimizer's rule (biases and 1-D parameters: norms, LayerScale gammas): Meta's
        `get_params_groups_with_decay` exempts only names ending in `.bias` or holding `norm` or `gamma`, so
        the position table, class, register and mask tokens are decayed, unlike the ViT's timm/DeiT set."""
        return set()

    def group_matcher(self, coarse: bool = False) -> dict[str, str]:
        """The backbone's layers (Meta's layer-wise decay numbers only backbone parameters; the heads are the
        last layer, scale 1)."""
        return {k: r"^backbone\." + v.lstrip("^") for k, v in self.backbone.group_matcher(coarse).items()}

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.backbone.set_grad_checkpointing(enable)

    def param_roles(self) -> dict[str, str]:
        """The parameters DINOv2's optimizer treats apart (Meta's `get_params_groups_with_decay`):
        `patch_embed` ("patch_embed" in the name: its lr x `patch_embed_lr_mult`) and `last_layer` (the
        heads' weight-normalised prototypes, `is_last_layer`: lr 0 for dino.freeze_last_layer_steps, which
        the objective applies). Each is a parameter group of its own (`pipeline.train.optim.param_groups`)."""
        roles = {"patch_embed": r"^backbone\.patch_embed\.", "last_layer": r"^(dino_head|ibot_head)\.last_layer\."}
        if self.fresh_roles:  # adapt.*: the heads' other parameters apart from the backbone's, whose lr warms up
            roles["head"] = r"^(dino_head|ibot_head)\."
        return roles

    def lr_multipliers(self) -> dict[str, float]:
        """Role -> factor on the lr (on top of layer-wise decay, as Meta multiplies them)."""
        return {"patch_embed": self.patch_embed_lr_mult}

    @property
    def patch_head(self) -> DINOHead:
        return self.ibot_head if self.ibot_head is not None else self.dino_head

    # -- the student's forward (through the DeepSpeed engine) and the teacher's
    def forward(self, global_crops: torch.Tensor, local_crops: torch.Tensor | None,
                masks: torch.Tensor | None, rope_aug: tuple[torch.Tensor, torch.Tensor | None] | None = None,
                mask_indices: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Student: global crops (2B, 3, G, G) crop-major, with iBOT's `masks` (2B, N) on their patches;
        local crops (nB, 3, L, L) or None; `rope_aug` (DINOv3's) the RoPE boxes of the global and the local
        crops, (2B, depth, 5) and (nB, depth, 5). Returns the heads' outputs of the global and local class
        tokens, of the masked patches (in `masks`' row-major order; with `mask_indices`, `masked_rows`'
        fixed-size gather instead), the global class tokens before the head (KoLeo's input) and the global
        patch tokens after the final norm (Gram anchoring's); and `cls`, the DINO head's outputs of the global
        then the local class tokens as one tensor ("global" and "local" are its rows)."""
        g_aug, l_aug = rope_aug if rope_aug is not None else (None, None)
        g = self._tokens(global_crops, masks, g_aug)
        rows = [g.cls_token]
        if local_crops is not None:
            rows.append(self._tokens(local_crops, None, l_aug).cls_token)
        masked = gather_rows(g.patch_tokens, masks, mask_indices) if masks is not None else None
        shared = masked is not None and self.ibot_head is None  # the masked patches go through the DINO head too
        # One call of the DINO head over every crop's class tokens (and the masked patches when it is the patch
        # head too), as Meta's SSLMetaArch concatenates them: one larger matmul per layer, and the prototypes'
        # weight normalisation computed once, not once per kind of crop (issue 58; docs/performance.md).
        heads = self.dino_head(torch.cat(rows + [masked] if shared else rows))
        n_global, n_cls = g.cls_token.shape[0], sum(r.shape[0] for r in rows)
        out = {"global_cls": g.cls_token, "cls": heads[:n_cls], "global": heads[:n_global],
               "global_patch": g.patch_tokens}
        if local_crops is not None:
            out["local"] = heads[n_global:n_cls]
        if masked is not None:
            out["masked"] = heads[n_cls:] if shared else self.ibot_head(masked)
        return out

    def _tokens(self, images: torch.Tensor, masks: torch.Tensor | None, rope_aug: torch.Tensor | None) -> Any:
        # Only a RoPE backbone takes augmentation draws (a ViT's forward_tokens has no such argument).
        if rope_aug is None:
            return self.backbone.forward_tokens(images, masks)
        return self.backbone.forward_tokens(images, masks, rope_aug)

    @torch.no_grad()
    def teacher_forward(self, global_crops: torch.Tensor, masks: torch.Tensor | None,
                        mask_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher: the DINO head's output for each global crop's class token, the two crops of an image
        swapped (crop A's target is crop B's output, as Meta's), and the patch head's output on the masked
        patches of the unmasked crops (the rows `mask_indices` gathers, as the student's)."""
        t = self.backbone.forward_tokens(global_crops)
        first, second = t.cls_token.chunk(2)
        if masks is None:
            return self.dino_head(torch.cat([second, first])), None
        masked = gather_rows(t.patch_tokens, masks, mask_indices)
        if self.ibot_head is not None:
            return self.dino_head(torch.cat([second, first])), self.ibot_head(masked)
        # One head call over the class tokens and the masked patches, as the student's (forward).
        heads = self.dino_head(torch.cat([second, first, masked]))
        return heads[:t.cls_token.shape[0]], heads[t.cls_token.shape[0]:]


class DINOv3Model(DINOv2Model):
    """DINOv3's student and teacher (Meta's dinov3 `SSLMetaArch`): `DINOv2Model` on a `DINOv3ViT` backbone.
    The constructor takes DINOv3ViT's arguments (RoPE, storage tokens) and the heads'; the RoPE augmentation
    (rope_shift_coords and the rest) acts in the student's training forward only, through the draws handed
    to it (`rope_aug`): the teacher runs in eval mode, without it, as Meta's."""

    ARCH_KEYS = (*DINOv3ViT.ARCH_KEYS, *HEAD_KEYS)
    backbone_class = DINOv3ViT
    head_class = DINOv3Head  # Meta's DINOv3 head: plain prototypes (last_layer.weight), not weight-normalised


def masked_rows(masks: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """iBOT's masked patches as a gather of a fixed size, as Meta's collate gives them (`mask_indices_list`
    padded to `upperbound`): the flat indices of `masks`' (B, N) True entries in row-major order, then
    indices of unmasked patches up to `bound` rows, and which rows are masked ones. Shapes depend on
    `bound` only, and nothing is read on the host (a stable sort puts the masked entries first, where
    `nonzero` or `patch_tokens[masks]` would wait for the device to say how many there are). `bound` must
    be at least the masked count (the objective's `mask_bound`); beyond it patches would be dropped."""
    flat = masks.flatten()
    bound = min(bound, flat.numel())
    order = torch.argsort((~flat).to(torch.uint8), stable=True)[:bound]
    valid = torch.arange(bound, device=flat.device) < flat.sum()
    return order, valid


def gather_rows(tokens: torch.Tensor, masks: torch.Tensor, indices: torch.Tensor | None) -> torch.Tensor:
    """(B, N, D) tokens -> the masked ones, (M, D): the rows `indices` names (`masked_rows`: a fixed M, no
    host read) or, without them, `tokens[masks]` (M the data's: a host read, in forward and backward)."""
    if indices is None:
        return tokens[masks]
    return tokens.flatten(0, 1).index_select(0, indices)


def backbone_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The backbone's tensors of a `DINOv2Model` state dict, under `VisionTransformer`'s (timm's) names."""
    return {k[len("backbone."):]: v for k, v in state.items() if k.startswith("backbone.")}
