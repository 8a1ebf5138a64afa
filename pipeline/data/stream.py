"""The train stream: elastic, deterministic, resumable on any layout.

Rank r's j-th micro batch holds the samples at global positions
`order.micro_batch_positions(j, r, W, m, A)` (step j // A), whatever the number of DataLoader
workers: worker k of nw builds micro batches j = j0 + k, j0 + k + nw, ..., which is the order
in which the DataLoader hands batches back (round robin), so the main process gets
j0, j0 + 1, ... Workers keep no position of their own: a micro batch is a pure function of
(seed, data set, global batch, partitions, shuffle span, j, layout), its samples and augmentation
of their positions (order.py: which sample a position holds).

- Augmentation of the sample at position p: seeded from (seed, p) (`GlobalOrder.augment_seed`),
  the same on any layout and worker.
- Mixup/CutMix of a micro batch: seeded from (seed, p0 // m), p0 its first position: the same
  draws whenever the micro batch size is the same.
- A bad sample (corrupt image, missing label or image, duplicate member, truncated or
  unreadable shard) is counted by kind and replaced by the first good sample among the next
  draws of its partition, augmented with the bad position's seed: positions never shift, batch
  shapes stay static, the replacement is the same on every layout and comes from the shards of
  the node that reads the bad one.

State (`TrainLoader.state_dict`): the global position (samples consumed, a multiple of the
global batch), bad-data counts, and the fingerprint of what the order depends on.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Callable, Iterator
from itertools import count
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from pipeline.config import DataConfig
from pipeline.remote import RetryPolicy, StorageError

from . import tario
from .bad import BadDataError, Counters, DataError
from .buffers import BatchRing
from .gpu_decode import CropDraw, open_lazy, pack_batch
from .info import SplitInfo, expected_of
from .mix import Labels, MixHistory, Mixture
from .order import MIXUP, GlobalOrder, micro_batch_positions, seed_for
from .reader import Indexes
from .transforms import BatchNormalizer, build_mixup, empty_batch, seeded, train_transform

MAX_REPLACEMENT_SEARCH = 100_000


class TrainStream(IterableDataset):
    """Runs in each DataLoader worker (or the main process): yields this rank's micro batches."""

    def __init__(self, split: SplitInfo, cfg: DataConfig, img_size: tuple[int, int], micro: int, accum: int,
                 seed: int, rank: int, world_size: int, num_classes: int, label_key: str, ids_only: bool = False,
                 per_batch: Callable[[range], np.ndarray] | None = None,
                 view: Callable[[Any, int, int], tuple[torch.Tensor, ...]] | None = None,
                 labels: Labels | None = None, mixture: Mixture | None = None):
        super().__init__()
        # An objective's own view of a sample in place of the train transform (DINOv2's multi-crop):
        # (image, the position's augmentation seed) -> normalised float tensors, stacked per micro batch.
        self.view = view
        if view is not None and cfg.decode_device == "cuda":
            raise DataError("data.decode_device 'cuda' decodes one crop per image on the device; this objective "
                            "makes its own views of each sample in the loader workers: use data.decode_device=cpu")
        # An array computed from each micro batch's global positions where the batch is built (a
        # DataLoader worker), not on the training thread: MAE's per-sample mask noise.
        self.per_batch = per_batch
        self.shards, self.counts = list(split.shards), list(split.shard_counts)
        self.shard_bytes = list(split.shard_bytes or [None] * len(self.shards))
        self.shard_sha256 = list(split.shard_sha256 or [None] * len(self.shards))
        # data.sources: the mixture's order (mix_order.py), rebuilt from a checkpoint's history on resume
        self.history = (MixHistory(mixture, seed, micro * accum * world_size, cfg.shuffle_span)
                        if mixture is not None else None)
        self.order = (self.history.order() if self.history is not None else
                      GlobalOrder(self.counts, seed, micro * accum * world_size, cfg.partitions, cfg.shuffle_span))
        # where each shard's labels are and which of the run's classes each is (one source: as written)
        self.labels = labels or Labels.single(label_key, num_classes, len(self.shards))
        self.cfg, self.img_size, self.seed = cfg, img_size, seed
        self.micro, self.accum, self.rank, self.world_size = micro, accum, rank, world_size
        self.num_classes, self.label_key, self.ids_only = num_classes, label_key, ids_only
        self.normalize = BatchNormalizer(cfg.mean, cfg.std)
        self.mixup = build_mixup(cfg, num_classes, micro)
        self.gpu_decode = cfg.decode_device == "cuda"  # workers draw crops; TrainLoader.to_device decodes
        self.draw = CropDraw(self.transform) if self.gpu_decode else None
        self.start = 0  # first micro batch (of this rank) to build; set by TrainLoader before each start
        self.released: torch.Tensor | None = None  # set by TrainLoader before each start: see buffers.py
        self._ring: BatchRing | None = None
        self._indexes: Indexes | None = None
        # One retry budget per shard for this rank's readers and its fetch-ahead process (cache.hold_copy);
        # made here, in the rank, and pickled with the stream to its workers. A new run makes a new key.
        self.budget_key = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"

    @functools.cached_property
    def transform(self) -> Any:
        """timm's train transform, built where it is first used: in the loader workers, whose fork server has
        timm imported, so that the rank itself never imports timm and torchvision (2.5 s of CPU per rank)."""
        return train_transform(self.cfg, self.img_size)

    def positions(self, j: int) -> range:
        return micro_batch_positions(j, self.rank, self.world_size, self.micro, self.accum)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        k, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        self._ring = BatchRing(k, self.released) if info is not None and self.released is not None else None
        for use, j in enumerate(count(self.start + k, nw)):
            try:
                yield self.micro_batch(j, in_worker=info is not None, use=use)
            except (BadDataError, StorageError) as e:  # a shard that cannot be fetched stops the run too
                yield {"error": str(e), "j": j}
                return

    def micro_batch(self, j: int, in_worker: bool, use: int = 0) -> dict[str, Any]:
        """This rank's micro batch j; `use`: the how-many-th batch of this worker (which buffer it reuses)."""
        positions = self.positions(j)
        ids = self.order.sample_ids(positions).tolist()
        # ids and targets travel as NumPy arrays, only the images as a (shared-memory) tensor: see as_is.
        out: dict[str, Any] = {"j": j, "ids": np.asarray(ids, dtype=np.int64)}
        if self.ids_only:
            return out
        if self.per_batch is not None:
            out["per_batch"] = self.per_batch(positions)
        if self._indexes is None:
            self._indexes = Indexes(self.cfg.cache_dir, self.cfg.cache_limit_gb, RetryPolicy.from_config(self.cfg),
                                    expected_of(self), self.budget_key)
        # Hold the cached copies of this micro batch's shards, release the rest: the cache may evict those.
        self._indexes.keep_only(self.shards[s] for s in self.order.shard_of(np.asarray(ids)).tolist())
        counters = Counters()
        bytes0, index_bytes0 = self._indexes.bytes_read, self._indexes.index_bytes_read
        items: list[Any] = [self._sample(p, sid, counters, restore=not in_worker) for p, sid in zip(positions, ids)]
        counters.read += len(items)
        items = [x if x is not None else self._replacement(p, counters, not in_worker)
                 for p, x in zip(positions, items)]
        counters.bytes = self._indexes.bytes_read - bytes0
        counters.index_bytes = self._indexes.index_bytes_read - index_bytes0
        targets = torch.tensor([label for _, label in items], dtype=torch.long)
        mix_seed = seed_for(MIXUP, self.seed, positions[0] // self.micro)
        if self.view is not None:  # one tensor per part of the view, each (micro, ...): no Mixup, no ring buffers
            images = tuple(torch.stack(part) for part in zip(*(views for views, _ in items)))
            return {**out, "images": images, "targets": targets.numpy(), "counters": counters}
        if self.draw is not None:  # raw bytes + boxes; decoded and mixed up by TrainLoader.to_device
            return {**out, "images": pack_batch([t for t, _ in items], mix_seed), "targets": targets.numpy(),
                    "counters": counters}
        shape = (len(items), len(self.cfg.mean), *self.img_size)  # the set's channels (pixels.resolve_data)
        if self._ring is not None and in_worker:
            images, out["buffer"] = self._ring.take(use, shape)
        else:
            images = empty_batch(shape, shared=in_worker)
        for i, (tensor, _) in enumerate(items):
            self.normalize(tensor, out=images[i])  # uint8 -> normalised float32
        if self.mixup is not None:
            with seeded(mix_seed, restore=not in_worker):
                images, targets = self.mixup(images, targets)
        return {**out, "images": images, "targets": targets.numpy(), "counters": counters}

    def _replacement(self, position: int, counters: dict[str, Any], restore: bool) -> Any:
        """The first good sample after a bad `position` among its partition slice's next draws, augmented
        as `position`'s would have been: a function of the position only, so the same on every layout, and
        read from the same slice, so from the same node's shards."""
        scratch = Counters()  # those bad samples are counted at their own positions
        p, d = (int(x[0]) for x in self.order.draws(np.asarray([position])))
        for q in range(d + 1, d + 1 + MAX_REPLACEMENT_SEARCH):
            sid = int(self.order.draw_ids(np.asarray([p]), np.asarray([q]))[0])
            item = self._sample(position, sid, scratch, restore)
            if item is not None:
                return item
        shard = max(counters.bad_shards.items(), key=lambda kv: kv[1])[0]
        raise BadDataError(f"no good sample in the {MAX_REPLACEMENT_SEARCH} draws of partition slice {p} after bad "
                           f"position {position} (shard '{shard}': {counters.causes.get(shard, '')})")

    def _sample(self, position: int, sid: int, counters: dict[str, Any], restore: bool) -> Any:
        """(augmented uint8 tensor, label) of one position, or None (counted) if it is bad."""
        shard_no, local = self.order.locate(sid)
        shard = self.shards[shard_no]
        try:
            raw = self._indexes.load(shard, local)
            counters.sample_bytes += sum(len(b) for b in raw.members.values())
            if self.draw is not None:
                _, data = tario.image_member(raw)
                label = self.labels.parse(raw, shard_no)
                img = open_lazy(data, self.cfg.max_image_pixels)
            else:
                img, label = self.labels.decode(raw, shard_no, self.cfg.max_image_pixels)
        except tario.SampleError as e:
            counters.count_bad(e.kind, shard, str(e))
            return None
        seed = self.order.augment_seed(position)
        transform = self.transform if self.view is None else None  # built (once) outside the seeded draws
        with seeded(seed, restore):
            if self.view is not None:  # with the sample's step: a draw for every sample of a step (DINOv3's sizes)
                return self.view(img, seed, position // (self.micro * self.accum * self.world_size)), label
            if self.draw is not None:  # same RNG calls as self.transform: the same box and flip
                box, flip = self.draw(img)
                return (data, box, flip, shard_no), label
            return transform(img), label
