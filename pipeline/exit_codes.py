"""The exit codes of launch/pretrain.py and launch/finetune.py, in one place.

slurm/pretrain.sh repeats the numbers it acts on (a test checks they agree); docs/run-directory.md
lists them. This module imports nothing: the launchers read it before anything slow.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    """Trained to train.steps and exported model.safetensors."""
    ERROR = 1
    """A condition to act on: missing or bad data, a checkpoint or weights file that cannot be used (a --from
    that is not weights, is truncated, or does not fit its config), no space left, DeepSpeed failing; one line
    says which file and what to do."""
    USAGE = 2
    """A config or command-line error (unknown key or variant, no --from, a model override the source decides,
    a run directory held by another job, a taken port): nothing was trained or written."""
    NONFINITE = 3
    """Stopped on non-finite losses without saving; the last good checkpoint is named."""
    PREEMPTED = 75
    """EX_TEMPFAIL: checkpointed after SIGUSR1/SIGTERM (or the launcher's end); run the same command again.
    slurm/*.sh turns it into `scontrol requeue`."""
    HUNG = 76
    """A rank made no progress for dist.timeout_s (a collective, a loader or a save that never returned):
    its line names the rank, step and phase; every thread's stack is in RUN_DIR/errors/hang-rank*.txt.
    slurm/*.sh does not requeue it (a requeue would most likely hang again)."""
    RANK_KILLED = 247
    """What the `deepspeed` launcher returns when a rank was killed by a signal (SIGKILL: the OOM killer,
    a node's cgroup); its own code, not ours: the job did not checkpoint and resumes from the last one."""
