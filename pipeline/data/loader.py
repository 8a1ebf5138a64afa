"""The train stream and the eval pass over WebDataset shards.

Train stream (`build_train_loader`): infinite, deterministic, resumable.

- Readers: every (rank, DataLoader worker) pair is one reader, g = rank x workers + worker of
  W = world_size x workers. Epoch e shuffles the shard list with (seed, e); reader g takes
  shards g, g+W, g+2W, ... of that order. With fewer shards than readers every reader reads
  every shard and keeps every W-th sample (split at sample level; a warning says so).
- Shuffle: a reader cuts its sample sequence into blocks of `data.shuffle_buffer` raw
  (undecoded) samples and emits each block in a permutation seeded by (seed, epoch, g, block).
- Position: (epoch, block, where the block starts: shard, sample index, byte offset, and how
  many samples of the block were emitted). Each batch carries its reader's position and bad
  data counts back to the main process; `state_dict()` is the position after the last batch
  handed out. Resume seeks to the block's byte offset, re-reads that one block without
  decoding, and skips the emitted samples. Augmentation is seeded per sample from
  (seed, epoch, g, block, i), Mixup per batch, so the resumed stream is tensor-for-tensor equal.
- Every rank yields batches forever: no rank runs out before another.
- `data.decode_device: cuda`: workers read headers and draw crops only; batches hold raw bytes,
  and `TrainLoader.to_device` decodes them on the device (see gpu_decode.py). The trainer calls
  `to_device` in both modes.

Eval pass (`build_eval_loader`): dataset.json's per-shard counts number the samples 0..N-1;
rank r takes the contiguous range [r N / w, (r+1) N / w); every rank runs
ceil(ceil(N / w) / batch) batches, the last ones padded, with `valid` marking real samples.
Each worker reads a contiguous run of those batches.

Bad data (corrupt image, missing or non-integer label, truncated tar, unreadable shard) is
skipped (train) or marked invalid (eval), and counted by kind; past `data.max_bad_fraction`
of the samples read (after 100) `BadDataError` names the shard with the most bad samples.
"""

from __future__ import annotations

import copy
import hashlib
import warnings
from collections.abc import Iterator
from itertools import islice
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline.config import DataConfig, image_size

from . import tario
from .gpu_decode import CropDraw, GpuBatchDecoder, open_lazy, pack_batch, replace_bad
from .info import BadDataError, DataError, DatasetInfo, SplitInfo, read_dataset_info
from .transforms import (
    BatchNormalizer,
    build_mixup,
    empty_batch,
    eval_transform,
    sample_seed,
    seeded,
    train_transform,
)

MIN_SAMPLES_FOR_BAD_CHECK = 100
STATE_VERSION = 1


# ----------------------------------------------------------------------------- bad data bookkeeping


def _new_counters() -> dict[str, Any]:
    return {"bad": {}, "bad_shards": {}, "read": 0, "bad_samples": 0}


def _count_bad(counters: dict[str, Any], kind: str, shard: str, samples: int = 1) -> None:
    counters["bad"][kind] = counters["bad"].get(kind, 0) + samples  # samples lost, not events
    counters["bad_shards"][shard] = counters["bad_shards"].get(shard, 0) + samples
    counters["bad_samples"] += samples
    counters["read"] += samples


def _merge_counters(parts: list[dict[str, Any]]) -> dict[str, Any]:
    total = _new_counters()
    for c in parts:
        for k, v in c["bad"].items():
            total["bad"][k] = total["bad"].get(k, 0) + v
        for k, v in c["bad_shards"].items():
            total["bad_shards"][k] = total["bad_shards"].get(k, 0) + v
        total["read"] += c["read"]
        total["bad_samples"] += c["bad_samples"]
    return total


def bad_fraction_message(counters: dict[str, Any], max_fraction: float, who: str) -> str | None:
    """The error text when more than `max_fraction` of the samples read were bad, else None."""
    read, bad = counters["read"], counters["bad_samples"]
    if read < MIN_SAMPLES_FOR_BAD_CHECK or bad <= max_fraction * read:
        return None
    shard, n = max(counters["bad_shards"].items(), key=lambda kv: kv[1])
    kinds = ", ".join(f"{k}={v}" for k, v in sorted(counters["bad"].items()))
    return (f"{bad} of {read} samples read by {who} were bad ({100 * bad / read:.1f}% > "
            f"data.max_bad_fraction={max_fraction}); most in shard '{shard}' ({n} bad samples); "
            f"by kind: {kinds}")


