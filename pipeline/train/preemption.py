"""Preemption agreement: every rank stops at the same step boundary once any rank got a signal.

The signal flag, its handlers and how helper processes treat signals are `pipeline.signals`; this module
is the collective part, which needs torch.distributed.
"""

from __future__ import annotations

from pipeline.signals import install_signal_handlers, received


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

        flag = torch.tensor([0 if received() is None else 1], dtype=torch.int32)
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())
