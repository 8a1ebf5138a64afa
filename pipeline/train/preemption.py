"""Preemption: a signal on any rank -> all ranks checkpoint at the same step boundary -> exit 75 -> requeue.

Slurm sends SIGUSR1 some minutes before the time limit (`#SBATCH --signal=USR1@300`) and SIGTERM on
`scancel`. The handler only sets a flag (nothing else is safe inside a signal handler); the training
loop asks `should_stop()` at each step boundary, which takes the max of the flag over all ranks so
that every rank stops at the same step even if only one got the signal.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "checkpointed, run me again"; slurm/*.sh turns it into a requeue


class PreemptionHandler:
    def __init__(self, signals: tuple[int, ...] = (signal.SIGUSR1, signal.SIGTERM)):
        self.received: int | None = None
        for sig in signals:
            signal.signal(sig, self._handle)
        # The flag goes over a CPU (gloo) group: agreeing on it never waits for the GPU stream.
        self.group = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD

    def _handle(self, signum: int, frame) -> None:
        self.received = signum

    def should_stop(self) -> bool:
        """True on every rank once any rank has received a signal. Collective: call on all ranks."""
        flag = torch.tensor([1 if self.received is not None else 0], dtype=torch.int32)
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())
