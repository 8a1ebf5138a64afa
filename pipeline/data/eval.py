"""The eval pass: every validation sample exactly once across ranks, the same batch count on every rank.

dataset.json's per-shard counts number the samples 0..N-1 (sample k of a shard is its k-th
key group in the tar, with or without an image); rank r takes the contiguous range
[r N / w, (r+1) N / w); every rank runs ceil(ceil(N / w) / batch) batches, the last ones
padded, with `valid` marking real samples. A bad sample (no image, corrupt, no label) is an
invalid, counted slot: the numbering never shifts. Each worker reads a contiguous run of batches.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline.config import DataConfig
from pipeline.train.preemption import block_in_worker, reap_workers_at_exit

from . import tario
from .bad import Counters, merge_counters
from .index import Indexes
from .info import BadDataError, SplitInfo
from .transforms import BatchNormalizer, as_is, empty_batch, eval_transform


class EvalStream(IterableDataset):
    def __init__(self, split: SplitInfo, cfg: DataConfig, img_size: tuple[int, int], batch_size: int,
                 lo: int, hi: int, num_batches: int, num_classes: int, label_key: str, workers: int):
        super().__init__()
        self.shards, self.counts = list(split.shards), list(split.shard_counts)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self.cfg, self.img_size, self.batch_size = cfg, img_size, batch_size
        self.lo, self.hi, self.num_batches = lo, hi, num_batches
        self.num_classes, self.label_key = num_classes, label_key
        self.workers = max(1, workers)
        self.transform = eval_transform(cfg, img_size)
        self.normalize = BatchNormalizer(cfg.mean, cfg.std)

    def _sample(self, i: int, indexes: Indexes, counters: dict[str, Any]) -> tuple[Any, int]:
        """(uint8 tensor or None, label) of global index i."""
        s = int(np.searchsorted(self.starts, i, side="right")) - 1
        shard = self.shards[s]
        try:
            img, label = tario.decode(indexes.load(shard, i - int(self.starts[s])), self.label_key, self.num_classes,
                                      self.cfg.max_image_pixels)
        except tario.SampleError as e:
            counters.count_bad(e.kind, shard, str(e))
            counters.read += 1
            return None, 0
        counters.read += 1
        return self.transform(img), label

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        b0 = worker * self.num_batches // self.workers
        b1 = (worker + 1) * self.num_batches // self.workers
        B, counters = self.batch_size, Counters()
        indexes = Indexes(self.cfg.cache_dir, self.cfg.cache_limit_gb)
        try:
            for b in range(b0, b1):
                images = empty_batch((B, 3, *self.img_size), shared=info is not None)
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
                       "worker": worker}
        finally:
            indexes.close()


class EvalLoader:
    """One pass over this rank's share of the split: (images, targets, valid) batches, `len()` of them."""

    def __init__(self, stream: EvalStream, cfg: DataConfig, rank: int, pin_memory: bool | None = None):
        self.stream, self.cfg, self.rank = stream, cfg, rank
        self.num_workers = min(cfg.num_workers, stream.workers if stream.num_batches else 0)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._worker_counters: dict[int, dict[str, Any]] = {}
        self.last_ids: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.stream.num_batches

    @property
    def num_samples(self) -> int:
        """Real (unpadded) samples this rank visits."""
        return self.stream.hi - self.stream.lo

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        self._worker_counters = {}
        if self.stream.num_batches == 0:
            return
        reap_workers_at_exit()  # the workers block SIGTERM: an exit must not wait on them
        loader = DataLoader(self.stream, batch_size=None, collate_fn=as_is, num_workers=self.num_workers,
                            pin_memory=self.pin_memory,
                            prefetch_factor=self.cfg.prefetch_factor if self.num_workers > 0 else None,
                            generator=torch.Generator().manual_seed(0),
                            worker_init_fn=block_in_worker)  # a SIGTERM to the process group is the rank's
        for item in loader:
            self._worker_counters[item["worker"]] = item["counters"]
            msg = merge_counters(list(self._worker_counters.values())).bad_fraction_message(
                self.cfg.max_bad_fraction, f"rank {self.rank} (eval)")
            if msg is not None:
                raise BadDataError(msg)
            self.last_ids = torch.from_numpy(item["ids"])  # index in the split of each slot (padding: >= hi)
            yield item["images"], torch.from_numpy(item["targets"]), torch.from_numpy(item["valid"])

    def bad_counts(self) -> dict[str, int]:
        """Bad samples by kind in the current (or last) pass."""
        return dict(sorted(merge_counters(list(self._worker_counters.values())).bad.items()))
