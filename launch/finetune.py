#!/usr/bin/env python
"""Fine-tune a pretrained ViT at a new resolution with a fresh head.

    deepspeed launch/finetune.py --res 384          # the newest finished pretraining run in runs/, the paper's recipe
    deepspeed launch/finetune.py --config configs/finetune/vit_b16_384.yaml --from runs/b16-i21k --res 384
    deepspeed launch/finetune.py --config configs/finetune/demo.yaml --from runs/demo-pretrain --res 64
    python launch/finetune.py --config configs/finetune/vit_b16_384.yaml --from vit_b16.safetensors --res 384x512

--from: a pretraining run directory, a .safetensors file, a timm-format .pth/.bin state dict, one of Meta's
DINOv2 backbone files (dinov2_vitb14_reg4_pretrain.pth) or a timm DINOv3 ViT's weights (architecture read from
either, docs/model.md; DINOv3's RoPE has no position table to resize at --res); without it,
the newest finished pretraining run under runs/ (printed). Without --config: the paper's recipe (the train
section of configs/finetune/vit_b16_384.yaml) with the source run's architecture and data set.
A restart on the same run.dir keeps the source recorded at its first start. Exit codes as launch/pretrain.py
(pipeline/exit_codes.py).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Everything under the guard: each DataLoader worker runs this file again as __mp_main__ (multiprocessing's
# fork server, as spawn, re-imports the main script), and must neither install the rank's handlers nor
# import DeepSpeed.
if __name__ == "__main__":
    # First thing: SIGUSR1/SIGTERM during setup (imports, DeepSpeed init, checkpoint load) must only raise the
    # preemption flag; the trainer then exits 75 at its first safe point and Slurm requeues the job.
    from pipeline.signals import exit_without_teardown, install_signal_handlers

    install_signal_handlers()

    from pipeline.commands import finetune

    exit_without_teardown(finetune(sys.argv[1:]))  # the interpreter's teardown costs seconds, for nothing