def _decode(raw: tario.RawSample, label_key: str, num_classes: int | None) -> tuple[Any, int]:
    """(PIL image, label) or SampleError; the label is checked before the (costly) decode."""
    _, data = tario.image_member(raw)
    label = tario.parse_label(raw, label_key, num_classes)
    return tario.decode_image(data), label


def _header(raw: tario.RawSample, label_key: str, num_classes: int | None) -> tuple[bytes, Any, int]:
    """decode_device=cuda: (bytes, header-only PIL image, label) or SampleError; no pixels decoded."""
    _, data = tario.image_member(raw)
    label = tario.parse_label(raw, label_key, num_classes)
    return data, open_lazy(data), label


# ----------------------------------------------------------------------------- train stream


def _initial_worker_state() -> dict[str, Any]:
    return {"epoch": 0, "block": 0, "plan_pos": 0, "index": 0, "offset": 0, "counter": 0, "k": 0,
            "batches": 0, **_new_counters()}


class TrainStream(IterableDataset):
    """Runs inside each DataLoader worker: yields collated batches with the reader's state."""

    def __init__(self, split: SplitInfo, cfg: DataConfig, img_size: tuple[int, int], batch_size: int,
                 seed: int, rank: int, world_size: int, num_classes: int, label_key: str):
        super().__init__()
        self.shards = list(split.shards)
        self.counts = list(split.shard_counts)
        self.cfg = cfg
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.workers = max(1, cfg.num_workers)
        self.readers = world_size * self.workers
        self.num_classes = num_classes
        self.label_key = label_key
        self.block_size = max(1, cfg.shuffle_buffer)
        self.img_size = img_size
        self.transform = train_transform(cfg, img_size)
        self.normalize = BatchNormalizer(cfg.mean, cfg.std)
        self.mixup = build_mixup(cfg, num_classes, batch_size)
        self.sample_level = len(self.shards) < self.readers
        self.worker_states = [_initial_worker_state() for _ in range(self.workers)]
        self.rotation = 0  # DataLoader worker i plays logical reader (i + rotation) % workers
        self.gpu_decode = cfg.decode_device == "cuda"  # workers draw crops; TrainLoader.to_device decodes
        self.draw = CropDraw(self.transform) if self.gpu_decode else None
        self.shard_index = {sh: i for i, sh in enumerate(self.shards)}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker = (info.id if info is not None else 0)
        logical = (worker + self.rotation) % self.workers
        reader = _TrainReader(self, logical, in_main_process=info is None)
        yield from reader.batches()

    def plan(self, epoch: int, reader: int) -> list[int]:
        """Shard indices `reader` reads in `epoch`: every W-th of an order all readers agree on
        (all of them when splitting at sample level)."""
        order = np.random.default_rng([self.seed, epoch, 0x5A4D]).permutation(len(self.shards)).tolist()
        return order if self.sample_level else order[reader::self.readers]


