"""Preemption: a signal on any rank -> all ranks checkpoint at the same step boundary -> exit 75 -> requeue.

Slurm sends SIGUSR1 some minutes before the time limit (`#SBATCH --signal=USR1@300`) and SIGTERM on
`scancel`. `install_signal_handlers()` is the first thing the launchers do, before the config is read
and before DeepSpeed is imported: a signal during setup (imports, process group, checkpoint load,
fine-tune source) only raises the flag, and the trainer exits 75 at its first safe point instead of
dying with the default action (which Slurm counts as a failure and does not requeue).

The handler only sets a flag (nothing else is safe inside a signal handler). `Preemption.should_stop()`
takes the max of the flag over all ranks so that every rank stops at the same step even if only one
got the signal. This module imports nothing heavy at the top: installing the handlers takes microseconds.
"""

from __future__ import annotations

import signal
from typing import Any

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "checkpointed, run me again"; slurm/*.sh turns it into a requeue
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

_received: int | None = None  # the first signal seen by this process


def _handle(signum: int, frame: Any) -> None:
    global _received
    if _received is None:
        _received = signum


def install_signal_handlers() -> None:
    """Catch SIGUSR1/SIGTERM from now on (idempotent). Call before anything slow."""
    for sig in SIGNALS:
        signal.signal(sig, _handle)


def received() -> int | None:
    return _received


class Preemption:
    """Agreement on the flag across ranks. Collective: every rank calls `should_stop()` at the same steps.

    The agreement is an all-reduce of one int over a CPU (gloo) group, so it never waits on the GPU
    stream; `every` > 1 asks only every few steps (`python launch/bench.py preemption` measures what one costs).
    """

    def __init__(self, every: int = 1):
        import torch.distributed as dist

        install_signal_handlers()  # no-op when the launcher did it already
        self.every = max(1, every)
        self.group = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD

    def should_stop(self, step: int | None = None) -> bool:
        """True on every rank once any rank has received a signal. With `step`, only asks (collectively)
        when step is a multiple of `every`; None always asks (setup's safe point)."""
        if step is not None and step % self.every:
            return False
        import torch
        import torch.distributed as dist

        flag = torch.tensor([0 if _received is None else 1], dtype=torch.int32)
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())
