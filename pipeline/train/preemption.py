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
        return self.check(step)[0]

    def check(self, step: int | None = None, save_due: bool = False) -> tuple[bool, bool]:
        """(stop, save) agreed by every rank: stop as `should_stop`; save when any rank's `save_due` (a
        time-interval checkpoint, train.ckpt_every_s) is set. Rides on the same all-reduce, so a timed
        checkpoint costs no extra collective and every rank saves the same step even though their clocks
        cross the interval at different steps."""
        if step is not None and step % self.every:
            return False, False
        import torch
        import torch.distributed as dist

        from pipeline.train.host_reads import host_tensor

        # On the host by design (a gloo group): reading it waits for no device (host_reads.py counts it so).
        flags = host_tensor(torch.tensor([0 if received() is None else 1, int(save_due)], dtype=torch.int32))
        if self.group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flags[0].item()), bool(flags[1].item())