class _TrainReader:
    def __init__(self, stream: TrainStream, logical: int, in_main_process: bool):
        self.s = stream
        self.logical = logical
        self.g = stream.rank * stream.workers + logical
        self.restore_rng = in_main_process
        self.state = copy.deepcopy(stream.worker_states[logical])

    # raw samples of one epoch, from a block start -----------------------------------------

    def _raw_epoch(self, plan: list[int], start: tuple[int, int, int, int]) -> Iterator[tuple]:
        """('sample', raw, shard, position after it) and ('bad', kind, shard, missing samples)."""
        s, W, g = self.s, self.s.readers, self.g
        plan_pos, index, offset, counter = start
        for p in range(plan_pos, len(plan)):
            shard, expected = s.shards[plan[p]], s.counts[plan[p]]
            if p != plan_pos:
                index, offset = 0, 0
            owner = not s.sample_level or p % W == g  # one reader reports a shard's own failures
            seen = index
            try:
                for raw in tario.iter_raw_samples(shard, index, offset):
                    seen = raw.index + 1
                    c, counter = counter, counter + 1
                    if s.sample_level and c % W != g:
                        continue
                    yield "sample", raw, shard, (p, raw.index + 1, raw.end, counter)
            except tario.ShardError as e:
                if owner:
                    yield "bad", e.kind, shard, max(1, expected - seen)
                continue
            if seen < expected and owner:  # the archive ended cleanly but early
                yield "bad", tario.TRUNCATED_TAR, shard, expected - seen

    def _samples(self) -> Iterator[tuple[Any, int]]:
        """Decoded, augmented (image tensor, label) pairs, forever; keeps self.state current."""
        s, st = self.s, self.state
        resumed_block = st["k"] > 0  # its shard-level events were counted before the state was saved
        while True:
            plan = s.plan(st["epoch"], self.g)
            raw_iter = self._raw_epoch(plan, (st["plan_pos"], st["index"], st["offset"], st["counter"]))
            got_any = False
            while True:
                block, after = [], None
                for item in raw_iter:
                    if item[0] == "bad":
                        got_any = True
                        if not resumed_block:
                            _count_bad(st, item[1], item[2], item[3])
                            self._check()
                        continue
                    block.append(item)
                    after = item[3]
                    if len(block) == s.block_size:
                        break
                resumed_block = False
                if not block:
                    break
                got_any = True
                rng = np.random.default_rng([s.seed, st["epoch"], self.g, st["block"], 0xB10C])
                order = rng.permutation(len(block)) if len(block) > 1 else [0]
                for i in range(st["k"], len(block)):
                    _, raw, shard, _ = block[order[i]]
                    st["k"] = i + 1
                    try:
                        if s.draw is not None:
                            data, img, label = _header(raw, s.label_key, s.num_classes)
                        else:
                            img, label = _decode(raw, s.label_key, s.num_classes)
                    except tario.SampleError as e:
                        _count_bad(st, e.kind, shard)
                        self._check()
                        continue
                    st["read"] += 1
                    with seeded(sample_seed(s.seed, st["epoch"], self.g, st["block"], i), self.restore_rng):
                        if s.draw is not None:  # same RNG calls as s.transform: same box and flip
                            box, flip = s.draw(img)
                            tensor = (data, box, flip, s.shard_index[shard])
                        else:
                            tensor = s.transform(img)
                    yield tensor, label
                st["block"] += 1
                st["plan_pos"], st["index"], st["offset"], st["counter"] = after
                st["k"] = 0
            if not got_any:
                raise DataError(f"reader {self.g} of {s.readers} found no samples in a whole epoch "
                                f"of {len(s.shards)} shards (are they empty?)")
            st.update(epoch=st["epoch"] + 1, block=0, plan_pos=0, index=0, offset=0, counter=0, k=0)

    def _check(self) -> None:
        msg = bad_fraction_message(self.state, self.s.cfg.max_bad_fraction,
                                   f"rank {self.s.rank} worker {self.logical}")
        if msg is not None:
            raise _Fatal(msg)

    def batches(self) -> Iterator[dict[str, Any]]:
        s = self.s
        try:
            samples = self._samples()
            while True:
                chunk = list(islice(samples, s.batch_size))
                if s.gpu_decode:  # raw bytes + boxes; decoded, mixed up by TrainLoader.to_device
                    mix_seed = sample_seed(s.seed, self.g, self.state["batches"], 0x4D1C)
                    self.state["batches"] += 1
                    yield {"images": pack_batch([t for t, _ in chunk], mix_seed),
                           "targets": torch.tensor([label for _, label in chunk], dtype=torch.long),
                           "worker": self.logical, "state": copy.deepcopy(self.state)}
                    continue
                images = empty_batch((s.batch_size, 3, *s.img_size), shared=not self.restore_rng)
                for j, (tensor, _) in enumerate(chunk):
                    s.normalize(tensor, out=images[j])  # uint8 -> normalised float32
                targets = torch.tensor([label for _, label in chunk], dtype=torch.long)
                if s.mixup is not None:
                    with seeded(sample_seed(s.seed, self.g, self.state["batches"], 0x4D1C), self.restore_rng):
                        images, targets = s.mixup(images, targets)
                self.state["batches"] += 1
                yield {"images": images, "targets": targets,
                       "worker": self.logical, "state": copy.deepcopy(self.state)}
        except _Fatal as e:
            yield {"error": str(e)}


