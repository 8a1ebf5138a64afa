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
import weakref
from collections.abc import Callable, Iterator
from itertools import count
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline.config import DataConfig
from pipeline.remote import RetryPolicy, StorageError
from pipeline.signals import WorkerInit, reap_workers_at_exit, worker_context

from . import tario
from .bad import BadDataError, Counters, DataError
from .buffers import RING, BatchRing, Releaser
from .cache import needs_copy
from .decode_ahead import DecodeAhead, side_stream
from .fetch import FetchAhead
from .gpu_decode import CropDraw, GpuBatchDecoder, open_lazy, pack_batch, replace_bad
from .info import SplitInfo, expected_of
from .mix import Labels, MixHistory, Mixture, shards_fingerprint
from .order import MIXUP, GlobalOrder, micro_batch_positions, seed_for
from .reader import Indexes
from .transforms import BatchNormalizer, as_is, build_mixup, empty_batch, seeded, train_transform

LOADER_STATE_VERSION = 3  # 2: the shuffle-window order before partitions
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


class TrainLoader:
    """Infinite iterator of this rank's micro batches (images [m, 3, H, W] float32, targets).

    `accum` micro batches make one optimizer step; `state_dict()` / `load_state_dict()` hold the
    layout-free position (see the module docstring).
    """

    def __init__(self, stream: TrainStream, cfg: DataConfig, global_batch: int, pin_memory: bool | None = None,
                 local_ranks: int = 1):
        self.stream, self.cfg = stream, cfg
        self.local_ranks = local_ranks  # ranks on this node: they share its cache
        self.fetcher: FetchAhead | None = None
        self.global_batch = global_batch
        self.accum = stream.accum
        self.num_workers = cfg.num_workers
        self.soft_targets = stream.mixup is not None
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._j = 0  # micro batches handed out by this rank since position 0
        self._it: Iterator[dict[str, Any]] | None = None
        self._counters = Counters()  # this rank's, plus (rank 0) the counts restored from a checkpoint
        self._releaser: Releaser | None = None  # the workers' batch buffers still in use here (buffers.py)
        self.last_ids: torch.Tensor | None = None
        self.last_positions: range | None = None
        self.last_per_batch: torch.Tensor | None = None  # stream.per_batch of the last micro batch
        self.decoder = (GpuBatchDecoder(stream.img_size, cfg.mean, cfg.std, cfg.interpolation)
                        if stream.gpu_decode else None)
        # Where the next micro batch's decode starts as this one is handed out (the trainer's, decode_ahead.py).
        self.decode_ahead_on: torch.device | None = None
        self._ahead, self._side = None, None  # that micro batch (taken, not handed out); its side stream
        self.mix_change: dict[str, Any] | None = None  # what a resume changed in the mix (data.allow_mix_change)
        self.recheck: Callable[[Any], None] | None = None  # the cache check, again for a resumed mixture's order

    def _start(self) -> None:
        self.stream.start = self._j
        if self.fetcher is None and self.cfg.fetch_ahead and not self.stream.ids_only and any(
                needs_copy(s) for s in self.stream.shards):
            self.fetcher = FetchAhead(self.stream.order, self.stream.shards, self.stream.shard_bytes,
                                      self.stream.rank, self.stream.world_size, self.cfg.cache_dir,
                                      int(self.cfg.cache_limit_gb * 2**30),
                                      int(self.cfg.cache_limit_gb * 2**30) // self.local_ranks,
                                      expected_of(self.stream), RetryPolicy.from_config(self.cfg),
                                      self.stream.budget_key)
            weakref.finalize(self, self.fetcher.stop)
        if self.fetcher is not None:
            self.fetcher.advance(self._j // self.accum)
        reap_workers_at_exit()  # the workers block SIGTERM: an exit must not wait on them
        self._releaser = None
        self.stream.released = None
        if self.num_workers > 0 and not self.stream.ids_only and not self.stream.gpu_decode:
            self._releaser = Releaser(torch.zeros((self.num_workers, RING), dtype=torch.int64).share_memory_())
            self.stream.released = self._releaser.released  # travels to the workers with the stream
        loader = DataLoader(
            self.stream, batch_size=None, collate_fn=as_is,  # arrays stay arrays (see as_is)
            num_workers=self.num_workers, pin_memory=self.pin_memory,
            prefetch_factor=self.cfg.prefetch_factor if self.num_workers > 0 else None,
            generator=torch.Generator().manual_seed(self.stream.seed),  # leave the global torch RNG alone
            multiprocessing_context=worker_context() if self.num_workers > 0 else None,  # no fork of the rank
            worker_init_fn=WorkerInit("train"),  # a SIGTERM to the process group is the rank's to handle
        )
        self._it = iter(loader)

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> tuple[Any, torch.Tensor]:
        if self._it is None:
            self._start()
        assert self._it is not None
        if self._releaser is not None:
            self._releaser.poll()  # before the next batch: the caller may have let go of the last one
        item, self._ahead = (self._ahead, None) if self._ahead is not None else (next(self._it), None)
        if "error" in item:
            self.close()
            raise BadDataError(item["error"])
        if item["j"] != self._j:  # the DataLoader's round robin is what makes the order exact
            raise RuntimeError(f"micro batch {item['j']} arrived, expected {self._j}")
        self._j += 1
        if self.fetcher is not None and self._j % self.accum == 0:
            self.fetcher.advance(self._j // self.accum)
        self.last_ids = torch.from_numpy(item["ids"])
        self.last_positions = self.stream.positions(item["j"])  # global positions of this micro batch
        self.last_per_batch = torch.from_numpy(item["per_batch"]) if "per_batch" in item else None
        if self.stream.ids_only:
            return self.last_ids, self.last_ids
        self._add(item["counters"])
        if self._releaser is not None and "buffer" in item:
            # pinned: the DataLoader's pin thread made a copy, the shared buffer is free already
            self._releaser.handed_out(item["buffer"], item["images"], copied=self.pin_memory)
        if self.decode_ahead_on is not None and self.decoder is not None:
            self._take_ahead()
        return item["images"], torch.from_numpy(item["targets"])

    def _take_ahead(self) -> None:
        """Take the next raw micro batch from the workers and start its device decode (decode_ahead.py)."""
        self._ahead = next(self._it)
        self._side = self._side or side_stream(self.decode_ahead_on)
        if "error" not in self._ahead:
            self._ahead["images"]["decoded"] = DecodeAhead(self.decoder, self._ahead["images"], self.decode_ahead_on,
                                                           self._side)

    def _add(self, counters: Counters) -> None:
        self._counters = self._counters + counters
        msg = self._counters.bad_fraction_message(self.cfg.max_bad_fraction, f"rank {self.stream.rank}")
        if msg is not None:
            self.close()
            raise BadDataError(msg)

    def to_device(self, images: Any, targets: torch.Tensor, device: torch.device | str,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch from `next()` on `device`: a copy, or with decode_device=cuda the decode, crop,
        resize, flip, normalisation (and Mixup/CutMix) of the raw JPEG batch there. An objective's view
        (a tuple of tensors) is copied part by part, its floating parts in `dtype` (masks stay boolean)."""
        if isinstance(images, tuple):
            return (tuple(x.to(device, dtype if x.is_floating_point() else x.dtype, non_blocking=True) for x in images),
                    targets.to(device, non_blocking=True))
        if self.decoder is None:
            return images.to(device, dtype, non_blocking=True), targets.to(device, non_blocking=True)
        ahead = images.get("decoded")  # started on a side stream when the batch before was handed out
        out, bad = ahead.wait() if ahead is not None else self.decoder(images, device)
        targets = targets.to(device, non_blocking=True)
        if bad:
            extra = Counters()
            shards = images["shards"].tolist()
            for k in bad:
                extra.count_bad(tario.CORRUPT_IMAGE, self.stream.shards[shards[k]], "decode failed on the device")
            replace_bad(out, targets, bad)
            self._add(extra)
        if self.stream.mixup is not None:
            with seeded(int(images["mixup_seed"]), restore=True):
                out, targets = self.stream.mixup(out, targets)
        return out.to(dtype), targets

    def close(self) -> None:
        """Stop the worker processes (they restart on the next batch); a batch taken ahead is dropped."""
        self._it, self._ahead = None, None

    def seek_step(self, step: int) -> None:
        """Continue at the first micro batch of optimizer step `step`. A no-op when already there; after
        the trainer took an extra micro batch (one skipped for a non-finite loss) it restarts the workers,
        so that step `step` still gets its own samples and the saved position is `step x global batch`."""
        j = step * self.accum
        if j != self._j:
            self.close()
            self._j = j

    # position and counts --------------------------------------------------------------------

    @property
    def position(self) -> int:
        """Global samples consumed at the last step boundary handed out."""
        return self._j // self.accum * self.global_batch

    def fingerprint(self) -> dict[str, Any]:
        s = self.stream
        if s.history is not None:  # a mixture: its sources' own fingerprints are in its history (mix.py)
            return {"seed": s.seed, "global_batch_size": self.global_batch, "shuffle_span": s.order.span}
        return {"seed": s.seed, "global_batch_size": self.global_batch, "partitions": s.order.partitions,
                "slices": s.order.slices_per_partition, "shuffle_span": s.order.span,
                **shards_fingerprint(s.shards, s.counts, s.shard_sha256)}

    def counters(self) -> Counters:
        """This rank's bad-data counters (sum them across ranks, `+` or `merge_counters`, for the state)."""
        return self._counters + Counters()  # a copy

    def state_dict(self, counters: Counters | None = None) -> dict[str, Any]:
        """The layout-free state at the last step boundary; `counters`: all ranks' counts, summed."""
        counters = counters if counters is not None else self.counters()
        # The position alone: the epoch and the index in it follow from it and num_samples (stored once).
        mix = {"mix": self.stream.history.state()} if self.stream.history is not None else {}
        return {"version": LOADER_STATE_VERSION, "position": self.position, "counters": counters.to_state(),
                **self.fingerprint(), **mix}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at `state`'s position, on any layout that makes the same global batch."""
        version = state.get("version") if isinstance(state, dict) else 1  # version 1: a list, one per rank
        if version != LOADER_STATE_VERSION:
            why = ("the sample order changed to partitions of shards" if version == 2 else
                   "a checkpoint from before the elastic loader")
            raise DataError(f"data loader state has version {version}, expected {LOADER_STATE_VERSION} ({why}: the "
                            f"checkpoint's position means other samples now); use a new run.dir")
        if ("mix" in state) != (self.stream.history is not None):
            raise DataError("cannot continue the data stream: the checkpoint was written from " + (
                "data.sources (a mixture) and this run reads data.path" if "mix" in state else
                "data.path (one data set) and this run mixes data.sources") + "; use a new run.dir")
        state = {"slices": 1, **state} if "mix" not in state else state  # from before slices: one per partition
        diff = {k: (state.get(k), v) for k, v in self.fingerprint().items() if state.get(k) != v}
        if list(diff) == ["shard_content"]:
            raise DataError("cannot continue the data stream: the shards were rewritten since the checkpoint (the "
                            "sha256 digests in dataset.json differ; same names and counts, other bytes), so its "
                            "position would mean other samples; restore the shards or use a new run.dir")
        if diff:
            what = ", ".join(f"{k}: {a} (checkpoint) vs {b}" for k, (a, b) in diff.items())
            raise DataError(f"cannot continue the data stream: the order depends on what changed ({what}); "
                            f"use a new run.dir or the checkpoint's settings")
        self.close()
        step = int(state["position"]) // self.global_batch
        if self.stream.history is not None:  # the same mix exactly, or a change the config allows (mix.py)
            self.mix_change = self.stream.history.restore(state["mix"], step, self.cfg.allow_mix_change)
            self.stream.order = self.stream.history.order()
            if self.recheck is not None:
                self.recheck(self.stream.order)
        self._j = step * self.accum
        # Counts are global: rank 0 carries them on, so that their sum over ranks stays right.
        self._counters = Counters.from_state(state["counters"]) if self.stream.rank == 0 else Counters()

    def source_metrics(self) -> dict[str, float]:
        """A mixture's figures per source at the last step boundary, data/<name>/...: samples drawn, passes
        every slice of it completed, its share of all samples drawn so far (the realised weight), and the bad
        samples this rank read from it (rank 0: plus those restored). {} for one data set."""
        s = self.stream
        if s.history is None:
            return {}
        figures = s.order.source_figures(self._j // self.accum)
        total = max(1, sum(seen for seen, _ in figures.values()))
        source_of = {shard: s.order.names[i] for shard, i in zip(s.shards, s.order.source_of_shard.tolist())}
        bad = dict.fromkeys(figures, 0)
        for shard, n in self._counters.bad_shards.items():
            if shard in source_of:
                bad[source_of[shard]] += n
        out = {}
        for name, (seen, epochs) in figures.items():
            out.update({f"data/{name}/samples_seen": float(seen), f"data/{name}/epochs_completed": float(epochs),
                        f"data/{name}/share": seen / total, f"data/{name}/bad_samples": float(bad[name])})
        return out

    def bad_counts(self) -> dict[str, int]:
        """Samples replaced, by kind, cumulative for this rank (rank 0: plus those restored)."""
        return dict(sorted(self._counters.bad.items()))

    def samples_read(self) -> int:
        return self._counters.read

    def bytes_read(self) -> int:
        """Bytes read from shard files by this rank's workers (tar headers and member data)."""
        return self._counters.bytes

    def index_bytes_read(self) -> int:
        """Bytes read from shard index files by this rank's workers (headers once per shard, a record per sample)."""
        return self._counters.index_bytes

    def read_amplification(self) -> float:
        """Bytes read from the shards per byte of the samples handed out (1.0: nothing read twice)."""
        return self._counters.bytes / max(1, self._counters.sample_bytes)
