"""`data.decode_device: cuda` with the decode of micro batch t+1 overlapping step t (as DALI's and timm's
prefetchers overlap theirs): when the train loader hands micro batch t out, it takes t+1's raw JPEG batch from
its workers and starts that batch's device decode on a side stream; the training stream waits for it only when
t+1 is moved to the device, after step t's kernels were queued.

Only the time of the decode moves. The raw batch is the one the loader would have handed out next, decoded by
the same `GpuBatchDecoder` with the same crop boxes and flips, so the pixels are the same; the loader does its
bookkeeping (position, bad-sample counts, the order checks) when a micro batch is handed out, not when it is
taken ahead, so a checkpoint between the two saves the same position and counts as without the overlap, and a
seek or a restart drops the batch taken ahead (`TrainLoader.close`). On the CPU (the tests) the decode runs
at once, on no stream.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch


class DecodeAhead:
    """One raw micro batch's device decode, started now on `stream` (None: run here and now)."""

    def __init__(self, decoder: Any, images: dict[str, Any], device: torch.device,
                 stream: torch.cuda.Stream | None) -> None:
        self.stream = stream
        if stream is not None:
            # The side stream must not start before what the training stream queued for the batch's memory.
            stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            self.out, self.bad = decoder(images, device)

    def wait(self) -> tuple[torch.Tensor, list[int]]:
        """The decoded batch, for the current (training) stream: it waits for the side stream's work, and the
        caching allocator is told the tensor is used there (it was made on the side stream)."""
        if self.stream is not None:
            current = torch.cuda.current_stream(self.out.device)
            current.wait_stream(self.stream)
            self.out.record_stream(current)
        return self.out, self.bad


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A stream for the decodes taken ahead on a CUDA device; None elsewhere."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None
