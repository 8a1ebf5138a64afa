"""An MAE training step against a supervised one on the same ViT: what masking saves.

Both steps are the trainer's work in plain PyTorch (forward, loss, backward, AdamW with the trainer's
parameter groups), on the same encoder weights and the same images, measured in turns
(`benchmarks.common.interleaved`). The MAE step masks 75% of the patches (fixed noise) and runs the
8 x 512 decoder on all tokens; the supervised one classifies the whole image into 1000 classes.
`mae_vs_supervised` is the MAE step's time over the supervised step's; `flop_ratio` what `mae_flops`
and `model_flops` predict for it.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import bench_device, interleaved, median, spread, synchronize
from pipeline.config import TrainConfig
from pipeline.model.mae import build_mae, mae_flops, mae_kwargs
from pipeline.model.vit import build_vit, model_flops, variant_kwargs
from pipeline.train.metrics import device_peak_flops
from pipeline.train.optim import build_optimizer, param_groups


def add_mae_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mae-variant", default=None, help="ViT variant (default: vit_b16 on a GPU and on CPU)")
    p.add_argument("--mae-res", type=int, default=224)
    p.add_argument("--mae-batch", type=int, default=None, help="images per step (default: 128 on a GPU, 2 on CPU)")
    p.add_argument("--mae-steps", type=int, default=None, help="steps per window (default: 10 on a GPU, 1 on CPU)")
    p.add_argument("--mae-windows", type=int, default=3)


class Step:
    """forward -> loss -> backward -> AdamW step of one model (fp32 on CPU, bf16 autocast on a GPU)."""

    def __init__(self, model: torch.nn.Module, depth: int, images: torch.Tensor, loss) -> None:
        self.model, self.images, self.loss = model.to(images.device).train(), images, loss
        train = TrainConfig(lr=1e-4, weight_decay=0.05, betas=(0.9, 0.95), grad_clip=0.0)
        self.optimizer = build_optimizer(param_groups(self.model, train, depth), train)
        self.cuda = images.device.type == "cuda"

    def __call__(self) -> None:
        with torch.autocast("cuda", torch.bfloat16, enabled=self.cuda):
            loss = self.loss(self.model, self.images)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def bench_mae(args: Any) -> dict[str, Any]:
    t_start = time.perf_counter()
    device = bench_device()
    gpu = device.type == "cuda"
    variant = args.mae_variant or "vit_b16"
    res, batch = args.mae_res, args.mae_batch or (128 if gpu else 2)
    steps, windows = args.mae_steps or (10 if gpu else 1), args.mae_windows
    torch.manual_seed(0)
    images = torch.randn(batch, 3, res, res, device=device)
    targets = torch.randint(0, 1000, (batch,), device=device)
    mae = build_mae(variant, img_size=res)
    vit = build_vit(variant, img_size=res, num_classes=1000)
    # The same encoder weights in both (the MAE state dict holds the ViT's trunk under the same names).
    vit.load_state_dict({k: v for k, v in mae.state_dict().items() if k in vit.state_dict()}, strict=False)
    n = mae.patch_embed.num_patches
    noise = torch.rand(batch, n, generator=torch.Generator().manual_seed(1)).to(device)
    depth = variant_kwargs(variant)["depth"]
    contenders = {
        "mae": Step(mae, depth, images, lambda m, x: m(x, mask_ratio=0.75, noise=noise)[0]),
        "supervised": Step(vit, depth, images, lambda m, x: F.cross_entropy(m(x).float(), targets)),
    }
    print(f"mae: {variant} @ {res}, batch {batch} on {device}: {windows} windows of {steps} steps, in turns")
    t = interleaved(contenders, steps, windows, 1, device)
    synchronize(device)
    flops = {"mae": mae_flops(mae_kwargs(variant, img_size=res)),
             "supervised": model_flops(variant_kwargs(variant, img_size=res, num_classes=1000))}
    figures: dict[str, Any] = {"variant": variant, "res": res, "batch": batch, "steps": steps, "windows": windows,
                               "device": device.type, "threads": torch.get_num_threads(),
                               "dtype": "bf16-autocast" if gpu else "fp32"}
    for name in contenders:
        step_s = median(t.wall[name])
        figures[name] = {"step_ms": round(1e3 * step_s, 1), "img_s": round(batch / step_s, 2),
                         "gflops_per_image": round(flops[name] / 1e9, 2), "spread": round(spread(t.wall[name]), 3)}
    peak = device_peak_flops(None)  # the GPU's datasheet bf16 peak; None on CPU
    for name in contenders:  # 3 x forward FLOPs per image (forward and backward), as the trainer's MFU
        figures[name]["mfu"] = round(3 * flops[name] * figures[name]["img_s"] / peak, 4) if peak else None
    figures["mae_vs_supervised"] = round(median(t.wall["mae"]) / median(t.wall["supervised"]), 3)
    figures["flop_ratio"] = round(flops["mae"] / flops["supervised"], 3)
    figures["seconds"] = round(time.perf_counter() - t_start, 1)
    print(f"MAE step {figures['mae']['step_ms']} ms, supervised {figures['supervised']['step_ms']} ms: ratio "
          f"{figures['mae_vs_supervised']} (FLOPs predict {figures['flop_ratio']})")
    return figures
