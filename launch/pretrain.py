#!/usr/bin/env python
"""Pretrain a ViT.

    deepspeed launch/pretrain.py --config configs/pretrain/demo.yaml [train.lr=3e-4 ...]   # one node
    srun python launch/pretrain.py --config configs/pretrain/vit_b16_i21k.yaml run.dir=...  # Slurm
    python launch/pretrain.py --config configs/pretrain/demo.yaml                         # one process
    python launch/pretrain.py                                                             # the demo config

Starting again with the same run.dir resumes from its newest complete checkpoint. Exit codes
(pipeline/exit_codes.py): 0 done, 75 checkpointed on SIGUSR1/SIGTERM (requeue), 3 stopped on
non-finite losses, 1 data/checkpoint error, 2 config/usage error. See docs/run-directory.md.
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

    from pipeline.commands import pretrain

    exit_without_teardown(pretrain(sys.argv[1:]))  # the interpreter's teardown costs seconds, for nothing
