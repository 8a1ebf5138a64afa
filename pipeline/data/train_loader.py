"""This rank's train loader: the main process's side of the train stream (stream.py builds the micro batches,
in DataLoader workers or here).

It starts the DataLoader (its workers in a fresh process each: pipeline/signals.py's context), checks that the
micro batches arrive in order j, j + 1, ... (what makes the order exact), hands them to the trainer (decoded on
the GPU with data.decode_device: cuda, the next one's decode ahead of the step: decode_ahead.py), returns the
workers' shared buffers (buffers.py), moves the shard copies ahead of the step (fetch.py), adds up the bad-data
counts, and holds the layout-free position: `state_dict` / `load_state_dict` (stream.py's docstring).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from pipeline.config import DataConfig
from pipeline.remote import RetryPolicy
from pipeline.signals import WorkerInit, reap_workers_at_exit, worker_context

from . import tario
from .bad import BadDataError, Counters, DataError
from .buffers import RING, Releaser
from .cache import needs_copy
from .decode_ahead import DecodeAhead, side_stream
from .fetch import FetchAhead
from .gpu_decode import GpuBatchDecoder, replace_bad
from .info import expected_of
from .mix import shards_fingerprint
from .stream import TrainStream
from .transforms import as_is, seeded

LOADER_STATE_VERSION = 3  # 2: the shuffle-window order before partitions


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
        self._started_at = 0  # the micro batch the DataLoader last started at
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
        self.stream.start = self._started_at = self._j
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

    @property
    def starting(self) -> bool:
        """Whether the next micro batch waits on the DataLoader's workers starting: the first batch of each worker
        (the round robin hands batch j to worker j % num_workers) after a start, the first one's and after
        `close` (which a seek to another position calls)."""
        return self._it is None or self._j < self._started_at + max(1, self.num_workers)

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
