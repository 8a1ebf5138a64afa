"""Throughput, MFU and accuracy.

MFU = achieved model FLOP/s / peak FLOP/s, where achieved = images/s x 3 x forward FLOPs per image (a
training step is a forward and a backward of twice its cost; recomputation from gradient checkpointing
is not counted, as in PaLM's definition).
"""

from __future__ import annotations

import time

import torch

# Dense bf16 tensor-core peak of one device, FLOP/s (vendor datasheets, without sparsity).
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe card is 756e12: set train.peak_flops
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
    "V100": 125e12,  # fp16; V100 has no bf16
}


def device_peak_flops(override: float | None = None) -> float | None:
    """Peak FLOP/s of the current GPU from the table (or the override); None on CPU or an unknown GPU."""
    if override is not None:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in name:
            return flops
    return None


class ThroughputMeter:
    """Images/s, MFU and data-wait fraction over the window since the last `read()`."""

    def __init__(self, flops_per_image: float, world_size: int, peak_flops: float | None):
        self.flops_per_image, self.world_size, self.peak = flops_per_image, world_size, peak_flops
        self.reset()

    def reset(self) -> None:
        self.start, self.images, self.data_wait = time.perf_counter(), 0, 0.0

    def add(self, images: int, data_wait_s: float) -> None:
        self.images += images
        self.data_wait += data_wait_s

    def read(self) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        per_device = self.images / elapsed
        out = {"images_per_s": per_device * self.world_size, "images_per_s_per_device": per_device,
               "data_wait": self.data_wait / elapsed}
        if self.peak:
            out["mfu"] = per_device * 3 * self.flops_per_image / self.peak
        self.reset()
        return out


def topk_correct(logits: torch.Tensor, targets: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> list[torch.Tensor]:
    """Per-sample 0/1 tensors: is the target among the top-k logits (k capped at the class count)."""
    maxk = min(max(ks), logits.shape[-1])
    top = logits.topk(maxk, dim=-1).indices
    hits = top.eq(targets[:, None])
    return [hits[:, : min(k, maxk)].any(dim=-1).float() for k in ks]