class _Fatal(Exception):
    pass


class TrainLoader:
    """Infinite iterator of (images [B,3,H,W] float32, targets) for one rank; see the module doc."""

    def __init__(self, stream: TrainStream, cfg: DataConfig, pin_memory: bool | None = None):
        self.stream = stream
        self.cfg = cfg
        self.num_workers = cfg.num_workers
        self.soft_targets = stream.mixup is not None
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._worker_states = [_initial_worker_state() for _ in range(stream.workers)]
        self._batches = 0
        self._it: Iterator[dict[str, Any]] | None = None
        self._decode_bad = _new_counters()  # decode_device=cuda: bad bodies found at decode time
        self.decoder = (GpuBatchDecoder(stream.img_size, cfg.mean, cfg.std, cfg.interpolation)
                        if stream.gpu_decode else None)

    # iteration ------------------------------------------------------------------------------

    def _start(self) -> None:
        self.stream.worker_states = copy.deepcopy(self._worker_states)
        self.stream.rotation = self._batches % self.stream.workers
        loader = DataLoader(
            self.stream, batch_size=None, num_workers=self.num_workers, pin_memory=self.pin_memory,
            prefetch_factor=self.cfg.prefetch_factor if self.num_workers > 0 else None,
            generator=torch.Generator().manual_seed(self.stream.seed),  # leave the global torch RNG alone
        )
        self._it = iter(loader)

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._it is None:
            self._start()
        assert self._it is not None
        item = next(self._it)
        if "error" in item:
            self.close()
            raise BadDataError(item["error"])
        expected = self._batches % self.stream.workers
        if item["worker"] != expected:  # the DataLoader's round-robin is what makes resume exact
            raise RuntimeError(f"batch came from reader {item['worker']}, expected {expected}")
        self._worker_states[item["worker"]] = item["state"]
        self._batches += 1
        msg = bad_fraction_message(self._counters(), self.cfg.max_bad_fraction, f"rank {self.stream.rank}")
        if msg is not None:
            self.close()
            raise BadDataError(msg)
        return item["images"], item["targets"]

    def to_device(self, images: Any, targets: torch.Tensor, device: torch.device | str,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch from `next()` on `device`: a copy, or with decode_device=cuda the decode, crop,
        resize, flip, normalisation (and Mixup/CutMix) of the raw JPEG batch there."""
        if self.decoder is None:
            return images.to(device, dtype, non_blocking=True), targets.to(device, non_blocking=True)
        out, bad = self.decoder(images, device)
        targets = targets.to(device, non_blocking=True)
        if bad:
            shards = images["shards"].tolist()
            for k in bad:
                _count_bad(self._decode_bad, tario.CORRUPT_IMAGE, self.stream.shards[shards[k]])
                self._decode_bad["read"] -= 1  # the worker counted it read already
            replace_bad(out, targets, bad)
            msg = bad_fraction_message(self._counters(), self.cfg.max_bad_fraction, f"rank {self.stream.rank}")
            if msg is not None:
                self.close()
                raise BadDataError(msg)
        if self.stream.mixup is not None:
            with seeded(int(images["mixup_seed"]), restore=True):
                out, targets = self.stream.mixup(out, targets)
        return out.to(dtype), targets

    def close(self) -> None:
        """Stop the worker processes (they restart on the next batch)."""
        self._it = None

    # position and counts --------------------------------------------------------------------

    def _fingerprint(self) -> dict[str, Any]:
        s = self.stream
        # Names and counts, not full paths: the same shards mounted elsewhere still resume.
        names = [(sh.rsplit("/", 1)[-1], n) for sh, n in zip(s.shards, s.counts)]
        shards = hashlib.sha256(repr(names).encode()).hexdigest()[:16]
        return {"seed": s.seed, "rank": s.rank, "world_size": s.world_size, "workers": s.workers,
                "batch_size": s.batch_size, "shuffle_buffer": s.block_size, "shards": shards}

    def state_dict(self) -> dict[str, Any]:
        """Position after the last batch handed out (small, picklable, JSON-able)."""
        return {"version": STATE_VERSION, **self._fingerprint(), "batches": self._batches,
                "workers_state": copy.deepcopy(self._worker_states),
                "decode_bad": copy.deepcopy(self._decode_bad)}

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Continue from `state`. With another seed, world size, worker count, batch size or shard
        list the position cannot be replayed: an error, or with strict=False a warning and a fresh
        epoch (counts kept)."""
        if state.get("version") != STATE_VERSION:
            raise DataError(f"data loader state has version {state.get('version')}, expected {STATE_VERSION}")
        mine = self._fingerprint()
        diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        self.close()
        self._decode_bad = copy.deepcopy(state.get("decode_bad", _new_counters()))
        if not diff:
            self._worker_states = copy.deepcopy(state["workers_state"])
            self._batches = int(state["batches"])
            return
        what = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in diff.items())
        if strict:
            raise DataError(f"cannot resume the data stream exactly ({what}); "
                            f"use load_state_dict(state, strict=False) to start a fresh epoch")
        warnings.warn(f"data stream not resumed exactly ({what}): starting a fresh epoch", stacklevel=2)
        epoch = 1 + max(w["epoch"] for w in state["workers_state"])
        counts = _merge_counters(state["workers_state"])
        self._worker_states = [{**_initial_worker_state(), "epoch": epoch} for _ in range(self.stream.workers)]
        self._worker_states[0].update(counts)
        self._batches = 0

    def _counters(self) -> dict[str, Any]:
        return _merge_counters([*self._worker_states, self._decode_bad])

    def bad_counts(self) -> dict[str, int]:
        """Samples skipped, by kind (a shard that cannot be read counts all the samples dataset.json
        says it holds), cumulative for this rank: all workers, across resumes."""
        return dict(sorted(self._counters()["bad"].items()))

    def samples_read(self) -> int:
        """Samples this rank has read from the shards, good and bad, up to the last batch handed out."""
        return int(self._counters()["read"])


