"""DeepSpeed's optimizer step, changed in two ways; like pipeline/train/ds_compat.py (which checks the
DeepSpeed version on import), the private API of the versions tested, in one place:

  - `read_free_steps`: the ZeRO optimizers' step without its host reads of the gradient norm (DeepSpeed's
    `is_invalid_grad_norm` and `unscale_and_clip_grads`, replaced);
  - `clip_apart`: train.grad_clip on each set of parameter groups by that set's own norm (a distillation's
    students), where DeepSpeed clips every group by one.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import deepspeed.runtime.utils as ds_utils
import torch

import pipeline.train.ds_compat  # noqa: F401 - refuses a DeepSpeed version these patches were not written for

# ----------------------------------------------------------------------------- a step without host reads
# DeepSpeed 0.19's ZeRO step reads the gradient norm on the host to decide whether to skip the step:
# `is_invalid_grad_norm` in ZeRO-1/2's `step` (bf16 with its overflow check on, fp32 always) and in each
# group's `unscale_and_clip_grads` when clipping, and in ZeRO-3's `step` always. Each read waits for the
# backward to finish before the host queues the optimizer. `read_free_steps` makes that decision on the
# device instead: a step whose norm is not finite (or DeepSpeed's -1 sentinel for one) has its gradients
# zeroed, clipped ones scaled exactly as DeepSpeed scales them. What that loses against DeepSpeed's skip:
# AdamW still takes the step with a zero gradient (its moments decay, weight decay applies, its step
# count moves) instead of none. (The ZeRO-1/2 overflow check, `has_overflow`, is DeepSpeed's config:
# `bf16.check_grad_overflow`, set by pipeline.derived.deepspeed_config.)
_READ_FREE: ContextVar[bool] = ContextVar("read_free_step", default=False)
_is_invalid_grad_norm = ds_utils.is_invalid_grad_norm


def _norm_check(norm: Any) -> bool:
    """DeepSpeed's `is_invalid_grad_norm` where its ZeRO optimizers call it; within a read-free step, False
    for a tensor without reading it (`_scale_grads` then zeroes an invalid norm's gradients)."""
    if _READ_FREE.get() and torch.is_tensor(norm):
        return False
    return _is_invalid_grad_norm(norm)


def _scale_grads(opt: Any, grads: list[torch.Tensor], total_norm: Any) -> None:
    """DeepSpeed's unscale-and-clip of `grads` by the global `total_norm`, the same arithmetic; the
    gradients zeroed on the device where the norm is not finite."""
    norm = total_norm if torch.is_tensor(total_norm) else torch.tensor(float(total_norm), device=grads[0].device)
    finite = torch.isfinite(norm) & (norm >= 0)
    combined_scale = opt.loss_scale
    if opt.clip_grad > 0.0:
        clip = torch.clamp(((torch.where(finite, norm, float("inf")) / opt.loss_scale) + 1e-6) / opt.clip_grad,
                           min=1.0)
        combined_scale = clip * opt.loss_scale
    factor, bad = 1.0 / combined_scale, ~finite
    for grad in grads:
        if bad.device != grad.device:  # optimizer offload: the partitions on the host
            factor = factor.to(grad.device) if torch.is_tensor(factor) else factor
            bad = bad.to(grad.device)
        grad.data.mul_(factor)
        grad.data.masked_fill_(bad, 0.0)  # a NaN times 0 is NaN: zeroed, not scaled


def read_free_steps(engine: Any) -> None:
    """From now on `engine`'s optimizer steps read nothing on the host (see above). ZeRO-1/2 and 3."""
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    opt = engine.optimizer
    stage3.is_invalid_grad_norm = stage_1_and_2.is_invalid_grad_norm = _norm_check  # idempotent
    if isinstance(opt, stage_1_and_2.DeepSpeedZeroOptimizer):
        def unscale_and_clip(grad_groups_flat: list[Any], total_norm: Any) -> None:
            if total_norm is None:
                return
            flat = [g for item in grad_groups_flat for g in (item if isinstance(item, list) else [item])]
            _scale_grads(opt, flat, total_norm)
    elif isinstance(opt, stage3.DeepSpeedZeroOptimizer_Stage3):
        def unscale_and_clip(sub_group_id: int, total_norm: Any) -> None:
            _scale_grads(opt, [opt.fp32_partitioned_groups_flat[sub_group_id].grad], total_norm)
    else:
        return  # ZeRO-0: DeepSpeed's bf16 wrapper, not changed
    real_step = opt.step

    def step(*args: Any, **kwargs: Any) -> Any:
        token = _READ_FREE.set(True)
        try:
            return real_step(*args, **kwargs)
        finally:
            _READ_FREE.reset(token)

    opt.unscale_and_clip_grads, opt.step = unscale_and_clip, step


# ----------------------------------------------------------------------------- clipping apart
# train.grad_clip on each set of parameter groups by that set's own norm: a distillation's students, each
# updated as its own engine would update it (Meta's one engine per student). DeepSpeed clips every group by
# one global norm; here each group is scaled by its set's norm, combined (`combine_grad_norm_groups`) from the
# norms DeepSpeed takes per group (ZeRO-1/2: `scaled_global_norm`'s, ZeRO-3: `_get_norm_groups`', per
# sub-group) exactly as a run of that set alone combines them all. The global norm still decides a step whose
# gradients are not finite (all sets skip it) and is what train/gnorm logs.


def clip_apart(engine: Any, sets: list[str]) -> None:
    """Clip each set of `engine`'s parameter groups on its own: `sets[i]` names the set of the client
    optimizer's group i. Any ZeRO stage, bf16 or fp32, after `read_free_steps` where that is installed."""
    from deepspeed.moe.utils import split_params_grads_into_shared_and_expert_params
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.utils import (
        clip_grad_norm_,
        clip_tensors_by_global_norm,
        combine_grad_norm_groups,
        get_global_norm,
        get_global_norm_of_tensors,
        get_weight_norm,
    )
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    opt, members = engine.optimizer, {}
    for i, name in enumerate(sets):
        members.setdefault(name, []).append(i)
    if isinstance(opt, stage_1_and_2.DeepSpeedZeroOptimizer | stage3.DeepSpeedZeroOptimizer_Stage3):
        if getattr(opt, "has_moe_layers", False) or getattr(opt, "use_muon", False):
            raise NotImplementedError("clipping apart: MoE layers or Muon (not used here)")
        zero3 = isinstance(opt, stage3.DeepSpeedZeroOptimizer_Stage3)
        group_of = (lambda k: opt.sub_group_to_group_id[k]) if zero3 else (lambda k: k)
        norms: list[Any] = []

        def set_norm(k: int) -> Any:  # the norm of the set of (sub-)group k, from its groups' norms in order
            own = members[sets[group_of(k)]]
            return combine_grad_norm_groups([n for j, n in enumerate(norms) if group_of(j) in own])

        inner = opt.unscale_and_clip_grads
        if zero3:
            real_norms = opt._get_norm_groups

            def norm_groups() -> list[Any]:
                norms[:] = real_norms()
                return list(norms)

            def unscale_and_clip(sub_group_id: int, total_norm: Any) -> None:  # noqa: ARG001 - DeepSpeed's
                inner(sub_group_id, set_norm(sub_group_id))

            opt._get_norm_groups = norm_groups
        else:
            def scaled_global_norm(norm_type: int = 2) -> Any:  # DeepSpeed's, its per-group norms kept
                norms[:] = [opt.complete_grad_norm_calculation_for_cpu_offload(opt.params_in_partition[i])
                            if opt.cpu_offload else
                            opt.get_grad_norm_direct(opt.averaged_gradients[i], opt.params_in_partition[i])
                            for i in range(len(opt.bit16_groups))]
                return combine_grad_norm_groups(norms, norm_type=norm_type)

            def unscale_and_clip(grad_groups_flat: list[Any], total_norm: Any) -> None:
                if total_norm is None:
                    return inner(grad_groups_flat, total_norm)
                k = next(i for i, p in enumerate(opt.single_partition_of_fp32_groups) if p.grad is grad_groups_flat[0])
                return inner(grad_groups_flat, set_norm(k))

            opt.scaled_global_norm = scaled_global_norm
        opt.unscale_and_clip_grads = unscale_and_clip
    elif isinstance(opt, BF16_Optimizer):  # bf16 accumulating in fp32: each set clipped, then DeepSpeed's step unclipped
        real_step = opt.step

        def step(*args: Any, **kwargs: Any) -> Any:
            grads = [[opt.fp32_groups_gradients[i][j] for i in own for j in range(len(opt.bf16_groups[i]))
                      if opt.fp32_groups_has_gradients[i][j]] for own in members.values()]
            found = [get_global_norm_of_tensors(g, mpu=opt.mpu, norm_type=opt.norm_type) for g in grads]
            if opt.clip_grad > 0 and not _is_invalid_grad_norm(combine_grad_norm_groups(found)):
                for g, norm in zip(grads, found):
                    clip_tensors_by_global_norm(g, max_norm=opt.clip_grad, global_norm=norm, mpu=opt.mpu)
            saved, opt.clip_grad = opt.clip_grad, 0.0
            try:
                return real_step(*args, **kwargs)
            finally:
                opt.clip_grad = saved

        opt.step = step
    elif isinstance(opt, FP16_UnfusedOptimizer):  # ZeRO-0 with bf16: DeepSpeed's per-group norms, combined per set
        def unscale_and_clip_sets(total_norm: Any, apply_scale: bool = True) -> Any:  # noqa: ARG001 - DeepSpeed's
            cur = opt.loss_scale_config.cur_scale
            for own in members.values() if apply_scale else ():
                grads = [split_params_grads_into_shared_and_expert_params(opt.fp16_groups[i])[0] for i in own]
                norm = get_global_norm(norm_list=[get_weight_norm(g, mpu=opt.mpu) if g else 0.0 for g in grads])
                clip = ((norm / cur) + 1e-6) / opt.clip_grad
                scale = clip * cur if clip > 1 else cur
                for p in (p for i in own for p in opt.fp32_groups[i] if p.grad is not None):
                    p.grad.data.mul_(1. / scale)
            return cur

        opt.unscale_and_clip_grads = unscale_and_clip_sets
    elif type(opt).__module__.startswith("deepspeed"):
        raise NotImplementedError(f"clipping apart: DeepSpeed's {type(opt).__name__} (not used here)")
    else:  # ZeRO-0 in fp32: the engine clips the module's gradients before the step
        params = [[p for i in own for p in opt.param_groups[i]["params"]]
                  for own in members.values()]
        order = {id(p): n for n, p in enumerate(engine.module.parameters())}  # a run alone walks the module
        engine.clip_fp32_gradients = lambda: [
            clip_grad_norm_(sorted(ps, key=lambda p: order[id(p)]), max_norm=engine.gradient_clipping(),
                            mpu=engine.mpu) for ps in params]
