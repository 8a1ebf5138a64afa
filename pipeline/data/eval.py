"""The eval pass: every validation sample exactly once across ranks, the same batch count on every rank.

dataset.json's per-shard counts number the samples 0..N-1 (sample k of a shard is its k-th
key group in the tar, with or without an image); rank r takes the contiguous range
[r N / w, (r+1) N / w); every rank runs ceil(ceil(N / w) / batch) batches, the last ones
padded, with `valid` marking real samples. A bad sample (no image, corrupt, no label) is an
invalid, counted slot: the numbering never shifts. Each worker reads a contiguous run of batches.
Whatever fails on one rank, its pass still yields every batch (see EvalLoader): the ranks stay in step.
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline.config import DataConfig
from pipeline.remote import RetryPolicy, StorageError
from pipeline.signals import WorkerInit, reap_workers_at_exit, worker_context

from . import tario
from .bad import BadDataError, Counters, merge_counters
from .info import SplitInfo, expected_of
from .mix import Labels
from .reader import Indexes
from .transforms import BatchNormalizer, as_is, empty_batch, eval_transform


class EvalStream(IterableDataset):
    def __init__(self, split: SplitInfo, cfg: DataConfig, img_size: tuple[int, int], batch_size: int,
                 lo: int, hi: int, num_batches: int, num_classes: int, label_key: str, workers: int,
                 labels: Labels | None = None):
        super().__init__()
        self.shards, self.counts = list(split.shards), list(split.shard_counts)
        self.split = split  # its sizes and digests: what a fetched copy is checked against
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self.cfg, self.img_size, self.batch_size = cfg, img_size, batch_size
        self.lo, self.hi, self.num_batches = lo, hi, num_batches
        self.batches = range(num_batches)  # the batches of this pass (a restarted pass: those not yet seen)
        self.num_classes, self.label_key = num_classes, label_key
        self.labels = labels or Labels.single(label_key, num_classes, len(self.shards))  # a mixture's: mix.py
        self.workers = max(1, workers)
        self.normalize = BatchNormalizer(cfg.mean, cfg.std)

    @functools.cached_property
    def transform(self) -> Any:
        """timm's eval transform, built in the workers that use it (see TrainStream.transform)."""
        return eval_transform(self.cfg, self.img_size)

    def _sample(self, i: int, indexes: Indexes, counters: dict[str, Any]) -> tuple[Any, int]:
        """(uint8 tensor or None, label) of global index i."""
        s = int(np.searchsorted(self.starts, i, side="right")) - 1
        shard = self.shards[s]
        try:
            img, label = self.labels.decode(indexes.load(shard, i - int(self.starts[s])), s, self.cfg.max_image_pixels)
        except tario.SampleError as e:
            counters.count_bad(e.kind, shard, str(e))
            counters.read += 1
            return None, 0
        counters.read += 1
        return self.transform(img), label

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        n = len(self.batches)
        mine = self.batches[worker * n // self.workers:(worker + 1) * n // self.workers]
        B, counters = self.batch_size, Counters()
        indexes = Indexes(self.cfg.cache_dir, self.cfg.cache_limit_gb, RetryPolicy.from_config(self.cfg),
                          expected_of(self.split))
        try:
            for b in mine:
                # Hold the cached copies of this batch's shards, release the rest (the cache may evict those).
                ends = self.lo + b * B, min(self.lo + (b + 1) * B, self.hi) - 1
                first, last = (int(np.searchsorted(self.starts, i, side="right")) - 1 for i in ends)
                indexes.keep_only(self.shards[first:last + 1])
                images = empty_batch((B, len(self.cfg.mean), *self.img_size), shared=info is not None)
                targets, valid = [], []
                for j in range(B):
                    i = self.lo + b * B + j
                    tensor, label = self._sample(i, indexes, counters) if i < self.hi else (None, 0)
                    if tensor is not None:
                        self.normalize(tensor, out=images[j])
                    else:
                        images[j].zero_()  # padding and bad samples, masked out by `valid`
                    targets.append(label)
                    valid.append(tensor is not None)
                yield {"images": images, "targets": np.asarray(targets, dtype=np.int64),  # arrays: see as_is
                       "ids": np.arange(self.lo + b * B, self.lo + (b + 1) * B, dtype=np.int64),
                       "valid": np.asarray(valid, dtype=bool), "counters": copy.deepcopy(counters),
                       "worker": worker, "batch": b}
        except StorageError as e:  # a shard that cannot be fetched: its one line, not a worker's traceback
            yield {"error": str(e)}
        finally:
            indexes.close()


class EvalFailed(BadDataError):
    """The evaluation failed on some rank; raised on every rank at the same point (said once, by rank 0)."""


def worker_lost(e: BaseException) -> bool:
    """A DataLoader worker died: torch noticed ("DataLoader worker (pid(s) ...) exited unexpectedly"), or
    the rank was taking a batch's shared memory from the worker as it died (the fd handover's socket)."""
    return isinstance(e, (ConnectionError, EOFError)) or (isinstance(e, RuntimeError) and "DataLoader worker" in str(e))


WORKER_RESTARTS = 2  # per pass: a worker killed once (the OOM killer, an operator) is not worth a failed run


class EvalLoader:
    """One pass over this rank's share of the split: (images, targets, valid) batches, `len()` of them.

    Every pass yields exactly `len()` batches, whatever happens on this rank: the ranks' forward passes
    are collective under ZeRO-3, and a rank that stopped early would leave its peers waiting. Workers
    that die are started again for the batches not yet seen (up to WORKER_RESTARTS times); a failure
    that remains (too many bad samples, workers that keep dying) pads the rest of the pass with invalid
    batches and is kept in `failure`. After the pass, `raise_if_any_failed` (collective) makes every
    rank raise it together."""

    def __init__(self, stream: EvalStream, cfg: DataConfig, rank: int, pin_memory: bool | None = None):
        self.stream, self.cfg, self.rank = stream, cfg, rank
        self.num_workers = min(cfg.num_workers, stream.workers if stream.num_batches else 0)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._worker_counters: dict[int, dict[str, Any]] = {}
        self._earlier = Counters()  # bad samples counted by the workers of a pass's earlier, failed start
        self.last_ids: torch.Tensor | None = None
        self.failure: str | None = None
        self.progress: Callable[[], None] = lambda: None  # called at every batch (the trainer's watchdog)
        self.starting: Callable[[], None] = lambda: None  # called as its workers start (the watchdog's allowance)

    def __len__(self) -> int:
        return self.stream.num_batches

    @property
    def num_samples(self) -> int:
        """Real (unpadded) samples this rank visits."""
        return self.stream.hi - self.stream.lo

    def _loader(self, batches: list[int]) -> DataLoader:
        self.stream.batches = batches
        reap_workers_at_exit()  # the workers block SIGTERM: an exit must not wait on them
        return DataLoader(self.stream, batch_size=None, collate_fn=as_is, num_workers=self.num_workers,
                          pin_memory=self.pin_memory,
                          prefetch_factor=self.cfg.prefetch_factor if self.num_workers > 0 else None,
                          generator=torch.Generator().manual_seed(0),
                          multiprocessing_context=worker_context() if self.num_workers > 0 else None,
                          worker_init_fn=WorkerInit("eval"))  # a SIGTERM to the process group is the rank's

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        self._worker_counters, self._earlier, self.failure = {}, Counters(), None
        todo, restarts = list(range(self.stream.num_batches)), 0
        while todo and self.failure is None:
            seen: set[int] = set()
            try:
                self.starting()  # the workers start (fresh processes) before the first batch
                for item in self._loader(todo):
                    if "error" in item:
                        raise BadDataError(item["error"])
                    self._worker_counters[item["worker"]] = item["counters"]
                    msg = self._counters().bad_fraction_message(self.cfg.max_bad_fraction, f"rank {self.rank} (eval)")
                    if msg is not None:
                        raise BadDataError(msg)
                    self.progress()
                    self.last_ids = torch.from_numpy(item["ids"])  # index in the split of each slot (padding: >= hi)
                    yield item["images"], torch.from_numpy(item["targets"]), torch.from_numpy(item["valid"])
                    seen.add(item["batch"])
            except BadDataError as e:
                self.failure = str(e)
            except (RuntimeError, ConnectionError, EOFError) as e:
                if not worker_lost(e):
                    raise
                self._earlier, self._worker_counters = self._counters(), {}
                restarts += 1
                if restarts > WORKER_RESTARTS:
                    # One wording whichever way torch saw the death (its own RuntimeError, or the fd socket's reset).
                    self.failure = (f"rank {self.rank} (eval): a DataLoader worker died {restarts} times in one pass "
                                    f"(the last: {e})")
                else:
                    print(f"warning: rank {self.rank} (eval): a DataLoader worker died ({e}); starting the workers "
                          f"again for the {len(todo) - len(seen)} batches not yet seen", file=sys.stderr, flush=True)
            todo = [b for b in todo if b not in seen]
        for b in todo:  # only after a failure: the rest of the pass, invalid, so that the count stays len()
            B = self.stream.batch_size
            self.progress()
            self.last_ids = torch.arange(self.stream.lo + b * B, self.stream.lo + (b + 1) * B)
            yield (torch.zeros(B, 3, *self.stream.img_size), torch.zeros(B, dtype=torch.int64),
                   torch.zeros(B, dtype=torch.bool))

    def _counters(self) -> Counters:
        return merge_counters([self._earlier, *self._worker_counters.values()])

    def bad_counts(self) -> dict[str, int]:
        """Bad samples by kind in the current (or last) pass."""
        return dict(sorted(self._counters().bad.items()))


def raise_if_any_failed(*loaders: EvalLoader | None) -> None:
    """Collective, after a pass over each loader: if one failed on any rank, every rank raises EvalFailed
    with that rank's message (so that all leave at the same point, and none waits in a collective)."""
    mine = next((f for f in (x.failure for x in loaders if x is not None) if f), None)
    failures = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, mine)
    first = next((f for f in failures if f), None)
    if first is not None:
        raise EvalFailed(first)