# ----------------------------------------------------------------------------- eval pass


class EvalStream(IterableDataset):
    def __init__(self, split: SplitInfo, cfg: DataConfig, img_size: tuple[int, int], batch_size: int,
                 lo: int, hi: int, num_batches: int, num_classes: int, label_key: str, workers: int):
        super().__init__()
        self.shards, self.counts = list(split.shards), list(split.shard_counts)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(int).tolist()
        self.cfg = cfg
        self.img_size = img_size
        self.batch_size = batch_size
        self.lo, self.hi = lo, hi
        self.num_batches = num_batches
        self.num_classes = num_classes
        self.label_key = label_key
        self.workers = max(1, workers)
        self.transform = eval_transform(cfg, img_size)
        self.normalize = BatchNormalizer(cfg.mean, cfg.std)

    def _read(self, start: int, stop: int, counters: dict[str, Any]) -> Iterator[tuple[Any, int]]:
        """(tensor or None, label) for each global index in [start, stop), in order."""
        for i, shard in enumerate(self.shards):
            a, b = max(start, self.starts[i]), min(stop, self.starts[i + 1])
            if a >= b:
                continue
            local, end = a - self.starts[i], b - self.starts[i]
            try:
                for raw in tario.iter_raw_samples(shard, local):
                    if raw.index >= end:
                        break
                    local = raw.index + 1
                    try:
                        img, label = _decode(raw, self.label_key, self.num_classes)
                    except tario.SampleError as e:
                        _count_bad(counters, e.kind, shard)
                        yield None, 0
                        continue
                    counters["read"] += 1
                    yield self.transform(img), label
            except tario.ShardError as e:
                _count_bad(counters, e.kind, shard, end - local)
                yield from [(None, 0)] * (end - local)
                continue
            if local < end:
                _count_bad(counters, tario.TRUNCATED_TAR, shard, end - local)
                yield from [(None, 0)] * (end - local)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        b0 = worker * self.num_batches // self.workers
        b1 = (worker + 1) * self.num_batches // self.workers
        B = self.batch_size
        counters = _new_counters()
        samples = self._read(self.lo + b0 * B, min(self.hi, self.lo + b1 * B), counters)
        for b in range(b0, b1):
            images = empty_batch((B, 3, *self.img_size), shared=info is not None)
            targets, valid = [], []
            for j in range(B):
                tensor, label = next(samples) if self.lo + b * B + j < self.hi else (None, 0)
                if tensor is not None:
                    self.normalize(tensor, out=images[j])
                else:
                    images[j].zero_()  # padding and bad samples, masked out by `valid`
                targets.append(label)
                valid.append(tensor is not None)
            yield {"images": images, "targets": torch.tensor(targets, dtype=torch.long),
                   "valid": torch.tensor(valid, dtype=torch.bool), "counters": copy.deepcopy(counters),
                   "worker": worker}


