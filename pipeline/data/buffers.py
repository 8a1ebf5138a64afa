"""Batch buffers reused across steps: a DataLoader worker writes each image batch into one of a few
shared-memory buffers of its own instead of a fresh one, once the main process has let go of it.

Why: a fresh shared-memory batch costs its first touch, page by page (about 0.4 ms per 224 px image
on the 2-core development machine, a third of the decode + augmentation it carries; `python
launch/bench.py loader`, docs/data.md#throughput). A reused buffer is already mapped and warm.

The protocol is one small shared int64 array `released[worker, slot]`, made by the main process
before the workers start:

- worker k's i-th batch goes into slot i % RING, generation g = i // RING. It reuses the slot's
  buffer only when the main process has released generation g - 1 (`released[k, slot] == g`);
  otherwise it takes a fresh buffer, as before. A worker never waits.
- the main process (`Releaser`) holds a reference to each batch's storage it handed out, and
  releases it (writes g + 1) once nothing but that reference is left: no tensor, view or slice of
  the batch anywhere in the process. A caller that keeps its batches (a test comparing them) keeps
  them intact; the worker just allocates fresh buffers meanwhile. With pinned memory the DataLoader
  hands out a pinned copy: the shared buffer is released when the batch arrives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .transforms import empty_batch

RING = 4
"""Buffers per worker: more than the DataLoader's prefetch_factor (2) plus the batch in use."""


def storage_users(storage: torch.UntypedStorage) -> int:
    """How many tensors and storage objects share this storage (the storage object itself included).
    A private torch function: where it is missing, every batch counts as in use (never reused)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return 2 if use_count is None else int(use_count(storage._cdata))


@dataclass
class BatchRing:
    """A worker's buffers: slot -> (generation, tensor)."""

    worker: int
    released: torch.Tensor
    """Shared [workers, RING] int64: generation + 1 of the last batch of each slot the main process let go of."""
    slots: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    reused: int = 0
    """Batches written into a reused buffer (for the tests and the benchmark)."""

    def take(self, use: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """The buffer for this worker's `use`-th batch and its tag (worker, slot, generation)."""
        slot, gen = use % RING, use // RING
        held = self.slots.get(slot)
        if (held is not None and held[0] == gen - 1 and tuple(held[1].shape) == shape
                and int(self.released[self.worker, slot]) == gen):
            buffer = held[1]
            self.reused += 1
        else:
            buffer = empty_batch(shape, shared=True)
        self.slots[slot] = (gen, buffer)
        return buffer, (self.worker, slot, gen)


@dataclass
class Releaser:
    """The main process's side: which batches it handed out are still in use."""

    released: torch.Tensor
    held: list[tuple[tuple[int, int, int], torch.UntypedStorage]] = field(default_factory=list)

    def handed_out(self, tag: tuple[int, int, int], images: torch.Tensor, copied: bool) -> None:
        """A batch from buffer `tag` was handed out as `images` (`copied`: a pinned copy of it)."""
        if copied:
            self._release(tag)
        else:
            self.held.append((tag, images.untyped_storage()))

    def poll(self) -> None:
        """Release the buffers of batches nothing refers to any more (our storage object is the only user)."""
        still = []
        for tag, storage in self.held:
            if storage_users(storage) <= 1:
                self._release(tag)
            else:
                still.append((tag, storage))
        self.held = still

    def _release(self, tag: tuple[int, int, int]) -> None:
        worker, slot, gen = tag
        self.released[worker, slot] = gen + 1