class EvalLoader:
    """One pass over this rank's share of the split: (images, targets, valid) batches, `len()` of them."""

    def __init__(self, stream: EvalStream, cfg: DataConfig, rank: int, pin_memory: bool | None = None):
        self.stream = stream
        self.cfg = cfg
        self.rank = rank
        self.num_workers = min(cfg.num_workers, stream.workers if stream.num_batches else 0)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._worker_counters: dict[int, dict[str, Any]] = {}

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
        loader = DataLoader(self.stream, batch_size=None, num_workers=self.num_workers,
                            pin_memory=self.pin_memory,
                            prefetch_factor=self.cfg.prefetch_factor if self.num_workers > 0 else None,
                            generator=torch.Generator().manual_seed(0))
        for item in loader:
            self._worker_counters[item["worker"]] = item["counters"]
            msg = bad_fraction_message(_merge_counters(list(self._worker_counters.values())),
                                       self.cfg.max_bad_fraction, f"rank {self.rank} (eval)")
            if msg is not None:
                raise BadDataError(msg)
            yield item["images"], item["targets"], item["valid"]

    def bad_counts(self) -> dict[str, int]:
        """Bad samples by kind in the current (or last) pass."""
        return dict(sorted(_merge_counters(list(self._worker_counters.values()))["bad"].items()))


# ----------------------------------------------------------------------------- builders


def _label_key(cfg: DataConfig, info: DatasetInfo) -> str:
    # dataset.json records where make_shards found the labels; the config wins when it is set.
    return cfg.label_key if cfg.label_key != "cls" else info.label_key


def _check_placement(batch_size: int, rank: int, world_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")


def build_train_loader(cfg: DataConfig, img_size: int | tuple[int, int], batch_size: int, seed: int,
                       rank: int = 0, world_size: int = 1, num_classes: int | None = None,
                       info: DatasetInfo | None = None) -> TrainLoader:
    """The infinite, resumable train stream of one rank (see the module docstring)."""
    _check_placement(batch_size, rank, world_size)
    info = info or read_dataset_info(cfg.path)
    split = info.split(cfg.train_split)
    num_classes = num_classes or info.num_classes
    stream = TrainStream(split, cfg, image_size(img_size), batch_size, seed, rank, world_size,
                         num_classes, _label_key(cfg, info))
    if split.num_samples < stream.readers:
        raise DataError(f"split '{cfg.train_split}' of {info.path} has {split.num_samples} samples, fewer than "
                        f"the {stream.readers} readers (world size {world_size} x {stream.workers} workers)")
    if stream.sample_level and rank == 0:
        warnings.warn(
            f"{len(split.shards)} shards for {stream.readers} readers (world size {world_size} x "
            f"{stream.workers} workers): every reader reads every shard and keeps every "
            f"{stream.readers}th sample; write at least {stream.readers} shards "
            f"(make_shards.py --max-samples-per-shard) to read each byte once", stacklevel=2)
    return TrainLoader(stream, cfg)


def build_eval_loader(cfg: DataConfig, img_size: int | tuple[int, int], batch_size: int, rank: int = 0,
                      world_size: int = 1, num_classes: int | None = None,
                      info: DatasetInfo | None = None) -> EvalLoader:
    """One exactly-once pass over the validation split, the same number of batches on every rank."""
    _check_placement(batch_size, rank, world_size)
    info = info or read_dataset_info(cfg.path)
    split = info.split(cfg.val_split)
    n = split.num_samples
    lo, hi = rank * n // world_size, (rank + 1) * n // world_size
    per_rank = -(-n // world_size)
    num_batches = -(-per_rank // batch_size)
    workers = max(1, min(cfg.num_workers, num_batches))
    stream = EvalStream(split, cfg, image_size(img_size), batch_size, lo, hi, num_batches,
                        num_classes or info.num_classes, _label_key(cfg, info), workers)
    return EvalLoader(stream, cfg, rank)
